"""The request fields that ask for structured outputs, each turned into the one protocol
StructuredOutputs the engine compiles; and every bad one a 400 naming its field before anything
is submitted: a grammar that does not parse, a schema 10,000 levels deep, a 5 MB regex, two
fields asking at once. The offline API's StructuredOutputsParams builds the same struct.
"""

import json

import pytest

from api_server.openai.errors import ApiError
from api_server.openai.protocol import CHAT_DECODER, COMPLETION_DECODER, parse_body
from api_server.openai.structured_outputs import check_structured_outputs
from kvserve import SamplingParams, StructuredOutputsParams
from kvserve.sampling_params import engine_params
from protocol.sampling import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}
SCHEMA_TEXT = json.dumps(SCHEMA)
DEEP_SCHEMA = '{"type": "object", "properties": {"a": ' * 10_000 + "{}" + "}}" * 10_000


def _chat(extra: dict | str) -> bytes:
    if isinstance(extra, str):  # raw JSON of the extra fields, for bodies json.dumps cannot make
        return b'{"messages": [{"role": "user", "content": "x"}], ' + extra.encode() + b"}"
    return json.dumps({"messages": [{"role": "user", "content": "x"}], **extra}).encode()


def _spec(body: bytes, decoder=CHAT_DECODER) -> StructuredOutputs | None:
    return parse_body(body, decoder).structured_outputs_spec()


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputs(json=SCHEMA_TEXT),
        ),
        ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs(json=SCHEMA_TEXT)),
        ({"structured_outputs": {"json": SCHEMA_TEXT}}, StructuredOutputs(json=SCHEMA_TEXT)),
        (
            {"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
            StructuredOutputs(regex="a+", disable_any_whitespace=True),
        ),
        ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutputs(choice=["x", "y"])),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            StructuredOutputs(grammar='root ::= "a"'),
        ),
        ({"guided_json": SCHEMA}, StructuredOutputs(json=SCHEMA_TEXT)),
        ({"guided_regex": "[0-9]{2}"}, StructuredOutputs(regex="[0-9]{2}")),
        ({"guided_choice": ["x"]}, StructuredOutputs(choice=["x"])),
        ({"guided_grammar": 'root ::= "b"'}, StructuredOutputs(grammar='root ::= "b"')),
        ({"guided_json": None, "structured_outputs": None}, None),
    ],
)
def test_each_spelling_becomes_one_structured_outputs(
    extra: dict, expected: StructuredOutputs | None
) -> None:
    assert _spec(_chat(extra)) == expected


def test_completions_take_them_too() -> None:
    body = json.dumps({"prompt": "x", "structured_outputs": {"regex": "a"}}).encode()
    assert _spec(body, COMPLETION_DECODER) == StructuredOutputs(regex="a")


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"guided_regex": "(a"}, "guided_regex", "does not compile"),
        ({"structured_outputs": {"grammar": "root ::= b"}}, "structured_outputs", "compile"),
        ({"guided_json": "{bad"}, "guided_json", "not JSON"),
        ({"guided_json": [1]}, "guided_json", "expected an object"),
        ({"guided_regex": "a" * (5 << 20)}, "guided_regex", "expected at most 65536"),
        ({"structured_outputs": {"regex": "a" * (5 << 20)}}, "structured_outputs", "bytes"),
        ({"guided_choice": []}, "guided_choice", "0 choices"),
        ({"guided_choice": [""]}, "guided_choice", "empty choice"),
        ({"guided_regex": "a", "guided_json": SCHEMA}, "guided_regex", "expected one"),
        (
            {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
            "guided_choice",
            "one",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"structural_tag": {}}},
            "structured_outputs.structural_tag",
            "not",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "'xml'"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
        (
            '"response_format": {"type": "json_schema", "json_schema": {"schema": '
            + DEEP_SCHEMA
            + "}}",
            "response_format.json_schema.schema",
            "levels deep",
        ),
        ('"guided_json": ' + DEEP_SCHEMA, "guided_json", "levels deep"),
        ('"structured_outputs": {"json": ' + DEEP_SCHEMA + "}", "structured_outputs.json", "deep"),
        ({"guided_json": json.loads('{"a": ' * 70 + "1" + "}" * 70)}, "guided_json", "64 levels"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_its_field(
    extra: dict | str, param: str, words: str
) -> None:
    with pytest.raises(ApiError) as raised:
        _spec(_chat(extra))
    assert raised.value.status == 400 and raised.value.param == param
    assert words in raised.value.message


def test_the_check_other_callers_use_names_their_field() -> None:
    check_structured_outputs(StructuredOutputs(json=SCHEMA_TEXT), "tool_choice")
    with pytest.raises(ApiError) as raised:
        check_structured_outputs(StructuredOutputs(json='{"type": "nope"}'), "tool_choice")
    assert raised.value.param == "tool_choice" and raised.value.status == 400


def test_offline_structured_outputs_params_as_vllm_spells_them() -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    assert engine_params(params).structured_outputs == StructuredOutputs(json=SCHEMA_TEXT)
    choice = StructuredOutputsParams(choice=["a", "b"])
    assert choice == StructuredOutputs(choice=["a", "b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", grammar='root ::= "a"')
    with pytest.raises(ValueError, match="does not compile"):
        engine_params(SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
