"""Failure taxonomy: each failure maps to an HTTP status and an OpenAI-style error body.

    {"error": {"message": ..., "type": ..., "code": ..., "param": ...}}

See DESIGN.md, "Failure boundaries": validation 400/422, admission 503/429 with a code,
request failure 500 for that request only, device loss 503 everywhere.
"""

from __future__ import annotations

from typing import Any, ClassVar


class ConfigError(Exception):
    """A fatal startup configuration error; the message names the source and the value.

    Not an HTTP error: configuration is resolved before the server accepts requests.
    """


class KilnError(Exception):
    """Base of every error that becomes an HTTP response."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str | None] = None

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.param = param

    def body(self) -> dict[str, dict[str, Any]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.code,
                "param": self.param,
            }
        }


class InvalidRequest(KilnError):
    """Malformed body or bad parameter; nothing else changes."""

    status = 400
    type = "invalid_request_error"


class UnprocessableRequest(KilnError):
    """Well-formed but semantically invalid (e.g. prompt longer than the model's context)."""

    status = 422
    type = "invalid_request_error"


class Unauthorized(KilnError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class NotFound(KilnError):
    """Unknown model, adapter, job, ...; pass a specific code such as "model_not_found"."""

    status = 404
    type = "not_found_error"
    default_code = "not_found"


class PayloadTooLarge(KilnError):
    status = 413
    type = "invalid_request_error"
    default_code = "payload_too_large"


class QueueFull(KilnError):
    """The waiting queue is at server.max_waiting_requests; the request was not started."""

    status = 429
    type = "rate_limit_error"
    default_code = "queue_full"


class AdmissionRejected(KilnError):
    """Admission refused (profile, memory); the code says why, e.g. "inference_disabled_by_profile"."""

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str, code: str, *, param: str | None = None):
        super().__init__(message, code=code, param=param)


class RequestFailed(KilnError):
    """This request failed (500); other requests go on."""

    status = 500
    type = "internal_error"


class DeviceLost(KilnError):
    """The accelerator is gone: every request gets 503 until the process restarts."""

    status = 503
    type = "service_unavailable"
    default_code = "device_lost"
