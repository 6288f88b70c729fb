"""The gateway's errors in OpenAI's shape (status, type, param, code): raised anywhere in the
gateway, answered by the app."""

from __future__ import annotations

from .backend import BackendError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "server_error",
}


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: float = 0.0):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after  # > 0: sent as the Retry-After header (whole seconds)
        self.type = type or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    @classmethod
    def from_backend(cls, e: BackendError) -> "APIError":
        return cls(e.status, e.message, param=e.param, code=e.code, retry_after=e.retry_after)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_param(param: str, message: str, code: str | None = "invalid_parameter") -> APIError:
    return APIError(400, message, param=param, code=code)
