"""Kiln's one failure taxonomy.

Every failure is a `KilnError` subclass that carries its HTTP status, its OpenAI error
`type`, a `code` and the offending `param`, so any layer can raise it and the HTTP layer
renders it unchanged as `{"error": {"message", "type", "code", "param"}}`:

| failure                                  | class                           | status |
|------------------------------------------|---------------------------------|--------|
| malformed body, bad parameter            | InvalidRequest and subclasses   | 400    |
| unknown model, adapter, ...              | NotFound and subclasses         | 404    |
| admission refused: profile, capture, ... | AdmissionRejected               | 503    |
| waiting queue full                       | QueueFull                       | 429    |
| one request failed inside the engine     | RequestFailed                   | 500    |
| the accelerator is gone                  | DeviceLost                      | 503    |

Startup failures (`ConfigError`, `ModelLoadError`, `BackendUnavailable`) are KilnErrors too; they end the
process with a message instead of becoming a response.
"""

from __future__ import annotations

from typing import Any, ClassVar


class KilnError(Exception):
    """Base of every Kiln failure."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str | None] = None
    default_param: ClassVar[str | None] = None

    def __init_subclass__(cls, *, status: int | None = None, type: str | None = None,
                          code: str | None = None, param: str | None = None, **kwargs: Any):
        """`class QueueFull(KilnError, status=429, type=..., code=...)`: what a subclass changes, on one line."""
        super().__init_subclass__(**kwargs)
        for attr, value in (("status", status), ("type", type), ("default_code", code), ("default_param", param)):
            if value is not None:
                setattr(cls, attr, value)

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.param = param if param is not None else self.default_param
        self.headers = headers  # sent with the error response (e.g. Retry-After)

    def with_param(self, param: str) -> KilnError:
        """This error naming another parameter (what a request calls it, where layers name it apart)."""
        self.param = param
        return self

    def body(self) -> dict[str, dict[str, Any]]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


# ---- validation: nothing else changes ------------------------------------------------------


class InvalidRequest(KilnError, status=400, type="invalid_request_error"):
    """Malformed body or bad parameter."""


class UnprocessableRequest(KilnError, status=422, type="invalid_request_error"):
    """Well-formed but semantically invalid."""


class TemplateError(InvalidRequest, param="messages"):
    """The chat template cannot render these messages."""


class DataError(InvalidRequest, code="invalid_training_file", param="training_file"):
    """A training or prompt file Kiln cannot train on (the message names the line)."""


class InsufficientMemory(KilnError, status=400, type="invalid_request_error", code="insufficient_memory"):
    """A training job that does not fit beside serving, even with the KV pool shrunk."""


class InvalidAdapter(InvalidRequest, code="invalid_adapter"):
    """An adapter directory or artifact that Kiln cannot read or serve."""


class Unauthorized(KilnError, status=401, type="authentication_error", code="invalid_api_key"):
    """A missing or wrong API key."""


class NotFound(KilnError, status=404, type="not_found_error", code="not_found"):
    """Unknown model, adapter, job, ...; pass a specific code such as "model_not_found"."""


class AdapterNotFound(NotFound, code="adapter_not_found"):
    """No adapter of that name is registered."""


class PayloadTooLarge(KilnError, status=413, type="invalid_request_error", code="payload_too_large"):
    """A body over server.max_request_body_bytes."""


# ---- admission: the request was not started -----------------------------------------------


class QueueFull(KilnError, status=429, type="rate_limit_error", code="queue_full"):
    """The waiting queue is at server.max_waiting_requests."""


class AdmissionRejected(KilnError, status=503, type="service_unavailable"):
    """Admission refused (profile, memory, engine state); the code says why."""


class BackendCannotRun(AdmissionRejected, code="route_unsupported"):
    """The chosen backend route cannot run this request's step correctly."""


class GraphCaptureDisabled(AdmissionRejected, code="graph_capture_disabled"):
    """No compiled step bucket fits the batch and the serving profile forbids compiling one."""


# ---- failures after admission -------------------------------------------------------------


class RequestFailed(KilnError, status=500, type="internal_error"):
    """This request failed (500); other requests go on."""


class DeviceLost(KilnError, status=503, type="service_unavailable", code="device_lost"):
    """The accelerator is gone: every request gets 503 until the process restarts."""


# ---- startup --------------------------------------------------------------------------------


class ConfigError(KilnError, type="configuration_error"):
    """A fatal configuration error; the message names the source and the value."""


class BackendUnavailable(KilnError, type="route_unavailable"):
    """A backend route cannot run here: what is missing and how to get it."""


class ModelLoadError(KilnError, type="model_load_error"):
    """A model cannot be loaded; the message names the file and, where known, the tensor."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file = file
        self.tensor = tensor
        where = [f"file {file}"] * bool(file) + [f"tensor {tensor}"] * bool(tensor)
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
