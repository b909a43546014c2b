"""Builds the shipped byte-level tokenizer (tokenizer_files/) with the `tokenizers` library.

Ids 0-255 are the UTF-8 bytes, the special tokens follow. Run
`python -m api_server.tokenizer.build_tokenizer` after changing SPECIAL_TOKENS or the chat
template; it never edits anything outside its folder.
"""

import argparse
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer_files"
NUM_BYTE_TOKENS = 256
# Ids 256 upwards, in this order; the models' vocabularies (tiny-llama 512, checksum 1024) hold them
SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)
CHAT_ROLES = ("system", "user", "assistant")
END_OF_TURN = "<|end|>"
GENERATION_PROMPT = "<|assistant|>"
# One turn is `<|role|>content<|end|>`; api_server/tokenizer/prompt_tokenizer.py renders the
# same text in Python.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
MODEL_MAX_LENGTH = 8192  # the longest max_model_len among the fake models


def byte_alphabet() -> dict[int, str]:
    """The printable character standing for each byte in a byte-level vocabulary.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, soft hyphen) take
    the next unused code points from 256 on, so that every token string is visible.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {byte: chr(byte) for byte in printable}
    next_code_point = NUM_BYTE_TOKENS
    for byte in range(NUM_BYTE_TOKENS):
        if byte not in chars:
            chars[byte] = chr(next_code_point)
            next_code_point += 1
    return chars


def build_tokenizer() -> Tokenizer:
    """A BPE model with no merges over the byte alphabet: one token per byte, id == byte value."""
    vocab = {char: byte for byte, char in byte_alphabet().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    for idx, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != NUM_BYTE_TOKENS + idx:
            raise RuntimeError(f"special token {token} got id {tokenizer.token_to_id(token)}")
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json, so that transformers.AutoTokenizer loads the folder."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(folder / "tokenizer.json"))
    text = json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n"
    (folder / "tokenizer_config.json").write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the byte-level tokenizer files.")
    parser.add_argument("--out", type=Path, default=TOKENIZER_DIR, help="folder to write into")
    write_tokenizer(parser.parse_args(argv).out)


if __name__ == "__main__":
    main()
