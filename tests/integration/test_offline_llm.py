"""The offline API (`from kvserve import LLM`) over a tiny random checkpoint on the CPU: a batch
of 32 greedy prompts gives the same text, token ids and finish reasons as `kvserve serve` gives
over HTTP for the same prompts, and so does a chat; token-id prompts give what their text gives;
close() leaves no child process behind.
"""

import multiprocessing.resource_tracker
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.make_checkpoint import CheckpointSpec, make_checkpoint
from kvserve import LLM, SamplingParams
from tests.integration.conftest import (
    Processes,
    free_tcp_ports,
    live_children,
    stop_process,
    wait_http_healthy,
)

pytestmark = pytest.mark.integration

STARTUP_TIMEOUT_S = 180.0
HTTP_TIMEOUT_S = 120.0
NUM_PROMPTS = 32
MAX_TOKENS = 16
WORDS = ["the", "capital", "of", "France", "is", "a", "river", "city", "Paris", "on", "sunny"]
MESSAGES = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module", autouse=True)
def resource_tracker() -> None:
    """multiprocessing's resource tracker, which the first spawned child starts and which lives
    as long as this interpreter: started before any test, it is no test's leftover."""
    multiprocessing.resource_tracker.ensure_running()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), CheckpointSpec(arch="qwen3"))


def text_prompts() -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choices(WORDS, k=3 + idx % 7)) for idx in range(NUM_PROMPTS)]


def served_outputs(
    processes: Processes, tmp_path: Path, checkpoint: Path, prompts: list[str]
) -> tuple[list[tuple[str, str]], tuple[str, str]]:
    """`kvserve serve`'s greedy (text, finish_reason) per prompt, and for the chat MESSAGES."""
    port, master_port = free_tcp_ports(2)
    args = ["serve", "--model", str(checkpoint), "--device", "cpu", "--port", str(port)]
    args += ["--master-port", str(master_port), "--log-level", "INFO"]
    args += ["--client-address", f"ipc://{tmp_path}/client.sock"]
    args += ["--worker-address", f"ipc://{tmp_path}/worker.sock"]
    processes.start("serve", "kvserve_main", args)
    url = f"http://127.0.0.1:{port}"
    wait_http_healthy(processes, "serve", url, STARTUP_TIMEOUT_S)
    body = {"model": str(checkpoint), "max_tokens": MAX_TOKENS, "temperature": 0}
    with httpx.Client(base_url=f"{url}/v1", timeout=HTTP_TIMEOUT_S) as http:
        completion = http.post("/completions", json={**body, "prompt": prompts})
        chat = http.post("/chat/completions", json={**body, "messages": MESSAGES})
    stop_process(processes, "serve", timeout_s=60)
    assert completion.status_code == 200, completion.text
    assert chat.status_code == 200, chat.text
    choices = sorted(completion.json()["choices"], key=lambda choice: choice["index"])
    (chat_choice,) = chat.json()["choices"]
    return (
        [(choice["text"], choice["finish_reason"]) for choice in choices],
        (chat_choice["message"]["content"], chat_choice["finish_reason"]),
    )


@pytest.fixture
def no_new_children() -> Iterator[None]:
    """After the test, no child this test started lives on (none waited for, none killed)."""
    earlier = set(live_children())
    yield
    leftovers = [pid for pid in live_children() if pid not in earlier]
    assert not leftovers, f"child processes left alive: {leftovers}"


@pytest.mark.timeout(420)
def test_generate_and_chat_equal_the_http_servers_greedy_text(
    processes: Processes, tmp_path: Path, checkpoint: Path
) -> None:
    prompts = text_prompts()
    expected, expected_chat = served_outputs(processes, tmp_path, checkpoint, prompts)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with LLM(str(checkpoint), device="cpu", start_timeout_s=STARTUP_TIMEOUT_S) as llm:
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        (chat,) = llm.chat(MESSAGES, greedy, use_tqdm=False)
        by_ids = llm.generate(
            [{"prompt_token_ids": out.prompt_token_ids} for out in outputs[:4]],
            greedy,
            use_tqdm=False,
        )
    assert [out.prompt for out in outputs] == prompts
    assert len({out.request_id for out in outputs}) == NUM_PROMPTS
    got = [(out.outputs[0].text, out.outputs[0].finish_reason) for out in outputs]
    assert got == expected
    assert len({text for text, _ in got}) > NUM_PROMPTS // 2  # real, varied text was compared
    for out in outputs:
        assert out.finished and len(out.outputs) == 1
        assert 1 <= len(out.outputs[0].token_ids) <= MAX_TOKENS
    assert (chat.outputs[0].text, chat.outputs[0].finish_reason) == expected_chat
    assert chat.prompt is not None and chat.prompt.endswith("assistant\n")
    for out, again in zip(outputs[:4], by_ids, strict=True):
        assert again.prompt is None and again.prompt_token_ids == out.prompt_token_ids
        assert again.outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.timeout(300)
def test_close_leaves_no_child_and_a_closed_llm_refuses(
    checkpoint: Path, no_new_children: None
) -> None:
    earlier = set(live_children())
    llm = LLM(str(checkpoint), device="cpu", start_timeout_s=STARTUP_TIMEOUT_S)
    started = [pid for pid in live_children() if pid not in earlier]
    assert len(started) == 2, started  # the engine and its one rank
    (out,) = llm.generate("the capital of", SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 1
    llm.close()
    assert [pid for pid in live_children() if pid in started] == []
    llm.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("again", use_tqdm=False)


@pytest.mark.timeout(300)
def test_a_stop_string_ends_the_text_and_the_engine_serves_on(
    checkpoint: Path, no_new_children: None
) -> None:
    """A stop string is the front end's, as over HTTP: the text ends before it (or with it,
    when asked), the request is aborted in the engine, and the next batch is served."""
    prompt = "the capital of France is"
    with LLM(str(checkpoint), device="cpu", start_timeout_s=STARTUP_TIMEOUT_S) as llm:
        (whole,) = llm.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
        text = whole.outputs[0].text
        # two whole characters early in the text: a cut-off one (U+FFFD) shows only at the end
        cut = next(idx for idx in range(1, len(text)) if "\ufffd" not in text[idx : idx + 2])
        stop = text[cut : cut + 2]
        cut = text.index(stop)
        stopped, shown = llm.generate(
            [prompt, prompt],
            [
                SamplingParams(max_tokens=MAX_TOKENS, stop=stop),
                SamplingParams(max_tokens=MAX_TOKENS, stop=[stop], include_stop_str_in_output=True),
            ],
            use_tqdm=False,
        )
        after = llm.generate([prompt] * 3, SamplingParams(max_tokens=4), use_tqdm=False)
    assert (stopped.outputs[0].text, stopped.outputs[0].finish_reason) == (text[:cut], "stop")
    assert shown.outputs[0].text == text[: cut + len(stop)]
    assert len(stopped.outputs[0].token_ids) < len(whole.outputs[0].token_ids)
    assert [len(out.outputs[0].token_ids) for out in after] == [4, 4, 4]


@pytest.mark.timeout(300)
def test_a_deployment_that_cannot_start_raises_at_once_and_leaves_no_child(
    checkpoint: Path, no_new_children: None
) -> None:
    """A KV budget too small for one request fails the engine's startup: LLM() raises as soon
    as the supervisor sees it, not after start_timeout_s, and stops the rank."""
    start_s = time.monotonic()
    with pytest.raises(RuntimeError, match="exited while starting"):
        LLM(str(checkpoint), device="cpu", kv_cache_memory_bytes=1 << 16, start_timeout_s=600)
    assert time.monotonic() - start_s < STARTUP_TIMEOUT_S


@pytest.mark.timeout(300)
def test_n_choices_bad_words_and_generation_config_defaults(
    checkpoint: Path, tmp_path: Path, no_new_children: None
) -> None:
    """n seeded choices per prompt repeat run after run (choice 0 is the n=1 answer); bad words
    never appear; a call without sampling params takes the generation config's defaults; prompt
    logprobs come back as vLLM's."""
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 5}')
    prompt = "the capital of France is"
    sampled = SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=8, ignore_eos=True)
    with LLM(
        str(checkpoint),
        device="cpu",
        start_timeout_s=STARTUP_TIMEOUT_S,
        generation_config=str(tmp_path),
    ) as llm:
        (first,) = llm.generate(prompt, sampled, use_tqdm=False)
        (again,) = llm.generate(prompt, sampled, use_tqdm=False)
        (one,) = llm.generate(
            prompt, SamplingParams(**{**_fields(sampled), "n": 1}), use_tqdm=False
        )
        defaults = llm.get_default_sampling_params()
        (default,) = llm.generate(prompt, use_tqdm=False)
        greedy = SamplingParams(max_tokens=5, temperature=0.0)
        (plain,) = llm.generate(prompt, greedy, use_tqdm=False)
        banned_id, word = _a_whole_word(llm, plain.outputs[0].token_ids)
        banned = SamplingParams(**{**_fields(greedy), "bad_words": [word]})
        (without,) = llm.generate(prompt, banned, use_tqdm=False)
        scored = SamplingParams(max_tokens=1, prompt_logprobs=2)
        (with_prompt,) = llm.generate(prompt, scored, use_tqdm=False)
    assert [out.index for out in first.outputs] == [0, 1, 2]
    token_ids = [out.token_ids for out in first.outputs]
    assert len({tuple(ids) for ids in token_ids}) > 1
    assert [out.token_ids for out in again.outputs] == token_ids
    assert one.outputs[0].token_ids == token_ids[0]
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    assert default.outputs[0].token_ids == plain.outputs[0].token_ids
    assert banned_id not in without.outputs[0].token_ids
    entries = with_prompt.prompt_logprobs
    assert entries is not None and entries[0] is None
    assert len(entries) == len(with_prompt.prompt_token_ids)
    for token_id, entry in zip(with_prompt.prompt_token_ids[1:], entries[1:], strict=True):
        assert entry is not None and entry[token_id].logprob <= 0.0
        assert sorted(logprob.rank for logprob in entry.values())[:2] == [1, 2]
    assert first.prompt_logprobs is None
    assert without.outputs[0].token_ids != plain.outputs[0].token_ids


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__struct_fields__}


def _a_whole_word(llm: LLM, token_ids: list[int]) -> tuple[int, str]:
    """A generated id whose text, as a bad word, tokenizes back to that one id."""
    for token_id in token_ids:
        word = llm.tokenizer.decode([token_id]).strip()
        spellings = (word, " " + word)
        if word and any(llm.tokenizer.encode(t, False) == [token_id] for t in spellings):
            return token_id, word
    raise AssertionError(f"no generated id of {token_ids} is a whole word")
