"""The offline Python API: `LLM(model).generate(prompts, SamplingParams)` and `LLM.chat`, which
start an engine and its ranks in this process's children and drive them like vLLM's `LLM` does.
Nothing in the project imports this package; it sits on top, beside deploy/.
"""

from kvserve.llm import LLM
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
