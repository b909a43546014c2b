"""ChatTemplate: a checkpoint's Jinja chat template, rendered in jinja2's immutable sandbox with
the variables and helpers Hugging Face templates expect. Templates come from model repositories,
so they are untrusted code: they may read what they are given and nothing else.
"""

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Plain JSON data a template sees: a message, a tool schema, a value of chat_template_kwargs
TemplateValue = str | int | float | bool | None | list | dict
COMPILE_ERROR = "chat template does not compile"  # how a ChatTemplateError of the source begins
MAX_CACHED_TEMPLATES = 8  # requests' own templates kept compiled (a compile takes milliseconds)


class ChatTemplateError(ValueError):
    """A template that does not compile, or that refused the chat (its raise_exception)."""


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which training templates put around assistant
    turns to mark them: rendering keeps the text as it is, but without this the template would
    not even parse."""

    tags = {"generation"}  # noqa: RUF012  (jinja reads it as a class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _SafeNamespace(jinja2.utils.Namespace):
    """jinja's `namespace()` refusing underscore names, so that a template cannot store or reach
    Python internals through one."""

    def __init__(*args: object, **kwargs: object) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)  # type: ignore[call-overload]
        for name in attrs:
            _SafeNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)  # type: ignore[arg-type]

    def __setitem__(self, name: str, value: object) -> None:
        _SafeNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"namespace attribute {name!r}: expected a name without a leading underscore"
            )


def as_system_if_developer(message: dict[str, TemplateValue]) -> dict[str, TemplateValue]:
    """The message, a `developer` one as `system`: OpenAI renamed the role, templates know the
    old name."""
    if message.get("role") != "developer":
        return message
    return {**message, "role": "system"}


def open_final_message(text: str, messages: list[dict[str, TemplateValue]]) -> str:
    """`text` cut right after the final message's content, so that the model continues that
    message instead of starting a new one (vLLM's continue_final_message)."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message: the final message has no text to continue")
    # A template may trim what it prints (Llama 3's do): then the trimmed text is what ends it
    for shown in (content, content.strip()):
        idx = text.rfind(shown)
        if idx >= 0:
            return text[: idx + len(shown)]
    raise ChatTemplateError(
        "continue_final_message: the chat template does not print the final message's content"
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt's text
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_spec: str) -> str:
    return datetime.now().strftime(format_spec)


def _environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks and lstrip_blocks as transformers sets them: the whitespace of a template's
    # block tags decides the prompt's text, so a different setting would change the tokens
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlocks, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    return env


class ChatTemplate:
    """One compiled template and the special tokens it may print (bos_token, eos_token, ...)."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"{COMPILE_ERROR}: {exc}") from None
        self.source = source
        self.special_tokens = special_tokens  # {"bos_token": "<s>", ...}: variables it reads
        # Templates written before OpenAI's developer role drop or refuse a role they do not
        # know; one that names it decides itself what a developer message becomes
        self.has_developer_role = "developer" in source

    def render(
        self,
        messages: list[dict[str, TemplateValue]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, TemplateValue]] | None = None,
        extra: dict[str, TemplateValue] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt's text; `extra` (a request's chat_template_kwargs) may override the
        special tokens, as transformers lets keyword arguments do. With
        `continue_final_message` it ends inside the final message (open_final_message)."""
        # Keys whose value is None are dropped, as transformers drops them: templates test
        # `'tool_calls' in message`, and print a literal None for one that is present
        plain = [{key: value for key, value in m.items() if value is not None} for m in messages]
        if not self.has_developer_role:
            plain = [as_system_if_developer(message) for message in plain]
        variables = {**self.special_tokens, **(extra or {})}
        try:
            text = self._template.render(
                messages=plain,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None
        return open_final_message(text, plain) if continue_final_message else text


class TemplateCache:
    """Templates that requests bring (vLLM's per-request `chat_template`), compiled once each and
    kept while among the last MAX_CACHED_TEMPLATES used.

    Invariant: at most MAX_CACHED_TEMPLATES entries, each keyed by its own source."""

    def __init__(self, special_tokens: dict[str, str]) -> None:
        self.special_tokens = special_tokens
        self._by_source: dict[str, ChatTemplate] = {}  # least recently used first

    def get(self, source: str) -> ChatTemplate:
        template = self._by_source.pop(source, None)
        if template is None:
            template = ChatTemplate(source, self.special_tokens)
            if len(self._by_source) >= MAX_CACHED_TEMPLATES:
                del self._by_source[next(iter(self._by_source))]
        self._by_source[source] = template
        return template

    def check_invariants(self) -> None:
        assert len(self._by_source) <= MAX_CACHED_TEMPLATES, len(self._by_source)
        for source, template in self._by_source.items():
            assert template.source == source, "a cached template under another source"
