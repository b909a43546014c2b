"""CheckpointTokenizer: a Hugging Face checkpoint's own tokenizer, read from its tokenizer.json with
the `tokenizers` library and from tokenizer_config.json (special tokens, the chat template, or
chat_template.jinja beside it). transformers is never imported here: it is a test
dependency only, against which the tests check these ids.
"""

import json
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from api_server.tokenizer.chat_template import ChatTemplate, TemplateCache, TemplateValue
from api_server.tokenizer.gguf_tokenizer import gguf_tokenizer

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Longer texts are encoded through encode_batch, which releases the GIL (encode holds it): a
# front end that tokenizes a long prompt in a worker thread then keeps its event loop serving
GIL_FREE_ENCODE_CHARS = 16 * 1024
DEFAULT_TEMPLATE_NAME = "default"
GGUF_SUFFIX = ".gguf"
TOOL_TEMPLATE_NAME = "tool_use"  # the named template transformers picks when tools are given


def encode_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The ids of `text`; the same ids either way, only the GIL differs (see above)."""
    if len(text) > GIL_FREE_ENCODE_CHARS:
        return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


class StreamDetokenizer:
    """One request's ids to text, piece by piece, through the tokenizer's own incremental decoder
    (DecodeStream), which holds back a character whose bytes are split across tokens.

    Invariant: `_pending` holds the ids pushed since the decoder last produced text; ids outside
    the vocabulary are dropped, as `Tokenizer.decode` drops them.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []

    def push(self, token_ids: list[int]) -> str:
        """The text that `token_ids` complete."""
        pieces = []
        for token_id in token_ids:
            if not 0 <= token_id < self._vocab_size:
                continue
            piece = self._stream.step(self._tokenizer, token_id)
            if piece is None:
                self._pending.append(token_id)
            else:
                self._pending.clear()
                pieces.append(piece)
        return "".join(pieces)

    def finish(self) -> str:
        """What remains: bytes of a character cut off at the end decode to U+FFFD, as they do in
        a decode of all the ids."""
        if not self._pending:
            return ""
        text = self._tokenizer.decode(self._pending, skip_special_tokens=self._skip_special_tokens)
        self._pending.clear()
        return text


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken's dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _template_sources(folder: Path, config: dict[str, object]) -> dict[str, str]:
    """The checkpoint's chat templates by name: chat_template.jinja (as transformers 5 saves it)
    wins over tokenizer_config.json's `chat_template`, a string or a list of named ones."""
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        return {DEFAULT_TEMPLATE_NAME: jinja_path.read_text()}
    source = config.get("chat_template")
    if isinstance(source, str):
        return {DEFAULT_TEMPLATE_NAME: source}
    if isinstance(source, list):
        return {
            entry["name"]: entry["template"]
            for entry in source
            if isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("template"), str)
        }
    return {}


class CheckpointTokenizer:
    """Text to ids and back as the checkpoint's tokenizer does it, and its chat template.

    A completion prompt gets the special tokens the tokenizer adds (a Llama's bos); a chat gets
    none beyond what its template writes, as transformers' apply_chat_template tokenizes it, so
    a template that prints bos_token does not get a second one.
    """

    def __init__(self, folder: Path, chat_template: str | None = None) -> None:
        """`chat_template` (--chat-template's text) replaces the checkpoint's templates.
        `folder` may be a GGUF file, whose metadata holds the tokenizer (gguf_tokenizer.py)."""
        self.folder = folder
        if folder.suffix == GGUF_SUFFIX and folder.is_file():
            self._tokenizer, config = gguf_tokenizer(str(folder))
        else:
            path = folder / "tokenizer.json"
            if not path.is_file():
                raise FileNotFoundError(
                    f"no tokenizer.json in {folder}: expected a tokenizer folder"
                )
            self._tokenizer = Tokenizer.from_file(str(path))
            config_path = folder / "tokenizer_config.json"
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.config: dict[str, object] = config if isinstance(config, dict) else {}
        self.special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(self.config.get(name))) is not None
        }
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id = None if bos is None else self._tokenizer.token_to_id(bos)
        sources = _template_sources(folder, self.config)
        if chat_template is not None:
            sources = {DEFAULT_TEMPLATE_NAME: chat_template}
        self._templates = {
            name: ChatTemplate(source, self.special_tokens) for name, source in sources.items()
        }
        self._request_templates = TemplateCache(self.special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt's ids, with the special tokens tokenizer.json's post-processor
        adds (a Llama's bos) unless told not to. tokenizer_config.json's add_bos_token is not
        consulted: given a tokenizer.json, transformers 5 follows the post-processor alone,
        whatever the class."""
        return encode_ids(self._tokenizer, text, add_special_tokens=add_special_tokens)

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
        """A chat's prompt ids: the template's text, by default with no special tokens added
        to it (vLLM's add_special_tokens, false for a chat). `chat_template`, a request's own,
        replaces the checkpoint's."""
        template = self._template_for(tools, chat_template)
        text = template.render(
            messages, add_generation_prompt, tools, extra, continue_final_message
        )
        return encode_ids(self._tokenizer, text, add_special_tokens=add_special_tokens)

    def _template_for(
        self, tools: list[dict[str, TemplateValue]] | None, chat_template: str | None
    ) -> ChatTemplate:
        """The request's own template, or the checkpoint's (its tool_use one when tools are
        given, as transformers picks)."""
        if chat_template is not None:
            return self._request_templates.get(chat_template)
        if not self._templates:
            raise ValueError(
                f"the tokenizer in {self.folder} has no chat template: expected a chat_template "
                "in tokenizer_config.json or a chat_template.jinja; use /v1/completions"
            )
        name = TOOL_TEMPLATE_NAME if tools and TOOL_TEMPLATE_NAME in self._templates else None
        template = self._templates.get(name or DEFAULT_TEMPLATE_NAME)
        if template is None:
            template = next(iter(self._templates.values()))
        return template

    def detokenizer(self, skip_special_tokens: bool = True) -> StreamDetokenizer:
        return StreamDetokenizer(self._tokenizer, skip_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each id's own text, special tokens included, as logprobs show them; an id outside
        the vocabulary is ''."""
        return [
            self._tokenizer.decode([token_id], skip_special_tokens=False) for token_id in token_ids
        ]

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each id's vocabulary entry, as /tokenize shows them (vLLM's convert_ids_to_tokens);
        an id outside the vocabulary is ''."""
        return [self._tokenizer.id_to_token(token_id) or "" for token_id in token_ids]
