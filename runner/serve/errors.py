"""ApiError: a request the server refuses, whatever API it came by, as an HTTP status and OpenAI's
error object (Anthropic's and ollama's are written from it: app.py's ERROR_SHAPES)."""
from __future__ import annotations

from nibble.formats.errors import NibbleError


class ApiError(NibbleError):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code

    def body(self) -> dict:
        return error_body(str(self), self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
