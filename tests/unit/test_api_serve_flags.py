"""`kvserve serve`'s front-end flags as vLLM spells them: --served-model-name takes several
names, --tokenizer names a folder holding tokenizer.json, and a checkpoint without a tokenizer
needs one; a bad value exits 2 naming the flag."""

import argparse
from pathlib import Path

import pytest

from api_server.app import ApiSettings, ApiState
from api_server.tokenizer.checkpoint_tokenizer import CheckpointTokenizer
from api_server.tokenizer.prompt_tokenizer import DEFAULT_TOKENIZER_DIR, ByteTokenizer
from deploy.commands import LAUNCH_WORKER_FLAGS, _api_settings, add_serve_flags, engine_config_from
from deploy.flags import build_config
from protocol.config import WorkerConfig

ENGINE = ["--engine-address", "ipc:///tmp/nowhere.sock"]


def _settings(*argv: str) -> ApiSettings:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    args = parser.parse_args([*ENGINE, *argv])
    engine = engine_config_from(argparse.Namespace(**{**vars(args), "host": None, "port": None}))
    worker = build_config(args, LAUNCH_WORKER_FLAGS, WorkerConfig)
    return _api_settings(args, engine, worker)


def test_served_model_names_are_all_accepted_and_the_first_reported() -> None:
    settings = _settings("--model", "tiny-llama", "--served-model-name", "chat", "alias")
    state = ApiState(settings)
    assert state.served_names == ("chat", "alias")
    assert settings.model == "tiny-llama"
    assert isinstance(state.tokenizer, ByteTokenizer)
    assert ApiState(_settings("--model", "tiny-llama")).served_names == ("tiny-llama",)


def test_tokenizer_names_the_folder_to_tokenize_with() -> None:
    settings = _settings("--model", "tiny-llama", "--tokenizer", str(DEFAULT_TOKENIZER_DIR))
    assert isinstance(ApiState(settings).tokenizer, CheckpointTokenizer)


def test_a_tokenizer_folder_without_tokenizer_json_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from deploy.cli import kvserve_main

    with pytest.raises(SystemExit) as exited:
        kvserve_main(["serve", *ENGINE, "--model", "tiny-llama", "--tokenizer", str(tmp_path)])
    assert exited.value.code == 2
    assert f"--tokenizer {tmp_path}: expected a folder holding tokenizer.json" in (
        capsys.readouterr().err
    )


def test_router_flags_set_the_policy_and_the_kv_weights() -> None:
    from api_server.routing.kv_scorer import KVScoreWeights
    from api_server.routing.router import RoutingPolicy

    default = _settings("--model", "tiny-llama")
    assert default.router_policy is RoutingPolicy.KV
    settings = _settings(
        *("--model", "tiny-llama", "--router-policy", "round-robin"),
        *("--router-prefill-weight", "2", "--router-decode-weight", "0.5"),
        *("--router-silent-limit-s", "7"),
    )
    assert settings.router_policy is RoutingPolicy.ROUND_ROBIN
    assert settings.router_weights == KVScoreWeights(2.0, 0.5)
    assert settings.kv_events_silent_limit_s == 7.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--router-policy", "random"], "argument --router-policy: invalid choice: 'random'"),
        (["--router-decode-weight", "-1"], "--router-decode-weight -1.0: expected >= 0"),
        (["--router-prefill-weight", "nan"], "--router-prefill-weight nan: expected >= 0"),
        (["--router-silent-limit-s", "0"], "--router-silent-limit-s 0.0: expected > 0"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--tool-call-parser", "pythonic"], "argument --tool-call-parser: invalid choice"),
        (["--reasoning-parser", "granite"], "argument --reasoning-parser: invalid choice"),
    ],
)
def test_bad_router_and_parser_flags_exit_2_naming_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    from deploy.cli import kvserve_main

    with pytest.raises(SystemExit) as exited:
        kvserve_main(["serve", *ENGINE, "--model", "tiny-llama", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


SHOUTING_TEMPLATE = "{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}"


def test_chat_template_replaces_the_tokenizers_own(tmp_path: Path) -> None:
    """From a file or given inline, as vLLM takes it; the byte format then gives way to it."""
    path = tmp_path / "shout.jinja"
    path.write_text(SHOUTING_TEMPLATE)
    for value in (str(path), SHOUTING_TEMPLATE):
        settings = _settings("--model", "tiny-llama", "--chat-template", value)
        assert settings.chat_template == SHOUTING_TEMPLATE
        assert not settings.is_request_chat_template_trusted
        tokenizer = ApiState(settings).tokenizer
        ids = tokenizer.render_chat([{"role": "user", "content": "hi"}])
        assert tokenizer.decode(ids) == "USER: hi\n"
    trusted = _settings("--model", "tiny-llama", "--trust-request-chat-template")
    assert trusted.is_request_chat_template_trusted
    assert trusted.chat_template is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("missing.jinja", "--chat-template missing.jinja: expected a template file or a Jinja"),
        ("{% for %}", "--chat-template {% for %}: chat template does not compile"),
    ],
)
def test_a_bad_chat_template_exits_2_naming_the_flag(
    value: str, message: str, capsys: pytest.CaptureFixture
) -> None:
    from deploy.cli import kvserve_main

    with pytest.raises(SystemExit) as exited:
        kvserve_main(["serve", *ENGINE, "--model", "tiny-llama", "--chat-template", value])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_tool_and_reasoning_parser_flags_reach_the_chat_parsing() -> None:
    from api_server.openai.chat_output import ChatParsing

    settings = _settings(
        *("--model", "tiny-llama", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"),
        *("--reasoning-parser", "deepseek_r1"),
    )
    assert ApiState(settings).chat_parsing == ChatParsing("hermes", True, "deepseek_r1")
    assert ApiState(_settings("--model", "tiny-llama")).chat_parsing == ChatParsing()
    parser_only = _settings("--model", "tiny-llama", "--tool-call-parser", "mistral")
    assert ApiState(parser_only).chat_parsing == ChatParsing("mistral", False, None)


def test_generation_config_defaults_reach_the_front_end(tmp_path: Path) -> None:
    """--generation-config DIR reads that folder's file; vllm (and a built-in model's auto)
    applies none."""
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95}')
    settings = _settings("--model", "tiny-llama", "--generation-config", str(tmp_path))
    assert ApiState(settings).generation_defaults.applied() == {"temperature": 0.6, "top_p": 0.95}
    for value in ("vllm", "auto"):
        settings = _settings("--model", "tiny-llama", "--generation-config", value)
        assert ApiState(settings).generation_defaults.applied() == {}


def test_a_bad_generation_config_exits_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from deploy.cli import kvserve_main

    missing = str(tmp_path / "missing")
    with pytest.raises(SystemExit) as exited:
        kvserve_main(["serve", *ENGINE, "--model", "tiny-llama", "--generation-config", missing])
    assert exited.value.code == 2
    assert f"--generation-config {missing}: expected 'auto', 'vllm'" in capsys.readouterr().err
