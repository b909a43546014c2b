"""The offline API without processes: every prompt form vLLM's LLM accepts becomes one
PromptInput per prompt, sampling params pair with prompts, vLLM's spellings of SamplingParams
reach the engine as kvserve's, keyword overrides land in the right config, and outputs have
vLLM's shape.
"""

import dataclasses
from pathlib import Path

import pytest

from kvserve import CompletionOutput, RequestOutput, SamplingParams
from kvserve.engine_args import offline_configs
from kvserve.prompts import (
    PromptInput,
    normalize_conversations,
    normalize_prompts,
    params_per_prompt,
)
from kvserve.sampling_params import engine_params, num_choices
from protocol import sampling


def test_a_single_prompt_of_any_form_is_a_batch_of_one() -> None:
    assert normalize_prompts("hi") == [PromptInput("hi", None)]
    assert normalize_prompts([5, 6]) == [PromptInput(None, [5, 6])]
    assert normalize_prompts({"prompt_token_ids": [7]}) == [PromptInput(None, [7])]
    assert normalize_prompts({"prompt": "yo"}) == [PromptInput("yo", None)]


def test_a_list_of_mixed_prompts_keeps_its_order() -> None:
    prompts = ["a", [1, 2], {"prompt_token_ids": [3]}, "b"]
    assert normalize_prompts(prompts) == [
        PromptInput("a", None),
        PromptInput(None, [1, 2]),
        PromptInput(None, [3]),
        PromptInput("b", None),
    ]


def test_bad_prompts_are_refused_naming_their_index() -> None:
    with pytest.raises(TypeError, match="prompt 1 of type float"):
        normalize_prompts(["a", 1.5])
    with pytest.raises(ValueError, match="prompt 0: no token ids"):
        normalize_prompts([{"prompt_token_ids": []}])
    with pytest.raises(TypeError, match="prompt 0 of type list"):
        normalize_prompts([[1, "x"]])


def test_one_params_serves_every_prompt_and_a_list_must_match() -> None:
    greedy = SamplingParams(max_tokens=3)
    assert params_per_prompt(greedy, 3) == [greedy] * 3
    assert params_per_prompt(None, 2) == [sampling.SamplingParams()] * 2
    assert params_per_prompt([greedy, greedy], 2) == [greedy, greedy]
    with pytest.raises(ValueError, match="1 sampling params for 2 prompts"):
        params_per_prompt([greedy], 2)


def test_one_conversation_or_a_list_of_them() -> None:
    chat = [{"role": "user", "content": "hi"}]
    assert normalize_conversations(chat) == [chat]
    assert normalize_conversations([chat, chat]) == [chat, chat]
    with pytest.raises(ValueError, match="conversation 1"):
        normalize_conversations([chat, [{"content": "no role"}]])


def test_vllm_spellings_reach_the_engine_as_kvserve_params() -> None:
    params = SamplingParams(max_tokens=4, temperature=0.7, top_k=-1, stop="\n", seed=3)
    engine = engine_params(params)
    assert type(engine) is sampling.SamplingParams
    assert engine.top_k is None and engine.max_tokens == 4 and engine.seed == 3
    assert params.stop_strings == ["\n"]
    assert engine_params(SamplingParams(top_k=0)).top_k is None


def test_out_of_bounds_params_are_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="sampling parameters"):
        engine_params(SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="n=0: expected 1 to 128"):
        engine_params(SamplingParams(n=0))
    with pytest.raises(ValueError, match="n=129: expected 1 to 128"):
        num_choices(SamplingParams(n=129))
    assert num_choices(SamplingParams(n=4)) == 4


def test_overrides_land_in_their_config(tmp_path: Path) -> None:
    engine, worker = offline_configs(
        "tiny-llama",
        2,
        "float32",
        128,
        7,
        tmp_path,
        {"max_num_seqs": 8, "block_size": 4, "device": "cpu", "kv_cache_memory_bytes": 1 << 20},
    )
    assert engine.tp_size == 2 and engine.scheduler.max_model_len == 128
    assert engine.scheduler.max_num_seqs == 8 and engine.cache.block_size == 4
    assert engine.client_address == f"ipc://{tmp_path}/client.sock"
    assert (worker.model, worker.dtype, worker.seed, worker.device) == (
        "tiny-llama",
        "float32",
        7,
        "cpu",
    )


def test_unknown_or_out_of_bounds_overrides_are_refused(tmp_path: Path) -> None:
    args = ("tiny-llama", 1, "auto", None, 0, tmp_path)
    with pytest.raises(TypeError, match="unknown keyword argument 'trust_remote_code'"):
        offline_configs(*args, {"trust_remote_code": True})
    with pytest.raises(ValueError, match="LLM arguments"):
        offline_configs(*args, {"max_num_seqs": 0, "kv_cache_memory_bytes": 1 << 20})
    with pytest.raises(ValueError, match="--model no-such-model"):
        offline_configs("no-such-model", *args[1:], {})


def test_outputs_have_vllms_fields() -> None:
    output = RequestOutput("0", "hi", [1], [CompletionOutput(0, "yo", [5, 2], "stop")])
    assert [f.name for f in dataclasses.fields(output)] == [
        "request_id",
        "prompt",
        "prompt_token_ids",
        "outputs",
        "finished",
        "prompt_logprobs",
    ]
    assert output.finished and output.outputs[0].logprobs is None
    assert output.prompt_logprobs is None
    assert [f.name for f in dataclasses.fields(CompletionOutput)] == [
        "index",
        "text",
        "token_ids",
        "finish_reason",
        "logprobs",
    ]
