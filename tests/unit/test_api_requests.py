"""Request validation of the OpenAI routes, without a server: every refusal is a 400 (or 404)
in OpenAI's error shape that names the parameter at fault."""

import json

import msgspec
import pytest

from api_server.openai.engine_requests import chat_job, completion_jobs, engine_refusal
from api_server.openai.errors import ApiError
from api_server.openai.protocol import (
    CHAT_DECODER,
    COMPLETION_DECODER,
    CompletionRequest,
    check_model,
    parse_body,
)
from api_server.tokenizer.prompt_tokenizer import ByteTokenizer
from protocol.buffers import unpack_int32

TOKENIZER = ByteTokenizer()
MAX_MODEL_LEN = 64  # of the engines these requests are checked against


def _parsed(body: str, decoder: msgspec.json.Decoder = COMPLETION_DECODER) -> object:
    return parse_body(body.encode("utf-8", "surrogateescape"), decoder)


def _refusal(body: str, decoder: msgspec.json.Decoder = COMPLETION_DECODER) -> ApiError:
    try:
        parsed = _parsed(body, decoder)
    except ApiError as exc:
        return exc
    try:
        if isinstance(parsed, CompletionRequest):
            completion_jobs(parsed, TOKENIZER, "cmpl-test", MAX_MODEL_LEN)
        else:
            chat_job(parsed, TOKENIZER, "chatcmpl-test", MAX_MODEL_LEN)  # type: ignore[arg-type]
    except ApiError as exc:
        return exc
    raise AssertionError(f"{body} was accepted")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
        ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        ('{"prompt": "x", "max_tokens": 5, "min_tokens": 6}', "min_tokens"),
        ('{"prompt": "x", "temperature": -1}', "temperature"),
        ('{"prompt": "x", "temperature": "hot"}', "temperature"),
        ('{"prompt": "x", "seed": -1}', "seed"),
        ('{"prompt": "x", "stop_token_ids": [-1]}', "stop_token_ids"),
        ('{"prompt": "x", "stop_token_ids": "2"}', "stop_token_ids"),
        ('{"prompt": "x", "ignore_eos": 1}', "ignore_eos"),
        ('{"prompt": "x", "n": 0}', "n"),
        ('{"prompt": "x", "n": 129}', "n"),
        ('{"prompt": "x", "logit_bias": {"1": 101}}', "logit_bias"),
        ('{"prompt": "x", "stream": "yes"}', "stream"),
        ('{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options"),
        (
            '{"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}}',
            "stream_options.include_usage",
        ),
        ('{"prompt": "x", "echo": true, "logprobs": 0, "stream": true}', "echo"),
        ('{"prompt": "x", "logprobs": 21}', "logprobs"),
        ('{"prompt": "x", "logprobs": -1}', "logprobs"),
        ('{"prompt": "x", "priority": 3000000000}', "priority"),
        ('{"prompt": "x", "cache_salt": ""}', "cache_salt"),
        ('{"prompt": "x", "top_p": 0}', "top_p"),
        ('{"prompt": "x", "top_p": 1.5}', "top_p"),
        ('{"prompt": "x", "top_k": -2}', "top_k"),
        ('{"prompt": "x", "min_p": 2}', "min_p"),
        ('{"prompt": "x", "presence_penalty": 3}', "presence_penalty"),
        ('{"prompt": "x", "frequency_penalty": -2.5}', "frequency_penalty"),
        ('{"prompt": "x", "repetition_penalty": 0}', "repetition_penalty"),
        ('{"prompt": "x", "stop": [5]}', "stop[0]"),
        ('{"prompt": "x", "stop": [""]}', "stop"),
        ('{"prompt": "x", "stop": ""}', "stop"),
        ('{"prompt": "x", "skip_special_tokens": "no"}', "skip_special_tokens"),
        ('{"prompt": "x", "max_tokens": 64}', "max_tokens"),
        ('{"prompt": "' + "x" * 64 + '"}', "prompt"),
        ('{"prompt": ' + json.dumps(list(range(64))) + "}", "prompt"),
        ('{"max_tokens": 5}', "prompt"),
        ('{"prompt": 5}', "prompt"),
        ('{"prompt": [1, "a"]}', "prompt"),
        ('{"prompt": []}', "prompt"),
        ('{"prompt": ""}', "prompt"),
        ('{"prompt": [[1], []]}', "prompt"),
        ('{"prompt": [1, -2]}', "prompt"),
        ('{"prompt": [4294967296]}', "prompt"),
    ],
)
def test_a_bad_completion_parameter_is_a_400_naming_it(body: str, param: str) -> None:
    error = _refusal(body)
    assert error.status == 400
    assert error.param == param
    assert param in error.message
    shape = error.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"}
    assert shape["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"messages": []}', "messages"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role"),
        ('{"messages": [{"role": "tool", "content": "x"}]}', "messages[0].tool_call_id"),
        (
            '{"messages": [{"role": "user", "content": "x", "tool_calls": []}]}',
            "messages[0].tool_calls",
        ),
        (
            '{"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", '
            '"function": {"name": "f", "arguments": "{"}}]}]}',
            "messages[0].tool_calls[0].function.arguments",
        ),
        ('{"messages": [{"role": "assistant", "content": null}]}', "messages[0].content"),
        ('{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        ('{"messages": [{"role": "user"}]}', "messages[0].content"),
        ('{"messages": [{"role": "user", "content": "x"}], "logprobs": 1}', "logprobs"),
        ('{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "top_logprobs"),
        (
            '{"messages": [{"role": "user", "content": "x"}], "logprobs": true, '
            '"top_logprobs": 21}',
            "logprobs",
        ),
        ('{"messages": [{"role": "user", "content": "x"}], "tools": [{}]}', "tools"),
        (
            '{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
            "tool_choice",
        ),
        ('{"messages": [{"role": "user", "content": "' + "x" * 61 + '"}]}', "messages"),
        (
            '{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 61}',
            "max_completion_tokens",
        ),
        (
            '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, '
            '"max_completion_tokens": 1}',
            "max_completion_tokens",
        ),
    ],
)
def test_a_bad_chat_parameter_is_a_400_naming_it(body: str, param: str) -> None:
    error = _refusal(body, CHAT_DECODER)
    assert (error.status, error.param) == (400, param)


@pytest.mark.parametrize("body", ["{", "[1, 2]", "null", "\xff"])
def test_a_body_that_is_not_a_json_object_is_a_400(body: str) -> None:
    error = _refusal(body)
    assert error.status == 400
    assert error.param is None
    assert "json" in error.message.lower() or "object" in error.message


def test_an_unknown_model_is_a_404() -> None:
    check_model(None, ("tiny-llama",))
    check_model("tiny-llama", ("tiny-llama",))
    check_model("alias", ("tiny-llama", "alias"))
    with pytest.raises(ApiError) as info:
        check_model("tiny", ("tiny-llama",))
    assert info.value.status == 404
    assert info.value.body()["error"]["code"] == "model_not_found"


def test_a_batch_becomes_one_engine_request_per_prompt() -> None:
    body = _parsed(
        json.dumps({"prompt": ["hi", "yo"], "max_tokens": 3, "temperature": 0, "priority": -1})
    )
    jobs = completion_jobs(body, TOKENIZER, "cmpl-x")
    assert [job.request.req_id for job in jobs] == ["cmpl-x-0", "cmpl-x-1"]
    assert list(unpack_int32(jobs[1].request.prompt_token_ids)) == [121, 111]
    assert jobs[0].request.sampling_params.max_tokens == 3
    assert jobs[0].request.priority == -1
    assert jobs[0].num_tokens == 2 + 3


def test_token_id_prompts_and_batches_of_them_are_accepted() -> None:
    for prompt, expected in (([5, 6], [[5, 6]]), ([[5], [6, 7]], [[5], [6, 7]])):
        body = _parsed(json.dumps({"prompt": prompt}))
        assert [job.prompt_token_ids for job in completion_jobs(body, TOKENIZER, "c")] == expected


def test_chat_uses_the_template_and_max_completion_tokens() -> None:
    body = _parsed(
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], '
        '"max_completion_tokens": 7}',
        CHAT_DECODER,
    )
    job = chat_job(body, TOKENIZER, "chatcmpl-x")
    assert TOKENIZER.decode(job.prompt_token_ids) == "<|user|>hi<|end|><|assistant|>"
    assert job.request.sampling_params.max_tokens == 7


@pytest.mark.parametrize(
    ("error", "status"),
    [
        ("engine busy: 4096 requests waiting, retry later", 503),
        ("client busy: 1024 live requests", 503),
        (
            "token id 600 in the prompt of 'c-0' is out of the vocabulary: expected 0 <= id < 512",
            400,
        ),
        ("prompt of 'c-0' has 9000 tokens: expected at most max_model_len=4096", 400),
        ("worker 1 died", 500),
        (None, 500),
    ],
)
def test_an_engine_refusal_gets_the_status_of_its_cause(error: str | None, status: int) -> None:
    assert engine_refusal(error).status == status


def test_max_tokens_defaults_are_vllms_and_fit_max_model_len() -> None:
    """A chat may run to the end of the context; a completion gets 16 tokens, fewer when the
    context has less room; a given max_tokens that fits is kept."""
    chat = _parsed('{"messages": [{"role": "user", "content": "hi"}]}', CHAT_DECODER)
    job = chat_job(chat, TOKENIZER, "c", MAX_MODEL_LEN)  # type: ignore[arg-type]
    assert job.request.sampling_params.max_tokens == MAX_MODEL_LEN - len(job.prompt_token_ids)
    short = completion_jobs(_parsed('{"prompt": "x"}'), TOKENIZER, "c", MAX_MODEL_LEN)  # type: ignore[arg-type]
    assert short[0].request.sampling_params.max_tokens == 16
    near_full = _parsed(json.dumps({"prompt": "x" * 60}))
    assert completion_jobs(near_full, TOKENIZER, "c", MAX_MODEL_LEN)[0].num_tokens == 64  # type: ignore[arg-type]
    exact = _parsed('{"prompt": "x", "max_tokens": 63}')
    assert completion_jobs(exact, TOKENIZER, "c", MAX_MODEL_LEN)[0].num_tokens == 64  # type: ignore[arg-type]


def test_sampling_parameters_reach_the_engine_request() -> None:
    body = _parsed(
        json.dumps(
            {
                "prompt": "x",
                "top_p": 0.9,
                "top_k": -1,
                "min_p": 0.05,
                "presence_penalty": 0.5,
                "frequency_penalty": -0.5,
                "repetition_penalty": 1.1,
                "seed": 7,
                "logprobs": 3,
                "stop": "\n",
                "skip_special_tokens": False,
            }
        )
    )
    job = completion_jobs(body, TOKENIZER, "c", MAX_MODEL_LEN)[0]  # type: ignore[arg-type]
    params = job.request.sampling_params
    assert (params.top_p, params.top_k, params.min_p) == (0.9, None, 0.05)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert (params.repetition_penalty, params.seed, params.logprobs) == (1.1, 7, 3)
    assert (job.stops, job.skip_special_tokens, job.num_logprobs) == (["\n"], False, 3)
    chat = _parsed(
        '{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_k": 5}',
        CHAT_DECODER,
    )
    chat_params = chat_job(chat, TOKENIZER, "c", MAX_MODEL_LEN).request.sampling_params  # type: ignore[arg-type]
    assert (chat_params.logprobs, chat_params.top_k) == (0, 5)
