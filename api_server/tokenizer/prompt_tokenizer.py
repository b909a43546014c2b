"""The front end's tokenizers: `load_tokenizer` picks the byte-level ByteTokenizer of the fake
models (ids back to text never raise: an id outside the vocabulary becomes a visible placeholder)
or a checkpoint's own CheckpointTokenizer; PromptTokenizer is what the routes use of either.
"""

import codecs
import json
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer

from api_server.tokenizer.build_tokenizer import (
    CHAT_ROLES,
    END_OF_TURN,
    GENERATION_PROMPT,
    NUM_BYTE_TOKENS,
    TOKENIZER_DIR,
)
from api_server.tokenizer.chat_template import (
    ChatTemplate,
    TemplateCache,
    TemplateValue,
    as_system_if_developer,
    open_final_message,
)
from api_server.tokenizer.checkpoint_tokenizer import (
    GGUF_SUFFIX,
    SPECIAL_TOKEN_NAMES,
    CheckpointTokenizer,
    encode_ids,
)

DEFAULT_TOKENIZER_DIR = TOKENIZER_DIR


class TextDetokenizer(Protocol):
    """One request's ids to text, piece by piece, never splitting a character."""

    def push(self, token_ids: list[int]) -> str: ...

    def finish(self) -> str: ...


class PromptTokenizer(Protocol):
    """What the routes need of a tokenizer: ByteTokenizer and CheckpointTokenizer both are one."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def render_chat(
        self,
        messages: list[dict[str, TemplateValue]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, TemplateValue]] | None = None,
        extra: dict[str, TemplateValue] | None = None,
        add_special_tokens: bool = False,
        chat_template: str | None = None,
        continue_final_message: bool = False,
    ) -> list[int]: ...

    def detokenizer(self, skip_special_tokens: bool = True) -> TextDetokenizer: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_texts(self, token_ids: list[int]) -> list[str]: ...

    def token_strs(self, token_ids: list[int]) -> list[str]: ...


def placeholder(token_id: int) -> str:
    """The text of an id the tokenizer has no token for."""
    return f"<|tok_{token_id}|>"


class IncrementalDetokenizer:
    """Turns one request's ids into text piece by piece; a character split across two steps'
    bytes comes out whole in the later piece. Invariant: `_pending` holds only an incomplete
    UTF-8 prefix."""

    def __init__(self, special_texts: dict[int, str]) -> None:
        self._special_texts = special_texts
        self._pending = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: list[int]) -> str:
        """The text that `token_ids` complete."""
        pieces = []
        for token_id in token_ids:
            if 0 <= token_id < NUM_BYTE_TOKENS:
                pieces.append(self._pending.decode(bytes((token_id,))))
                continue
            pieces.append(self._pending.decode(b"", final=True))  # a cut-off character is U+FFFD
            text = self._special_texts.get(token_id)
            pieces.append(placeholder(token_id) if text is None else text)
        return "".join(pieces)

    def finish(self) -> str:
        """What remains: an incomplete character at the end becomes U+FFFD."""
        return self._pending.decode(b"", final=True)


class ByteTokenizer:
    """The byte-level tokenizer of the fake models: ids 0-255 are UTF-8 bytes, specials follow."""

    def __init__(
        self, folder: Path = DEFAULT_TOKENIZER_DIR, chat_template: str | None = None
    ) -> None:
        """`chat_template` (--chat-template's text) replaces the byte chat format."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}: expected a tokenizer folder")
        self.folder = folder
        self._tokenizer = Tokenizer.from_file(str(path))
        self._special_texts = {
            token_id: added.content
            for token_id, added in self._tokenizer.get_added_tokens_decoder().items()
        }
        config_path = folder / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if isinstance(text := self.config.get(name), str)
        }
        self._template = (
            None if chat_template is None else ChatTemplate(chat_template, self.special_tokens)
        )
        self._request_templates = TemplateCache(self.special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it (`<|user|>`) become their ids. The
        byte format adds none around a text, whatever `add_special_tokens` says."""
        return encode_ids(self._tokenizer, text, add_special_tokens=False)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """Special tokens keep their text even when skipping is asked: the fake models' chat
        format has no special token a reply would carry but its stop token, never shown."""
        return IncrementalDetokenizer(self._special_texts)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        detokenizer = self.detokenizer()
        return detokenizer.push(token_ids) + detokenizer.finish()

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each id's own text, as logprobs show it: a lone byte of a longer character is U+FFFD."""
        return [self.decode([token_id]) for token_id in token_ids]

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each id's vocabulary entry (a space byte is `Ġ`), as /tokenize shows them."""
        return [
            self._tokenizer.id_to_token(token_id) or placeholder(token_id) for token_id in token_ids
        ]

    def render_chat(
        self,
        messages: list[dict[str, TemplateValue]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, TemplateValue]] | None = None,
        extra: dict[str, TemplateValue] | None = None,
        add_special_tokens: bool = False,
        chat_template: str | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The ids of apply_chat_template's text: of the byte format, which has no tools and no
        options, unless a Jinja template (the request's, or --chat-template's) replaces it."""
        template = self._template
        if chat_template is not None:
            template = self._request_templates.get(chat_template)
        if template is not None:
            text = template.render(
                messages, add_generation_prompt, tools, extra, continue_final_message
            )
            return self.encode(text)
        if tools:
            raise ValueError("tools: the fake models' chat format has none: expected no tools")
        plain = [as_system_if_developer(message) for message in messages]
        turns = [(str(m.get("role")), str(m.get("content", ""))) for m in plain]
        text = self.apply_chat_template(turns)
        if not add_generation_prompt:
            text = text.removesuffix(GENERATION_PROMPT)
        if continue_final_message:
            text = open_final_message(text, plain)
        return self.encode(text)

    def apply_chat_template(self, messages: list[tuple[str, str]]) -> str:
        """The prompt of a chat: `<|role|>content<|end|>` per message, then `<|assistant|>`.

        The same text as the Jinja `chat_template` of tokenizer_config.json, which HF clients use.
        """
        turns = []
        for role, content in messages:
            if role not in CHAT_ROLES:
                raise ValueError(f"chat role {role!r}: expected one of {list(CHAT_ROLES)}")
            turns.append(f"<|{role}|>{content}{END_OF_TURN}")
        return "".join(turns) + GENERATION_PROMPT


def load_tokenizer(
    model: str, tokenizer: str | None = None, chat_template: str | None = None
) -> ByteTokenizer | CheckpointTokenizer:
    """The tokenizer of `model` (a built-in name, a checkpoint folder or a GGUF file), or of the
    folder `tokenizer` names when given (vLLM's --tokenizer); `chat_template` replaces its own."""
    if tokenizer is not None:
        return CheckpointTokenizer(Path(tokenizer), chat_template)
    folder = Path(model)
    if folder.is_dir() or (folder.suffix == GGUF_SUFFIX and folder.is_file()):
        return CheckpointTokenizer(folder, chat_template)
    return ByteTokenizer(chat_template=chat_template)
