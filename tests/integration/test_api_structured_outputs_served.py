"""Structured outputs served by `kvserve serve --model DIR` on a random-weight checkpoint (with
asynchronous scheduling), driven by the official openai client: 100 concurrent json_schema
requests, streamed and not, greedy and sampled, all return JSON that validates against the
schema and end with "stop"; regex and choice likewise; and bad constraints (a schema 10,000
levels deep, a 5 MB regex, a grammar that does not compile) are 400s naming the field while a
greedy client beside them gets exactly its tokens.
"""

import asyncio
import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from bench.make_checkpoint import CheckpointSpec, make_checkpoint
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from protocol.sampling import SamplingParams, StructuredOutputs
from tests.integration.conftest import (
    checked_processes,
    free_tcp_ports,
    stop_process,
    wait_http_healthy,
)

pytestmark = pytest.mark.integration

STARTUP_TIMEOUT_S = 180.0  # torch imports, the checkpoint and the KV budget, on a loaded machine
HTTP_TIMEOUT_S = 120.0
NUM_JSON_REQUESTS = 100
CONCURRENCY = 16
MAX_TOKENS = 400  # bounded strings and arrays, whitespace runs of at most 8: the JSON fits
BODY_LIMIT_BYTES = 16 * 1024 * 1024  # so a 5 MB regex reaches the check, not the 413
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,6}-[0-9]{2,4}"
CHOICES = ["Paris", "London", "Berlin"]
ENGINE_FOLDERS: dict[str, Path] = {}  # a served URL -> the folder of its engine's sockets


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), CheckpointSpec(arch="qwen3"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[str]:
    """`kvserve serve --model DIR` on a tiny qwen3 checkpoint; its base URL (the engine's client
    socket is `ipc://{ENGINE_FOLDERS[url]}/client.sock`)."""
    folder = tmp_path_factory.mktemp("structured")
    with _serve(folder, checkpoint, ["--async-scheduling"]) as url:
        ENGINE_FOLDERS[url] = folder
        yield url


@contextlib.contextmanager
def _serve(folder: Path, checkpoint: Path, extra_args: list[str]) -> Iterator[str]:
    """`kvserve serve --model DIR` with `extra_args`, stopped (and no child left) on leaving."""
    port, master_port = free_tcp_ports(2)
    args = ["serve", "--model", str(checkpoint), "--device", "cpu", *extra_args]
    args += ["--port", str(port), "--master-port", str(master_port), "--log-level", "INFO"]
    args += ["--max-request-body-bytes", str(BODY_LIMIT_BYTES)]
    args += ["--client-address", f"ipc://{folder}/client.sock"]
    args += ["--worker-address", f"ipc://{folder}/worker.sock"]
    with checked_processes(folder) as processes:
        processes.start("serve", "kvserve_main", args)
        url = f"http://127.0.0.1:{port}"
        wait_http_healthy(processes, "serve", url, STARTUP_TIMEOUT_S)
        yield url
        stop_process(processes, "serve", timeout_s=60)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT_S
    )


def _messages(idx: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Describe person number {idx} as JSON."}]


async def _json_reply(client: openai.AsyncOpenAI, model: str, idx: int) -> tuple[str, str]:
    """Request `idx`'s text and finish reason: streamed when idx is odd, sampled when idx % 4
    is 2 or 3 (seeded), greedy otherwise."""
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    sampling = {"temperature": 1.0, "seed": idx} if idx % 4 >= 2 else {"temperature": 0.0}
    common = dict(model=model, messages=_messages(idx), max_tokens=MAX_TOKENS, **sampling)
    if idx % 2 == 0:
        whole = await client.chat.completions.create(response_format=response_format, **common)
        return whole.choices[0].message.content or "", whole.choices[0].finish_reason
    stream = await client.chat.completions.create(
        response_format=response_format, stream=True, **common
    )
    pieces, finish_reason = [], ""
    async for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish_reason = choice.finish_reason or finish_reason
    return "".join(pieces), finish_reason


@pytest.mark.timeout(900)
def test_a_hundred_json_schema_replies_all_validate(served: str) -> None:
    async def run_all() -> list[tuple[str, str]]:
        client = openai.AsyncOpenAI(
            base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT_S
        )
        (model,) = [card.id async for card in client.models.list()]
        limit = asyncio.Semaphore(CONCURRENCY)

        async def one(idx: int) -> tuple[str, str]:
            async with limit:
                return await _json_reply(client, model, idx)

        try:
            return await asyncio.gather(*(one(idx) for idx in range(NUM_JSON_REQUESTS)))
        finally:
            await client.close()

    replies = asyncio.run(run_all())
    for idx, (text, finish_reason) in enumerate(replies):
        assert finish_reason == "stop", (idx, finish_reason, text)
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.timeout(300)
def test_regex_and_choice_streamed_and_not(served: str) -> None:
    client = _client(served)
    (model,) = [card.id for card in client.models.list().data]
    asks = [
        ({"structured_outputs": {"regex": REGEX}}, lambda text: re.fullmatch(REGEX, text)),
        ({"guided_regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
        ({"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
        ({"guided_choice": CHOICES}, lambda text: text in CHOICES),
    ]
    for idx, (extra_body, matches) in enumerate(asks):
        common = dict(model=model, max_tokens=64, temperature=0.8, seed=idx, extra_body=extra_body)
        whole = client.chat.completions.create(messages=_messages(idx), **common)
        assert matches(whole.choices[0].message.content), whole.choices[0].message.content
        assert whole.choices[0].finish_reason == "stop"
        stream = client.completions.create(prompt=f"City {idx}:", stream=True, **common)
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert matches(text), text


def _greedy_ids(client: openai.OpenAI, model: str) -> list[str]:
    """A plain greedy chat's tokens, as logprobs name them."""
    reply = client.chat.completions.create(
        model=model,
        messages=_messages(7),
        max_tokens=48,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    return [entry.token for entry in reply.choices[0].logprobs.content]


@pytest.mark.timeout(300)
def test_bad_constraints_are_400s_naming_the_field_beside_an_exact_client(served: str) -> None:
    client = _client(served)
    (model,) = [card.id for card in client.models.list().data]
    expected = _greedy_ids(client, model)
    deep = '{"type": "object", "properties": {"a": ' * 10_000 + "{}" + "}}" * 10_000
    bad = [
        (
            {"response_format": json.loads('{"type": "json_schema", "json_schema": {}}')},
            "response_format.json_schema",
        ),
        ({"extra_body": {"guided_regex": "a" * (5 * 1024 * 1024)}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"regex": "(open"}}}, "structured_outputs"),
        ({"extra_body": {"guided_grammar": "root ::= missing"}}, "guided_grammar"),
        ({"extra_body": {"guided_json": {"type": "object", "required": 5}}}, "guided_json"),
    ]

    async def beside() -> list[str]:
        # the greedy client runs while the bad requests arrive
        return await asyncio.to_thread(_greedy_ids, client, model)

    async def run() -> list[str]:
        task = asyncio.create_task(beside())
        for body, param in bad:
            with pytest.raises(openai.BadRequestError) as raised:
                await asyncio.to_thread(
                    client.chat.completions.create,
                    model=model,
                    messages=_messages(1),
                    max_tokens=8,
                    **body,
                )
            assert raised.value.body["param"] == param, raised.value.body
        # the schema 10,000 levels deep, sent raw: a body the client library would not build
        param = await asyncio.to_thread(_deep_schema_param, served, model, deep)
        assert param == "response_format.json_schema.schema"
        return await task

    assert asyncio.run(run()) == expected, "the greedy client's tokens changed"


@pytest.mark.timeout(300)
def test_a_grammar_the_engine_cannot_compile_fails_only_its_request(served: str) -> None:
    """A client of the engine itself (no front end to check it first) sends grammars that do not
    compile: each fails at admission with the reason, and a greedy request beside them is exact."""
    client = _client(served)
    (model,) = [card.id for card in client.models.list().data]
    expected = _greedy_ids(client, model)
    bad = [
        StructuredOutputs(grammar="root ::= missing"),
        StructuredOutputs(regex="(open"),
        # 1,000 levels: 25 KB, which xgrammar alone would take about a minute to convert
        StructuredOutputs(json='{"type": "array", "items": ' * 1_000 + "{}" + "}" * 1_000),
    ]
    address = f"ipc://{ENGINE_FOLDERS[served]}/client.sock"
    with EngineClient(address, HTTP_TIMEOUT_S) as engine:
        for idx, spec in enumerate(bad):
            params = SamplingParams(max_tokens=8, structured_outputs=spec)
            engine.add_request(make_request(f"bad-{idx}", [1, 2, 3], params))
        beside = asyncio.run(asyncio.to_thread(_greedy_ids, client, model))
        results = engine.run_until_finished([f"bad-{idx}" for idx in range(len(bad))])
    for result in results.values():
        assert result.finish_reason == "error" and not result.token_ids
        assert "does not compile" in (result.error or ""), result.error
    assert "nested more than 64 levels" in (results["bad-2"].error or "")
    assert beside == expected, "the greedy client's tokens changed"


def _deep_schema_param(url: str, model: str, deep: str) -> str:
    """POST a chat whose schema nests 10,000 levels; the 400's param."""
    import urllib.error
    import urllib.request

    raw = (
        '{"model": "' + model + '", "messages": [{"role": "user", "content": "x"}], '
        '"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": '
        + deep
        + "}}}"
    )
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=raw.encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S)
    assert raised.value.code == 400
    return json.loads(raised.value.read())["error"]["param"]


@pytest.mark.timeout(420)
def test_two_ranks_apply_the_same_bitmask(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Path
) -> None:
    """At TP=2 both ranks mask and sample alike (a disagreement would fail the engine), and the
    replies follow their grammars."""
    folder = tmp_path_factory.mktemp("structured-tp2")
    with _serve(folder, checkpoint, ["-tp", "2"]) as url:
        client = _client(url)
        (model,) = [card.id for card in client.models.list().data]
        for idx in range(4):
            reply = client.chat.completions.create(
                model=model,
                messages=_messages(idx),
                max_tokens=MAX_TOKENS,
                temperature=0.7,
                seed=idx,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": SCHEMA},
                },
            )
            assert reply.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
            choice = client.completions.create(
                model=model,
                prompt="City:",
                max_tokens=16,
                extra_body={"guided_choice": CHOICES},
            )
            assert choice.choices[0].text in CHOICES
