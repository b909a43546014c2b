"""ApiError: a refusal in OpenAI's error shape, `{"error": {message, type, param, code}}`, with
its HTTP status; and the wording of request-validation failures, each naming the parameter.
"""

import re
from http import HTTPStatus

import msgspec

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
# msgspec's wording of a missing field (its other faults end "- at `$.path`")
MISSING_FIELD = re.compile(r"Object missing required field `([^`]*)`")


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


def quoted(value: object) -> str:
    text = repr(value)
    if len(text) > MAX_VALUE_REPR_CHARS:
        text = text[: MAX_VALUE_REPR_CHARS - 3] + "..."
    return text


def _lowercase_first(text: str) -> str:
    """msgspec's sentence made to start lowercase, as every message here does ("JSON" stays)."""
    if text[1:2].isupper():
        return text
    return text[:1].lower() + text[1:]


def _param_path(path: str) -> str:
    """`messages[0].role` from msgspec's `$.messages[0].role`."""
    return path.removeprefix("$").removeprefix(".")


def decode_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> ApiError:
    """The body's first fault as a 400 naming the parameter (none, for bad JSON)."""
    message = str(exc)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return ApiError(400, f"the body is not valid JSON: {_lowercase_first(message)}")
    reason, _, path = message.partition(" - at `")
    path = _param_path(path.removesuffix("`"))
    if reason.startswith("Expected `object`") and not path:
        return ApiError(400, "the body is not a JSON object: expected an object of parameters")
    field = MISSING_FIELD.match(reason)
    if field is not None:
        param = f"{path}.{field[1]}" if path else field[1]
        return ApiError(400, f"{param}: required parameter is missing", param=param)
    param = path or None
    reason = _lowercase_first(reason)
    return ApiError(400, f"{param}: {reason}" if param else f"bad body: {reason}", param=param)
