"""OpenAI-style error bodies, and the 400s of request bodies that do not parse."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from protocol.config import ContextTooLong, InvalidParam

MAX_ERROR_CHARS = 400
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """A request that cannot be served, with the HTTP status and OpenAI error fields to answer it with."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        cut = len(message) - MAX_ERROR_CHARS  # an error body never carries a client's whole input back
        self.message = message if cut <= 0 else message[:MAX_ERROR_CHARS] + f"... ({cut} more characters)"

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def from_invalid_param(
    exc: InvalidParam, prompt_field: str = "prompt", max_tokens_field: str = "max_tokens"
) -> APIError:
    """A 400 naming the field the client sent (chat: messages, maybe max_completion_tokens)."""
    field = {"prompt": prompt_field, "max_tokens": max_tokens_field}.get(exc.field, exc.field)
    message = str(exc).replace("max_tokens", max_tokens_field) if exc.field == "max_tokens" else str(exc)
    code = "context_length_exceeded" if isinstance(exc, ContextTooLong) else "invalid_value"
    return bad_request(message, field, code)


def parse_request(model: type[BaseModel], body: bytes) -> BaseModel:
    """Bytes -> validated request; bad UTF-8, bad JSON and wrong types all become one 400 (the inputs left out)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
    if errors and errors[0]["type"] == "json_invalid":
        raise bad_request(f"request body is not valid JSON: {errors[0]['msg']}", code="invalid_json")
    parts = [f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}" for e in errors[:3]]
    more = f" (and {len(errors) - 3} more errors)" if len(errors) > 3 else ""
    param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None  # the top-level field
    raise bad_request("; ".join(parts) + more, param=param, code="invalid_type")


def renamed(exc: APIError, names: dict[str, str]) -> APIError:
    """The error as an API that translates to chat names its fields (Responses' max_output_tokens is max_tokens)."""
    name = names.get(exc.param)
    if name is None:
        return exc
    return APIError(exc.status, exc.message.replace(exc.param, name), param=name, code=exc.code)
