"""A GGUF file's tokenizer, rebuilt with the `tokenizers` library from the file's metadata.

A GGUF file carries no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`),
each token's type (`token_type`: 3 control, 4 user-defined), the BPE merges, the special token ids,
whether a BOS is added (`add_bos_token`), the pre-tokenizer's name (`tokenizer.ggml.pre`) and the
chat template. From these this module builds the tokenizer that transformers' GGUF loader builds
for the same file, so that ids, text and chat prompts agree with it:

- byte-level BPE (`tokenizer.ggml.model` "gpt2": Llama 3, Qwen 2/2.5/3, SmolLM, ...): the
  vocabulary in GPT-2's byte alphabet, the file's merges, the text split by the regular expression
  its pre-tokenizer names (Llama 3's or Qwen 2's; GPT-2's for any other name, as transformers
  does), control tokens as special tokens and user-defined ones (`<think>`) as added tokens, kept
  whole; a BOS prepended when the file says so.
- SentencePiece BPE (`tokenizer.ggml.model` "llama": Llama 2, Mistral, TinyLlama): the pieces as
  the file spells them ("\u2581" for a space), one space prepended to the text unless
  `add_space_prefix` is false, bytes as `<0xNN>` tokens where no piece fits (byte fallback), the
  file's merges or, where it has none, the merges its scores imply; a BOS unless the file says
  otherwise. Phi-3's files spell the spaces in a normalizer instead (a "▁" prepended, every
  space replaced), as its tokenizer.json does, so text that starts with spaces keeps one more.
  Gemma's spell them in a normalizer with none prepended, store pieces of spaces alone as
  spaces, and rank derived merges by the pieces' order in the file, as transformers builds
  them.
- Any other `tokenizer.ggml.model` is refused, naming it.
"""

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from api_server.tokenizer.build_tokenizer import byte_alphabet

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
BYTE_LEVEL = "gpt2"
SENTENCEPIECE = "llama"
# Architectures whose SentencePiece tokenizer transformers builds another way (spaces, merges)
GEMMA_SENTENCEPIECE = ("gemma", "gemma2", "gemma3")  # spaces as pieces, merges in file order
NORMALIZED_SPACES = ("phi3",)  # SentencePiece with the spaces spelled by a normalizer
SPACE = "\u2581"  # SentencePiece's stand-in for a space
# The split before byte-level BPE, by tokenizer.ggml.pre, as each model family's tokenizer.json
# states it: Llama 3 groups up to three digits, Qwen 2 splits every digit
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _metadata(path: str) -> dict[str, object]:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path} as a GGUF file: {exc}") from None
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if name.startswith("tok") or name == "general.architecture"
    }


def gguf_tokenizer(path: str) -> tuple[Tokenizer, dict[str, object]]:
    """The file's tokenizer and the tokenizer_config.json the same model would ship (special
    tokens by text, `chat_template`); ValueError naming the key for a file it cannot build."""
    meta = _metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{path} has no tokenizer.ggml.tokens: expected the vocabulary")
    types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    if kind == BYTE_LEVEL:
        tokenizer, control = _byte_level(path, meta, tokens, types)
    elif kind == SENTENCEPIECE and meta.get("general.architecture") in GEMMA_SENTENCEPIECE:
        tokenizer, control = _gemma_sentencepiece(path, meta, tokens, types)
    elif kind == SENTENCEPIECE:
        tokenizer, control = _sentencepiece(path, meta, tokens, types)
    else:
        raise ValueError(
            f"{path} tokenizer.ggml.model={kind!r}: expected {BYTE_LEVEL!r} (byte-level BPE) or "
            f"{SENTENCEPIECE!r} (SentencePiece BPE); pass --tokenizer DIR with the model's "
            "tokenizer.json for other tokenizers"
        )
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in control]
    )
    vocab = tokenizer.get_vocab()
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, types, strict=False)
            if kind == TOKEN_TYPE_USER_DEFINED and token in vocab
        ]
    )
    config: dict[str, object] = {}
    for name, key in SPECIAL_TOKEN_IDS.items():
        token_id = meta.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    if isinstance(meta.get("tokenizer.chat_template"), str):
        config["chat_template"] = meta["tokenizer.chat_template"]
    bos = config.get("bos_token")
    # llama.cpp adds a BOS to a SentencePiece vocabulary unless the file says otherwise
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == SENTENCEPIECE)
    if add_bos and isinstance(bos, str):
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    return tokenizer, config


def _byte_level(
    path: str, meta: dict[str, object], tokens: list[str], types: list[int]
) -> tuple[Tokenizer, list[str]]:
    """Byte-level BPE and its control tokens; those spelled outside the byte alphabet are
    mislabelled plain tokens, not added."""
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise ValueError(f"{path} has no tokenizer.ggml.merges: expected byte-level BPE merges")
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {
        token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    split = SPLITS.get(str(meta.get("tokenizer.ggml.pre")))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    control = [
        token
        for token, kind in zip(tokens, types, strict=False)
        if kind == TOKEN_TYPE_CONTROL and set(token) <= spelled
    ]
    return tokenizer, control


def _sentencepiece(
    path: str, meta: dict[str, object], tokens: list[str], types: list[int]
) -> tuple[Tokenizer, list[str]]:
    """SentencePiece BPE as transformers' LlamaTokenizer runs it: "▁" for spaces, one prepended
    to the text (unless `add_space_prefix` is false), bytes as <0xNN> tokens where no piece
    fits, and merges from the file or, where it has none, derived from the pieces' scores."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    if isinstance(merges, list):
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise ValueError(
                f"{path} has neither tokenizer.ggml.merges nor a score per token "
                "(tokenizer.ggml.scores): expected one of them"
            )
        pairs = merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first" if add_prefix else "never", split=False
    )
    if meta.get("general.architecture") in NORMALIZED_SPACES:
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
        )
        tokenizer.pre_tokenizer = None
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    control = [tok for tok, kind in zip(tokens, types, strict=False) if kind == TOKEN_TYPE_CONTROL]
    return tokenizer, control


def _gemma_sentencepiece(
    path: str, meta: dict[str, object], tokens: list[str], types: list[int]
) -> tuple[Tokenizer, list[str]]:
    """Gemma's SentencePiece as transformers' GemmaTokenizer runs it: spaces become "▁" in a
    normalizer with none prepended, byte fallback, and, where the file lists no merges, the
    merges its vocabulary implies ranked by the pieces' order in the file (Gemma's scores do not
    follow its merges). Pieces of spaces alone, which llama.cpp stores as spaces, are spelled
    with "▁" as the normalized text is."""
    tokens = [SPACE * len(token) if token and not token.strip(" ") else token for token in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    if isinstance(merges, list):
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        pairs = merges_from_scores(vocab, {token: -float(i) for i, token in enumerate(tokens)})
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    control = [tok for tok, kind in zip(tokens, types, strict=False) if kind == TOKEN_TYPE_CONTROL]
    return tokenizer, control


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies, in transformers' order: every split of a
    piece into two pieces of the vocabulary (a piece's own splits ordered by their parts' ids),
    all sorted by the piece's score, then the left part's length, then the right part's, each
    descending."""
    found = []
    for piece, score in scores.items():
        splits = [
            (piece[:cut], piece[cut:])
            for cut in range(1, len(piece))
            if piece[:cut] in vocab and piece[cut:] in vocab
        ]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found.extend((left, right, score) for left, right in splits)
    found.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in found]
