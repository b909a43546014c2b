"""The shipped byte-level tokenizer: built by its script, round-trips text, always decodes."""

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from api_server.tokenizer.build_tokenizer import SPECIAL_TOKENS, TOKENIZER_DIR, write_tokenizer
from api_server.tokenizer.prompt_tokenizer import ByteTokenizer, placeholder


@pytest.fixture(scope="module")
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


def test_shipped_files_are_what_the_script_builds(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        built = json.loads((tmp_path / name).read_text())
        shipped = json.loads((TOKENIZER_DIR / name).read_text())
        assert built == shipped, (
            f"{name} differs: run python -m api_server.tokenizer.build_tokenizer"
        )


def test_ids_are_utf8_bytes_and_specials_follow(tokenizer: ByteTokenizer) -> None:
    assert tokenizer.encode("hé") == list("hé".encode())
    assert tokenizer.encode("<|user|>hi") == [256 + SPECIAL_TOKENS.index("<|user|>"), 104, 105]
    assert tokenizer.vocab_size == 256 + len(SPECIAL_TOKENS)
    assert tokenizer.vocab_size <= 512  # tiny-llama's vocabulary, the smallest of the models


@given(st.text(max_size=200))
def test_text_round_trips(text: str) -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.decode(tokenizer.encode(text)) == text


@given(st.lists(st.integers(min_value=-5, max_value=5000), max_size=60))
def test_decode_never_raises_and_matches_hf_on_bytes(token_ids: list[int]) -> None:
    tokenizer = ByteTokenizer()
    text = tokenizer.decode(token_ids)
    if all(0 <= token_id < 256 for token_id in token_ids):
        hf = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
        assert text == hf.decode(token_ids)


def test_ids_outside_the_vocabulary_decode_to_a_placeholder(tokenizer: ByteTokenizer) -> None:
    assert tokenizer.decode([104, 600, 105]) == f"h{placeholder(600)}i"
    assert placeholder(600) == "<|tok_600|>"


def test_a_character_split_across_pushes_comes_out_whole(tokenizer: ByteTokenizer) -> None:
    detokenizer = tokenizer.detokenizer()
    first, second = list("日".encode())[:2], list("日".encode())[2:]
    assert detokenizer.push(first) == ""
    assert detokenizer.push(second) == "日"
    assert detokenizer.push([0xE6]) == ""
    assert detokenizer.finish() == "\ufffd"


def test_chat_template_matches_the_jinja_one_clients_use(tokenizer: ByteTokenizer) -> None:
    jinja2 = pytest.importorskip("jinja2")
    messages = [("system", "be brief"), ("user", "hi")]
    text = tokenizer.apply_chat_template(messages)
    assert text == "<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    template = jinja2.Template(tokenizer.config["chat_template"])
    rendered = template.render(
        messages=[{"role": role, "content": content} for role, content in messages],
        add_generation_prompt=True,
    )
    assert rendered == text


def test_chat_template_refuses_an_unknown_role(tokenizer: ByteTokenizer) -> None:
    with pytest.raises(ValueError, match="chat role 'tool'"):
        tokenizer.apply_chat_template([("tool", "x")])


def test_transformers_loads_the_folder() -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    assert hf.encode("hi", add_special_tokens=False) == [104, 105]
    assert hf.eos_token == "<|eos|>"
