"""Errors as OpenAI error bodies, {"error": {"message", "type", "param", "code"}}, and on the Anthropic
routes as Anthropic's, {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

import re
from typing import Any

# The OpenAI "type" for each status mk answers with.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    502: "model_output_error",
    503: "server_overloaded",
}

# Anthropic's error type for each status mk answers with (any other 4xx is an invalid request, 5xx an
# API error), and the status Anthropic gives an overloaded server instead of 503.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_OVERLOADED = 529


class APIError(Exception):
    """An error answered to the client; `param` names the offending request field when there is one."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        type: str | None = None,  # noqa: A002 - the OpenAI field name
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.type = type or _TYPES.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def anthropic(self) -> tuple[int, dict[str, Any]]:
        """The status and body of this error on an Anthropic route: the offending field leads the
        message (Anthropic's bodies have no field of their own for it), as in "max_tokens: ..."."""
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        message, field = self.message, re.split(r"[.\[]", self.param or "", maxsplit=1)[0]
        if field and not message.startswith(field):
            message = f"{self.param}: {message}"
        status = ANTHROPIC_OVERLOADED if kind == "overloaded_error" else self.status
        return status, anthropic_error_body(message, kind)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:  # noqa: A002
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def anthropic_error_body(message: str, type: str) -> dict[str, Any]:  # noqa: A002
    return {"type": "error", "error": {"type": type, "message": message}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
