"""RequestOutput and CompletionOutput: what `LLM.generate` returns per prompt, shaped as vLLM's
offline API shapes it. Plain data; nothing here talks to an engine.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's logprob in a prompt's logprobs, as vLLM's Logprob."""

    logprob: float
    rank: int  # 1 is the most likely token
    decoded_token: str


@dataclass(slots=True)
class CompletionOutput:
    """One generated continuation of a prompt: choice `index` of its SamplingParams.n."""

    index: int
    text: str  # detokenized, stop string and stop token not shown
    token_ids: list[int]  # every id the engine generated, a final EOS or stop id included
    finish_reason: str | None  # "stop" (EOS, stop id or stop string) or "length"
    logprobs: None = None  # not offered offline yet


@dataclass(slots=True)
class RequestOutput:
    """Everything one prompt produced."""

    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # SamplingParams.prompt_logprobs's: None for the first token, then each token's own and its
    # top N by token id; None when not asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
