"""A chat's `tools` and `tool_choice` checked against each other, and the structured-output
constraint that enforces tool_choice "required" or a named function: a JSON schema the reply
must match, so that its calls always parse and fit their function's parameters.
"""

import json

from api_server.openai.errors import ApiError, bad_param
from protocol.sampling import StructuredOutputs

TOOL_CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function that takes nothing
# The key of a call's arguments in the array "required" constrains a reply to, as vLLM names it
REQUIRED_ARGUMENTS_KEY = "parameters"

JsonObject = dict[str, object]


def check_tools(tools: list[JsonObject] | None) -> list[str]:
    """The tools' function names; a 400 naming `tools` where one is not OpenAI's function
    tool `{"type": "function", "function": {"name": ..., "parameters": {...}}}`."""
    names = []
    for idx, tool in enumerate(tools or []):
        where = f"tools[{idx}]"
        if tool.get("type") != "function":
            raise bad_param("tools", f"{where}.type is {tool.get('type')!r}: expected 'function'")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_param("tools", f"{where}.function.name is missing: expected a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_param(
                "tools", f"{where}.function.parameters: expected a JSON schema object or null"
            )
        names.append(function["name"])
    return names


def named_function(tool_choice: str | JsonObject | None) -> str | None:
    """The name a `{"type": "function", "function": {"name": ...}}` choice forces; None for
    the string choices. A choice of neither shape is a 400 naming tool_choice."""
    if tool_choice is None or tool_choice in TOOL_CHOICES:
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    raise bad_param(
        "tool_choice",
        f"tool_choice={tool_choice!r}: expected 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': NAME}}",
    )


def check_tool_choice(tools: list[JsonObject] | None, tool_choice: str | JsonObject | None) -> None:
    """A 400 naming the field where tool_choice cannot be served with these tools: required and
    a named function need tools, and the name must be one of them."""
    names = check_tools(tools)
    name = named_function(tool_choice)
    if (tool_choice == "required" or name is not None) and not names:
        raise bad_param(
            "tool_choice",
            f"tool_choice={tool_choice!r} needs tools: expected at least one in tools",
        )
    if name is not None and name not in names:
        raise bad_param(
            "tool_choice", f"function {name!r} is not among the tools: expected one of {names}"
        )


def _function(tool: JsonObject) -> JsonObject:
    function = tool["function"]
    assert isinstance(function, dict)  # check_tools has checked it
    return function


def _parameters(function: JsonObject) -> JsonObject:
    parameters = function.get("parameters")
    return dict(parameters) if isinstance(parameters, dict) else dict(EMPTY_PARAMETERS)


def _hoist_definitions(schemas: list[JsonObject]) -> JsonObject:
    """The `$defs` of every tool's schema, taken out of it to the constraint's root, where
    their `#/$defs/...` references point once the schemas sit inside the array's."""
    definitions: JsonObject = {}
    for schema in schemas:
        for name, definition in (schema.pop("$defs", None) or {}).items():
            if definitions.setdefault(name, definition) != definition:
                raise bad_param(
                    "tools",
                    f"two tools define $defs/{name} differently: tool_choice 'required' "
                    "needs one definition per name",
                )
    return definitions


def required_schema(tools: list[JsonObject], is_parallel: bool) -> JsonObject:
    """The schema of tool_choice "required": an array of `{"name": NAME, "parameters": {...}}`
    calls, each naming one tool with arguments that fit it; one call unless `is_parallel`."""
    functions = [_function(tool) for tool in tools]
    parameters = [_parameters(function) for function in functions]
    definitions = _hoist_definitions(parameters)
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [function["name"]]},
                REQUIRED_ARGUMENTS_KEY: schema,
            },
            "required": ["name", REQUIRED_ARGUMENTS_KEY],
            "additionalProperties": False,
        }
        for function, schema in zip(functions, parameters, strict=True)
    ]
    schema: JsonObject = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not is_parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def named_schema(tools: list[JsonObject], name: str) -> JsonObject:
    """The schema of a named choice: that function's parameters, which the reply is."""
    for tool in tools:
        function = _function(tool)
        if function["name"] == name:
            return _parameters(function)
    raise ApiError(400, f"function {name!r} is not among the tools", param="tool_choice")


def forced_constraint(
    tools: list[JsonObject] | None, tool_choice: str | JsonObject | None, is_parallel: bool
) -> StructuredOutputs | None:
    """The constraint a forcing tool_choice puts on the reply; None for none and auto."""
    name = named_function(tool_choice)
    if name is not None:
        schema = named_schema(tools or [], name)
    elif tool_choice == "required":
        schema = required_schema(tools or [], is_parallel)
    else:
        return None
    return StructuredOutputs(json=json.dumps(schema, ensure_ascii=False))
