"""The front end's side of structured outputs: the request fields that ask for them (OpenAI's
`response_format`, vLLM's `structured_outputs` and its older `guided_*` spellings) turned into
one protocol StructuredOutputs, checked before it is submitted: its size, its nesting, and that
its grammar parses (xgrammar, without the tokenizer). A bad one is a 400 naming the field. The
engine compiles it again against the vocabulary; this module holds no grammar state.
"""

import json
import re

import msgspec

from api_server.openai.errors import bad_param
from protocol.sampling import (
    MAX_CHOICES,
    MAX_JSON_SCHEMA_DEPTH,
    MAX_STRUCTURED_SPEC_BYTES,
    StructuredOutputs,
    json_nesting_depth,
)

_ABSENT = (b"", b"null")  # a Raw field left out, or given as null
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:,]', re.DOTALL)
# The fields a deep body is blamed on, by their key paths; any other, by its top-level key
_SCHEMA_FIELDS = (
    ("response_format", "json_schema", "schema"),
    ("structured_outputs", "json"),
    ("guided_json",),
)


class JsonSchemaFormat(msgspec.Struct, omit_defaults=True):
    """response_format's `json_schema` (OpenAI's shape): the schema is kept as raw JSON, so that
    a hostile nesting is measured here rather than recursed into while the body decodes."""

    name: str | None = None  # OpenAI requires it; vLLM does not, nor does kvserve
    schema: msgspec.Raw = msgspec.Raw()
    description: str | None = None
    strict: bool | None = None  # accepted: the grammar enforces the schema either way


class ResponseFormat(msgspec.Struct, omit_defaults=True):
    type: str  # "text", "json_object" or "json_schema"
    json_schema: JsonSchemaFormat | None = None  # with type "json_schema"


class StructuredOutputsRequest(msgspec.Struct, omit_defaults=True):
    """vLLM's `structured_outputs` object; exactly one of json, json_object, regex, choice and
    grammar. Its other options (whitespace patterns, structural tags) are not served."""

    json: msgspec.Raw = msgspec.Raw()  # a schema object, or its JSON text
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF, xgrammar's dialect (GBNF-like)
    disable_any_whitespace: bool = False
    structural_tag: msgspec.Raw = msgspec.Raw()  # refused


def structured_outputs_of(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputsRequest | None,
    guided_json: msgspec.Raw,
    guided_regex: str | None,
    guided_choice: list[str] | None,
    guided_grammar: str | None,
) -> StructuredOutputs | None:
    """The one constraint a request asks for, checked; None when it asks for none. A 400 naming
    the field when two fields ask, or when the constraint is bad."""
    asked: list[tuple[str, StructuredOutputs]] = []
    if response_format is not None and response_format.type != "text":
        asked.append(("response_format", _from_response_format(response_format)))
    if structured_outputs is not None:
        asked.append(("structured_outputs", _from_vllm_object(structured_outputs)))
    if bytes(guided_json) not in _ABSENT:
        asked.append(("guided_json", _spec("guided_json", json=_schema_text(guided_json))))
    for name, kind, value in (
        ("guided_regex", "regex", guided_regex),
        ("guided_choice", "choice", guided_choice),
        ("guided_grammar", "grammar", guided_grammar),
    ):
        if value is not None:
            asked.append((name, _spec(name, **{kind: value})))
    if not asked:
        return None
    if len(asked) > 1:
        names = [name for name, _ in asked]
        raise bad_param(names[1], f"{names} each ask for structured outputs: expected one")
    field_name, spec = asked[0]
    check_structured_outputs(spec, field_name)
    return spec


def check_structured_outputs(spec: StructuredOutputs, field_name: str) -> None:
    """ApiError (400, naming `field_name`) unless `spec`'s grammar is within the bounds and
    parses. For any caller that builds a StructuredOutputs itself (tool_choice, for one)."""
    if spec.json is not None:
        _check_json_schema_text(field_name, spec.json)
    for kind, text in (("regex", spec.regex), ("grammar", spec.grammar)):
        if text is not None and len(text.encode()) > MAX_STRUCTURED_SPEC_BYTES:
            raise bad_param(
                field_name,
                f"a {kind} of {len(text.encode())} bytes: expected at most "
                f"{MAX_STRUCTURED_SPEC_BYTES}",
            )
    if spec.choice is not None and not 1 <= len(spec.choice) <= MAX_CHOICES:
        raise bad_param(field_name, f"{len(spec.choice)} choices: expected 1 to {MAX_CHOICES}")
    if spec.choice is not None and not all(spec.choice):
        raise bad_param(field_name, "an empty choice: expected each choice to be non-empty")
    if spec.choice is not None and any("\0" in choice for choice in spec.choice):
        raise bad_param(field_name, "a choice holds a NUL character: expected none")
    # imported here: xgrammar loads torch, which only a server asked for structured outputs needs
    import xgrammar

    try:
        if spec.json is not None:
            xgrammar.Grammar.from_json_schema(spec.json)
        elif spec.regex is not None:
            xgrammar.Grammar.from_regex(spec.regex)
        elif spec.grammar is not None:
            xgrammar.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise bad_param(field_name, f"does not compile: {_first_line(exc)}") from None


def _from_response_format(response_format: ResponseFormat) -> StructuredOutputs:
    if response_format.type == "json_object":
        return StructuredOutputs(json_object=True)
    if response_format.type != "json_schema":
        raise bad_param(
            "response_format",
            f"type {response_format.type!r}: expected 'text', 'json_object' or 'json_schema'",
        )
    json_schema = response_format.json_schema
    if json_schema is None or bytes(json_schema.schema) in _ABSENT:
        raise bad_param(
            "response_format.json_schema",
            "type 'json_schema' needs json_schema.schema: expected a JSON schema object",
        )
    schema = _schema_text(json_schema.schema)
    return _spec("response_format", json=schema)


def _from_vllm_object(request: StructuredOutputsRequest) -> StructuredOutputs:
    if bytes(request.structural_tag) not in _ABSENT:
        raise bad_param("structured_outputs.structural_tag", "structural tags are not supported")
    kinds: dict[str, object] = {}
    if bytes(request.json) not in _ABSENT:
        kinds["json"] = _schema_text(request.json)
    if request.json_object:
        kinds["json_object"] = True
    for kind, value in (
        ("regex", request.regex),
        ("choice", request.choice),
        ("grammar", request.grammar),
    ):
        if value is not None:
            kinds[kind] = value
    if len(kinds) != 1:
        raise bad_param(
            "structured_outputs",
            f"sets {sorted(kinds) or 'nothing'}: expected exactly one of json, json_object, "
            "regex, choice, grammar",
        )
    return _spec(
        "structured_outputs", disable_any_whitespace=request.disable_any_whitespace, **kinds
    )


def _spec(field_name: str, **fields: object) -> StructuredOutputs:
    """The protocol struct; a 400 naming the field when it is not exactly one kind."""
    try:
        return StructuredOutputs(**fields)  # type: ignore[arg-type]
    except ValueError as exc:
        raise bad_param(field_name, str(exc)) from None


def _schema_text(raw: msgspec.Raw) -> str:
    """A schema given as an object, or as its JSON text (vLLM takes both), as JSON text."""
    data = bytes(raw)
    if data[:1] == b'"':  # the schema's text inside a JSON string
        data = msgspec.json.decode(data, type=str).encode()
    return data.decode()  # checked with the rest by check_structured_outputs


def _check_json_schema_text(field_name: str, text: str) -> None:
    data = text.encode()
    if len(data) > MAX_STRUCTURED_SPEC_BYTES:
        raise bad_param(
            field_name,
            f"a schema of {len(data)} bytes: expected at most {MAX_STRUCTURED_SPEC_BYTES}",
        )
    depth = json_nesting_depth(text, MAX_JSON_SCHEMA_DEPTH)
    if depth > MAX_JSON_SCHEMA_DEPTH:
        raise bad_param(
            field_name,
            f"a schema nested more than {MAX_JSON_SCHEMA_DEPTH} levels deep: expected at most "
            f"{MAX_JSON_SCHEMA_DEPTH}",
        )
    try:
        schema = json.loads(data)
    except ValueError as exc:
        raise bad_param(field_name, f"the schema is not JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise bad_param(field_name, f"a schema of type {type(schema).__name__}: expected an object")


def _first_line(exc: Exception) -> str:
    """xgrammar's message without its C++ source location, on one line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"\[[0-9:]+\] \S+:\d+: ", "", text)


def too_deep_param(body: bytes, limit: int = MAX_JSON_SCHEMA_DEPTH) -> str | None:
    """The parameter of a JSON body that nests objects and arrays more than `limit` levels
    (a schema's field, or else the top-level key), found by a scan that never recurses; None
    when nothing is that deep."""
    path: list[str | None] = []  # per open container: the object's current key, or None
    expects_key: list[bool] = []
    for token in _JSON_TOKEN.findall(body):
        if token in (b"{", b"["):
            path.append(None)
            expects_key.append(token == b"{")
            if len(path) > limit + 1:  # the body's own object is level 0
                keys = [key for key in path if key is not None]
                for field in _SCHEMA_FIELDS:
                    if tuple(keys[: len(field)]) == field:
                        return ".".join(field)
                return keys[0] if keys else None
        elif token in (b"}", b"]"):
            if path:
                path.pop()
                expects_key.pop()
        elif token == b",":
            if expects_key and path[-1] is not None:
                expects_key[-1] = True
        elif token != b":" and expects_key and expects_key[-1]:
            path[-1] = msgspec.json.decode(token, type=str)
            expects_key[-1] = False
    return None
