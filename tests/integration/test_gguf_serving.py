"""`kvserve serve --model FILE.gguf`, as a user runs it on a llama.cpp-style file: the tokenizer and
chat template come from the file's metadata, and the greedy chat and completion text, driven by
the official openai client, equal transformers' loading the same file.
"""

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.integration.conftest import checked_processes, stop_process
from tests.integration.test_hf_serving import HTTP_TIMEOUT_S, greedy_reply, serve
from tests.unit.gguf_files import (
    hf_gguf_model,
    hf_gguf_tokenizer,
    round_tripped,
    write_arch_gguf,
    write_gguf,
)

pytestmark = pytest.mark.integration

MAX_TOKENS = 16
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "the quick brown fox?"},
]
PROMPT = "hello there, how are you"


def _greedy_text(path: Path, prompt_ids: list[int]) -> str:
    """transformers' greedy continuation on the same file, decoded."""
    model, tokenizer = hf_gguf_model(path), hf_gguf_tokenizer(path)
    return greedy_reply(model, tokenizer, prompt_ids, MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    write_gguf(path, seed=4)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, gguf_file: Path) -> Iterator[openai.OpenAI]:
    folder = tmp_path_factory.mktemp("serve-gguf")
    with checked_processes(folder) as processes:
        url = serve(processes, folder, gguf_file, 1)
        yield openai.OpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT_S
        )
        stop_process(processes, "serve", timeout_s=60)


@pytest.mark.timeout(420)
def test_chat_and_completion_equal_transformers_on_the_same_file(
    served: openai.OpenAI, gguf_file: Path
) -> None:
    tokenizer = hf_gguf_tokenizer(gguf_file)
    chat_ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    (model,) = [card.id for card in served.models.list().data]
    chat = served.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert chat.choices[0].message.content == _greedy_text(gguf_file, list(chat_ids))
    completion = served.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    assert completion.choices[0].text == _greedy_text(gguf_file, prompt_ids)


@pytest.mark.timeout(420)
def test_structured_outputs_compile_against_the_files_vocabulary(served: openai.OpenAI) -> None:
    """The engine has no tokenizer.json beside a GGUF file: the front end hands it the one the
    file's metadata describes, so a constrained request is served."""
    (model,) = [card.id for card in served.models.list().data]
    choices = ["the quick fox", "hello there"]
    reply = served.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert reply.choices[0].text in choices
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.timeout(420)
@pytest.mark.parametrize(("arch", "tp_size"), [("qwen3", 2), ("gemma2", 1)])
def test_other_architectures_serve_transformers_text(
    tmp_path_factory: pytest.TempPathFactory, arch: str, tp_size: int
) -> None:
    """A Qwen3 file at TP 2 and a Gemma 2 one (its sliding layers in a window group) written by
    the gguf library: chat text equal to transformers loading the same file."""
    path = tmp_path_factory.mktemp(f"gguf-{arch}") / f"{arch}.gguf"
    write_arch_gguf(path, arch, seed=4)
    chat_ids = hf_gguf_tokenizer(path).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    expected = _greedy_text(path, list(chat_ids))
    folder = tmp_path_factory.mktemp(f"serve-gguf-{arch}")
    with checked_processes(folder) as processes:
        url = serve(processes, folder, path, tp_size)
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT_S
        )
        (model,) = [card.id for card in client.models.list().data]
        chat = client.chat.completions.create(
            model=model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert chat.usage.prompt_tokens == len(chat_ids)
        assert chat.choices[0].message.content == expected
        stop_process(processes, "serve", timeout_s=60)


@pytest.mark.timeout(420)
@pytest.mark.parametrize(("max_model_len", "prompt_repeats"), [(64, 1), (160, 12)])
def test_a_phi3_longrope_file_serves_the_factor_set_its_max_model_len_picks(
    tmp_path_factory: pytest.TempPathFactory, max_model_len: int, prompt_repeats: int
) -> None:
    """Phi-3 with longrope (original context 64): `--max-model-len 64` serves a short prompt
    with the short factors, 160 a prompt past 64 tokens with the long ones; the text equals
    transformers' generate() on the model the file came from (its weights rounded as the file
    holds them), which picks the same set for a prompt of that length (rope.Rotary)."""
    path = tmp_path_factory.mktemp("gguf-phi3-longrope") / "phi3.gguf"
    longrope = {
        "type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(32)],
        "long_factor": [1.0 + 0.5 * i for i in range(32)],
    }
    model = write_arch_gguf(
        path, "phi3", seed=4, rope_scaling=longrope, original_max_position_embeddings=64
    )
    prompt = " ".join([PROMPT] * prompt_repeats)
    tokenizer = hf_gguf_tokenizer(path)
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert (len(prompt_ids) > 64) == (max_model_len > 64)
    expected = greedy_reply(round_tripped(model), tokenizer, prompt_ids, MAX_TOKENS, True)
    folder = tmp_path_factory.mktemp("serve-gguf-phi3-longrope")
    with checked_processes(folder) as processes:
        url = serve(processes, folder, path, 1, "--max-model-len", str(max_model_len))
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT_S
        )
        (served_model,) = [card.id for card in client.models.list().data]
        completion = client.completions.create(
            model=served_model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert completion.choices[0].text == expected
        stop_process(processes, "serve", timeout_s=60)
