"""The tokenizer's vocabulary as the grammar compiler needs it, read once at start-up from a
checkpoint's tokenizer.json with the `tokenizers` library (never transformers). It holds no
grammar state and compiles nothing.
"""

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


class VocabType(Enum):
    """How a token's text maps to bytes, as xgrammar names the three kinds."""

    RAW = "raw"  # the text is the bytes (UTF-8)
    BYTE_FALLBACK = "byte_fallback"  # sentencepiece: "▁" for space, "<0x0A>" for a lone byte
    BYTE_LEVEL = "byte_level"  # GPT-2: every byte is drawn as one printable character


@dataclass(frozen=True, slots=True)
class TokenizerVocabulary:
    """Every token id's text as tokenizer.json writes it, and how to read that text as bytes.

    Invariants: `encoded_vocab[i]` is token i's text; ids the file leaves out are "".
    """

    encoded_vocab: list[str]
    vocab_type: VocabType
    add_prefix_space: bool  # the decoder strips a space the encoder put in front of the text

    @property
    def num_tokens(self) -> int:
        return len(self.encoded_vocab)


def read_tokenizer_vocabulary(folder: str | Path) -> TokenizerVocabulary:
    """The vocabulary of `folder`/tokenizer.json; ValueError naming the file when unreadable."""
    path = Path(folder) / TOKENIZER_FILE
    try:
        tokenizer = Tokenizer.from_file(str(path))
        decoder = json.loads(path.read_text()).get("decoder")
    except (OSError, ValueError, Exception) as exc:  # tokenizers raises its own Exception
        raise ValueError(f"cannot read the vocabulary of {path}: {exc}") from None
    ids_by_text = tokenizer.get_vocab(with_added_tokens=True)
    num_tokens = max(ids_by_text.values(), default=-1) + 1
    encoded_vocab = [""] * num_tokens
    for text, token_id in ids_by_text.items():
        encoded_vocab[token_id] = text
    vocab_type, add_prefix_space = _decoding_of(decoder)
    return TokenizerVocabulary(encoded_vocab, vocab_type, add_prefix_space)


def _decoding_of(decoder: dict | None) -> tuple[VocabType, bool]:
    """The vocabulary type and prefix-space rule that tokenizer.json's decoder implies."""
    steps = [] if decoder is None else decoder.get("decoders", [decoder]) or []
    kinds = {step.get("type") for step in steps if isinstance(step, dict)}
    if "ByteLevel" in kinds:
        return VocabType.BYTE_LEVEL, False
    strips_prefix = any(
        isinstance(step, dict) and step.get("type") == "Strip" and step.get("start", 0) > 0
        for step in steps
    )
    metaspace_prefix = any(
        isinstance(step, dict)
        and step.get("type") == "Metaspace"
        and (step.get("add_prefix_space") or step.get("prepend_scheme") in ("always", "first"))
        for step in steps
    )
    if "ByteFallback" in kinds:
        return VocabType.BYTE_FALLBACK, strips_prefix or metaspace_prefix
    return VocabType.RAW, strips_prefix or metaspace_prefix
