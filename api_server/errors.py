"""ApiError: a refusal in OpenAI's error shape, `{"error": {message, type, param, code}}`, with
its HTTP status; and the wording of request-validation failures, each naming the parameter.
"""

from http import HTTPStatus

import pydantic

ERROR_TYPES = {  # HTTP status -> OpenAI's error type
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
MAX_VALUE_REPR_CHARS = 80  # of a bad value quoted in an error message
UNION_TAGS = {"str", "int", "float", "bool", "none"}  # pydantic's names of plain union members


class ApiError(Exception):
    """A request refused with `status`; `param` names the request field at fault, if one is."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, str | int | None]]:
        error_type = ERROR_TYPES.get(self.status, "invalid_request_error")
        code = self.code if self.code is not None else _phrase(self.status)
        return {
            "error": {
                "message": self.message,
                "type": error_type,
                "param": self.param,
                "code": code.lower().replace(" ", "_"),
            }
        }


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # 499, nginx's "client closed request", is not in HTTPStatus
        return "error"


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _param_path(loc: tuple[int | str, ...]) -> str | None:
    """`messages[0].content` from pydantic's location, cut at a union-member tag: the fault is
    the value of the union as a whole."""
    path = ""
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
        elif item in UNION_TAGS or "[" in item or not item.isidentifier():
            break
        else:
            path += f".{item}" if path else item
    return path or None


def quoted(value: object) -> str:
    text = repr(value)
    if len(text) > MAX_VALUE_REPR_CHARS:
        text = text[: MAX_VALUE_REPR_CHARS - 3] + "..."
    return text


def validation_error(exc: pydantic.ValidationError) -> ApiError:
    """The request's first fault as a 400 naming the parameter (the body, for bad JSON)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    kind = first["type"]
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first['msg'].lower()}")
    if kind == "model_type" and not first["loc"]:
        return ApiError(400, "the body is not a JSON object: expected an object of parameters")
    param = _param_path(first["loc"])
    if kind == "extra_forbidden":
        return ApiError(400, f"unknown parameter {param!r}: not part of this API", param=param)
    if kind == "missing":
        return ApiError(400, f"{param}: required parameter is missing", param=param)
    same_param = [error for error in errors if _param_path(error["loc"]) == param]
    if len(same_param) > 1:  # a union: no single member's complaint explains it
        return ApiError(
            400, f"{param} {quoted(first['input'])}: wrong type for this parameter", param=param
        )
    return ApiError(
        400,
        f"{param} {quoted(first['input'])}: {first['msg'][:1].lower()}{first['msg'][1:]}",
        param=param,
    )
