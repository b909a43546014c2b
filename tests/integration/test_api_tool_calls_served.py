"""Tool calling and reasoning through `kvserve serve --tool-call-parser hermes
--enable-auto-tool-choice --reasoning-parser qwen3`, driven by the official openai client, on a
random-weight checkpoint whose chat template renders tools, assistant calls and tool results:
the prompt of a chat with tools and a call history is transformers' own, the reply has
OpenAI's shape (streamed deltas add up to it), and tool_choice naming no tool is a 400.

The replies of random weights never call a tool by themselves: the tests that call tools force
them with structured outputs (tool_choice required or named, and a hermes reply forced by a
regex), so every call's arguments parse and match the tool's schema.
"""

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from bench.make_checkpoint import CheckpointSpec, make_checkpoint
from tests.integration.conftest import (
    checked_processes,
    free_tcp_ports,
    stop_process,
    wait_http_healthy,
)
from tests.unit.tool_chat_template import TOOL_CHAT_TEMPLATE, TOOL_HISTORY, TOOLS

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

STARTUP_TIMEOUT_S = 180.0  # torch imports, the checkpoint and the KV budget, on a loaded machine
HTTP_TIMEOUT_S = 60.0
MAX_TOKENS = 24
FORCED_MAX_TOKENS = 200  # room for a constrained call: bounded strings and enums


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen3 checkpoint whose tokenizer's chat template is TOOL_CHAT_TEMPLATE."""
    folder = make_checkpoint(tmp_path_factory.mktemp("qwen3-tools"), CheckpointSpec(arch="qwen3"))
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        jinja.write_text(TOOL_CHAT_TEMPLATE)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if "chat_template" in config or not jinja.is_file():
        config["chat_template"] = TOOL_CHAT_TEMPLATE
        config_path.write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Path
) -> Iterator[tuple[openai.OpenAI, str]]:
    folder = tmp_path_factory.mktemp("serve")
    with checked_processes(folder) as processes:
        port, master_port = free_tcp_ports(2)
        args = ["serve", "--model", str(checkpoint), "--device", "cpu", "--port", str(port)]
        args += ["--master-port", str(master_port), "--log-level", "INFO"]
        args += ["--client-address", f"ipc://{folder}/client.sock"]
        args += ["--worker-address", f"ipc://{folder}/worker.sock"]
        args += ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
        args += ["--reasoning-parser", "qwen3"]
        processes.start("serve", "kvserve_main", args)
        url = f"http://127.0.0.1:{port}"
        wait_http_healthy(processes, "serve", url, STARTUP_TIMEOUT_S)
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT_S
        )
        yield client, url
        stop_process(processes, "serve", timeout_s=60)


def _hf_messages() -> list[dict]:
    """TOOL_HISTORY as transformers' templates take it: a call's arguments as a dict."""
    messages = json.loads(json.dumps(TOOL_HISTORY))
    for message in messages:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return messages


def _model(client: openai.OpenAI) -> str:
    (model,) = [card.id for card in client.models.list().data]
    return model


@pytest.mark.timeout(420)
def test_a_chat_with_tools_and_a_call_history_is_rendered_and_answered(
    served: tuple[openai.OpenAI, str], checkpoint: Path
) -> None:
    client, url = served
    hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
    rendered = hf.apply_chat_template(
        _hf_messages(), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in rendered  # the template's own
    expected_ids = hf(rendered, add_special_tokens=False)["input_ids"]
    tokenized = httpx.post(
        f"{url}/tokenize", json={"messages": TOOL_HISTORY, "tools": TOOLS}, timeout=HTTP_TIMEOUT_S
    ).json()
    assert tokenized["tokens"] == expected_ids
    body = dict(
        model=_model(client),
        messages=TOOL_HISTORY,
        tools=TOOLS,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    whole = client.chat.completions.create(**body)  # type: ignore[call-overload]
    assert whole.usage.prompt_tokens == len(expected_ids)
    [choice] = whole.choices
    message = choice.message
    assert message.role == "assistant"
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert (message.model_extra or {}).get("reasoning_content", "absent") is None  # no <think>
    assert (message.tool_calls is not None) == (choice.finish_reason == "tool_calls")
    chunks = list(client.chat.completions.create(**body, stream=True))  # type: ignore[call-overload]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == (message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


@pytest.mark.timeout(300)
def test_a_tool_choice_naming_no_tool_is_a_400(served: tuple[openai.OpenAI, str]) -> None:
    client, _ = served
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=_model(client),
            messages=TOOL_HISTORY,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_news"}},
        )
    error = refused.value.body
    assert isinstance(error, dict) and error.get("param") == "tool_choice"
    assert "get_news" in error["message"]


def _check_calls(calls: list[tuple[str, str]], parallel: bool) -> None:
    """Each call names a tool and its arguments fit that tool's parameters."""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    assert calls and (parallel or len(calls) == 1)
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])  # type: ignore[arg-type]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("is_stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_calls_fit_their_tools(
    served: tuple[openai.OpenAI, str], is_stream: bool
) -> None:
    client, _ = served
    body = dict(
        model=_model(client),
        messages=TOOL_HISTORY,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=FORCED_MAX_TOKENS,
        temperature=0,
    )
    if not is_stream:
        [choice] = client.chat.completions.create(**body).choices  # type: ignore[call-overload]
        assert choice.finish_reason == "tool_calls"
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    else:
        stream = client.chat.completions.create(**body, stream=True)  # type: ignore[call-overload]
        pieces: dict[int, list[str]] = {}
        finish_reasons = []
        for chunk in stream:
            for choice in chunk.choices:
                finish_reasons.append(choice.finish_reason)
                for call in choice.delta.tool_calls or []:
                    entry = pieces.setdefault(call.index, [call.function.name or "", ""])
                    entry[1] += call.function.arguments or ""
        assert finish_reasons[-1] == "tool_calls"
        calls = [(name, arguments) for name, arguments in pieces.values()]
    _check_calls(calls, parallel=False)


@pytest.mark.timeout(420)
def test_a_named_tool_choice_calls_that_function(served: tuple[openai.OpenAI, str]) -> None:
    client, _ = served
    [choice] = client.chat.completions.create(
        model=_model(client),
        messages=TOOL_HISTORY,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=FORCED_MAX_TOKENS,
        temperature=0,
    ).choices
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_time" and call.id.startswith("call_")
    _check_calls([(call.function.name, call.function.arguments)], parallel=False)


@pytest.mark.timeout(420)
def test_a_hermes_reply_is_parsed_into_tool_calls(served: tuple[openai.OpenAI, str]) -> None:
    """A regex makes the random model write a hermes call; the parser turns it into one."""
    client, _ = served
    regex = (
        r'<tool_call>\n\{"name": "get_weather", "arguments": '
        r'\{"city": "[a-z]{1,6}", "unit": "[cf]"\}\}\n</tool_call>'
    )
    [choice] = client.chat.completions.create(
        model=_model(client),
        messages=TOOL_HISTORY,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=FORCED_MAX_TOKENS,
        temperature=0,
        extra_body={"structured_outputs": {"regex": regex}},
    ).choices
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    _check_calls([(call.function.name, call.function.arguments)], parallel=False)
    assert choice.message.content is None
