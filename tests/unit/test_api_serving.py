"""Responses shaped from hand-made engine outputs: stop strings end a choice (streamed or whole)
and abort its engine request, text is held back while it could still become one, and logprobs
come in OpenAI's completion and chat shapes. A fake engine socket sits under the real
AsyncEngineClient, EnginePool and Serving; the tokenizer is the byte one (one id per byte).
"""

import asyncio
import json
import math

import pytest

import api_server.routing.engine_handle as engine_handle_module
from api_server.openai.engine_requests import EngineJob, chat_job, completion_jobs
from api_server.openai.logprobs import LOGPROB_FLOOR, ChoiceLogprobs
from api_server.openai.protocol import CHAT_DECODER, COMPLETION_DECODER, parse_body
from api_server.openai.serving import SSE_DONE, ResponseShape, Serving
from api_server.routing.engine_pool import EnginePool
from api_server.tokenizer.prompt_tokenizer import ByteTokenizer
from protocol.client_messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    TokenLogprobs,
)
from tests.unit.test_api_disconnect import FakeEngineSocket, fake_client, stop, turns_until

TOKENIZER = ByteTokenizer()
MAX_MODEL_LEN = 4096


class ScriptedEngine(FakeEngineSocket):
    """Answers each request with `text`'s bytes, one token per output and loop turn, with
    logprobs when asked (the sampled id at log(0.5), then alternatives id+1, id+2, ... lower),
    until the text ends (finish_reason length) or the request is aborted."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.token_ids = list(text.encode())
        self.num_sent: dict[str, int] = {}

    async def run(self, req_id: str, num_logprobs: int | None) -> None:
        await turns_until(lambda: req_id in self.request_ids(), f"{req_id} reaching the engine")
        for idx, token_id in enumerate(self.token_ids):
            if req_id in self.aborted_ids():
                return
            is_last = idx == len(self.token_ids) - 1
            logprobs = None
            if num_logprobs is not None:
                ids = [token_id] + [token_id + 1 + k for k in range(num_logprobs)]
                values = [math.log(0.5)] + [-1.0 - k for k in range(num_logprobs)]
                logprobs = TokenLogprobs([ids], [values], [1])
            output = EngineCoreOutput(
                req_id, [token_id], FinishReason.LENGTH if is_last else None, 0, None, logprobs
            )
            self._inbox.put_nowait(self._encoder.encode(EngineCoreOutputs([output])))
            self.num_sent[req_id] = idx + 1
            await asyncio.sleep(0)


def _setup(text: str, monkeypatch: pytest.MonkeyPatch) -> tuple[ScriptedEngine, Serving]:
    sock = ScriptedEngine(text)
    monkeypatch.setattr(
        engine_handle_module, "AsyncEngineClient", lambda *_, **__: fake_client(sock)
    )
    pool = EnginePool(["fake://engine"], block_size=4, timeout_s=60.0)
    pool.records[0].is_healthy = True
    return sock, Serving(pool, TOKENIZER, "tiny-llama")


def _jobs(body: dict, is_chat: bool) -> list[EngineJob]:
    raw = json.dumps(body).encode()
    if is_chat:
        return [chat_job(parse_body(raw, CHAT_DECODER), TOKENIZER, "chat-t", MAX_MODEL_LEN)]  # type: ignore[arg-type]
    return completion_jobs(parse_body(raw, COMPLETION_DECODER), TOKENIZER, "cmpl-t", MAX_MODEL_LEN)  # type: ignore[arg-type]


async def _stream(
    text: str,
    body: dict,
    is_chat: bool,
    monkeypatch: pytest.MonkeyPatch,
    has_usage_per_chunk: bool = False,
) -> tuple[list[dict], ScriptedEngine]:
    sock, serving = _setup(text, monkeypatch)
    jobs = _jobs(body, is_chat)
    engines = [asyncio.ensure_future(sock.run(j.request.req_id, j.num_logprobs)) for j in jobs]
    shape = ResponseShape("resp", "tiny-llama", is_chat, has_usage_per_chunk=has_usage_per_chunk)
    started = await serving.first_outputs(jobs)
    events = [event async for event in serving.stream(started, shape, include_usage=True)]
    await asyncio.gather(*engines)
    await stop(*serving.pool.handles[0].client._tasks)  # the fake socket has nothing to close
    assert events[-1] == SSE_DONE
    return [json.loads(event.removeprefix(b"data: ")) for event in events[:-1]], sock


async def _whole(
    text: str, body: dict, is_chat: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict, ScriptedEngine]:
    sock, serving = _setup(text, monkeypatch)
    jobs = _jobs(body, is_chat)
    engines = [asyncio.ensure_future(sock.run(j.request.req_id, j.num_logprobs)) for j in jobs]
    response = await serving.complete(jobs, ResponseShape("resp", "tiny-llama", is_chat))
    await asyncio.gather(*engines)
    await stop(*serving.pool.handles[0].client._tasks)  # the fake socket has nothing to close
    return response, sock


def test_a_streamed_stop_string_split_across_tokens_is_never_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = {"prompt": "x", "max_tokens": 100, "stop": ["STOP"], "stream": True}
    chunks, sock = asyncio.run(_stream("hello STOP world", body, False, monkeypatch))
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    texts = [choice["text"] for choice in choices]
    assert "".join(texts) == "hello "
    assert choices[-1]["finish_reason"] == "stop"
    assert all(choice["finish_reason"] is None for choice in choices[:-1])
    assert sock.aborted_ids() == ["cmpl-t-0"]  # the engine stops generating
    assert sock.num_sent["cmpl-t-0"] < len("hello STOP world")
    assert chunks[-1]["usage"]["completion_tokens"] == len("hello STOP")


def test_held_back_text_comes_out_once_it_cannot_be_a_stop_string(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = {"prompt": "x", "max_tokens": 100, "stop": ["STOP", "\n\n"], "stream": True}
    chunks, sock = asyncio.run(_stream("a STOCK\n!", body, False, monkeypatch))
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    texts = [choice["text"] for choice in choices]
    assert "".join(texts) == "a STOCK\n!"
    assert texts[2:5] == ["", "", ""]  # S, T and O waited for the C
    assert choices[-1]["finish_reason"] == "length"
    assert sock.aborted_ids() == []


def test_a_whole_chat_ends_before_its_stop_string_and_aborts_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stop": "é!"}
    response, sock = asyncio.run(_whole("voilà café! encore", body, True, monkeypatch))
    choice = response["choices"][0]
    assert choice["message"]["content"] == "voilà caf"
    assert choice["finish_reason"] == "stop"
    assert sock.aborted_ids() == ["chat-t-0"]


def test_stop_strings_wait_for_min_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"prompt": "x", "max_tokens": 100, "stop": "a", "min_tokens": 3}
    response, _ = asyncio.run(_whole("banana", body, False, monkeypatch))
    assert response["choices"][0]["text"] == "ban"  # the 'a' at token 2 is before min_tokens


def test_streamed_multibyte_characters_come_out_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"prompt": "x", "max_tokens": 100, "stream": True}
    chunks, _ = asyncio.run(_stream("é🙂", body, False, monkeypatch))
    texts = [chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]]
    assert texts == ["", "é", "", "", "", "🙂"]


def test_completion_logprobs_in_openai_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"prompt": "x", "max_tokens": 100, "logprobs": 2}
    response, _ = asyncio.run(_whole("ab", body, False, monkeypatch))
    logprobs = response["choices"][0]["logprobs"]
    assert logprobs == {
        "tokens": ["a", "b"],
        "token_logprobs": [math.log(0.5)] * 2,
        "top_logprobs": [
            {"a": math.log(0.5), "b": -1.0, "c": -2.0},
            {"b": math.log(0.5), "c": -1.0, "d": -2.0},
        ],
        "text_offset": [0, 1],
    }


def test_streamed_chat_logprobs_in_openai_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100,
        "logprobs": True,
        "top_logprobs": 1,
        "stream": True,
    }
    chunks, _ = asyncio.run(_stream("ok", body, True, monkeypatch))
    contents = [c["choices"][0]["logprobs"] for c in chunks[1:] if c["choices"]]
    assert contents == [
        {
            "content": [
                {
                    "token": token,
                    "logprob": math.log(0.5),
                    "bytes": [ord(token)],
                    "top_logprobs": [{"token": after, "logprob": -1.0, "bytes": [ord(after)]}],
                }
            ]
        }
        for token, after in (("o", "p"), ("k", "l"))
    ]
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk


def test_no_logprobs_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    response, _ = asyncio.run(_whole("ab", {"prompt": "x"}, False, monkeypatch))
    assert response["choices"][0]["logprobs"] is None
    assert response["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_logprob_shaping_offsets_clamps_and_bytes() -> None:
    """text_offset keeps counting across chunks; -inf (JSON has none) becomes LOGPROB_FLOOR;
    a lone byte of a longer character is U+FFFD, its bytes those of what is shown."""
    shaper = ChoiceLogprobs(TOKENIZER, is_chat=False, num_top=1)
    shaper.push(TokenLogprobs([[104, 105]], [[-0.1, -float("inf")]], [1]))
    fragment = shaper.push(TokenLogprobs([[0xC3], [105]], [[-0.2], [-0.3]], [2, 1]))
    assert fragment["text_offset"] == [1, 2]
    whole = shaper.whole()
    assert whole["tokens"] == ["h", "\ufffd", "i"]
    assert whole["top_logprobs"][0] == {"h": -0.1, "i": LOGPROB_FLOOR}
    assert whole["text_offset"] == [0, 1, 2]
    chat = ChoiceLogprobs(TOKENIZER, is_chat=True, num_top=0)
    entry = chat.push(TokenLogprobs([[0xC3]], [[-0.5]], [1]))["content"][0]
    replacement = {"token": "\ufffd", "logprob": -0.5, "bytes": [0xEF, 0xBF, 0xBD]}
    assert entry == {**replacement, "top_logprobs": []}


def test_a_malformed_logprob_row_is_refused() -> None:
    with pytest.raises(ValueError, match="logprob row"):
        shaper = ChoiceLogprobs(TOKENIZER, is_chat=True, num_top=0)
        shaper.push(TokenLogprobs([[1, 2]], [[0.0]], [1]))


def test_continuous_usage_stats_put_usage_on_every_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"prompt": "x", "max_tokens": 100, "stream": True}
    chunks, _ = asyncio.run(_stream("abc", body, False, monkeypatch, has_usage_per_chunk=True))
    assert [chunk["usage"]["completion_tokens"] for chunk in chunks] == [1, 2, 3, 3]
    options = {"include_usage": True, "continuous_usage_stats": True}
    raw = json.dumps({**body, "stream_options": options}).encode()
    assert parse_body(raw, COMPLETION_DECODER).has_usage_per_chunk


def test_echo_puts_the_prompt_before_the_completion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole and streamed, for a text prompt and for token ids (read back as text); usage
    counts the prompt once, as prompt tokens."""
    body = {"prompt": "Say: ", "max_tokens": 100, "echo": True}
    response, _ = asyncio.run(_whole("hi", body, False, monkeypatch))
    assert response["choices"][0]["text"] == "Say: hi"
    assert response["usage"]["completion_tokens"] == 2
    by_ids = {**body, "prompt": list(b"Say: "), "stream": True}
    chunks, _ = asyncio.run(_stream("hi", by_ids, False, monkeypatch))
    texts = [chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"]]
    assert texts == ["Say: ", "h", "i"]
