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


class InvalidRequest(KilnError):
    """Malformed body or bad parameter."""

    status = 400
    type = "invalid_request_error"


class UnprocessableRequest(KilnError):
    """Well-formed but semantically invalid."""

    status = 422
    type = "invalid_request_error"


class TemplateError(InvalidRequest):
    """The chat template cannot render these messages."""

    default_param = "messages"


class DataError(InvalidRequest):
    """A training or prompt file Kiln cannot train on (the message names the line)."""

    default_code = "invalid_training_file"
    default_param = "training_file"


class InsufficientMemory(KilnError):
    """A training job that does not fit beside serving, even with the KV pool shrunk."""

    status = 400
    type = "invalid_request_error"
    default_code = "insufficient_memory"


class InvalidAdapter(InvalidRequest):
    """An adapter directory or artifact that Kiln cannot read or serve."""

    default_code = "invalid_adapter"


class Unauthorized(KilnError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class NotFound(KilnError):
    """Unknown model, adapter, job, ...; pass a specific code such as "model_not_found"."""

    status = 404
    type = "not_found_error"
    default_code = "not_found"


class AdapterNotFound(NotFound):
    default_code = "adapter_not_found"


class PayloadTooLarge(KilnError):
    status = 413
    type = "invalid_request_error"
    default_code = "payload_too_large"


# ---- admission: the request was not started -----------------------------------------------


class QueueFull(KilnError):
    """The waiting queue is at server.max_waiting_requests."""

    status = 429
    type = "rate_limit_error"
    default_code = "queue_full"


class AdmissionRejected(KilnError):
    """Admission refused (profile, memory, engine state); the code says why."""

    status = 503
    type = "service_unavailable"


class BackendCannotRun(AdmissionRejected):
    """The chosen backend route cannot run this request's step correctly."""

    default_code = "route_unsupported"


class GraphCaptureDisabled(AdmissionRejected):
    """No compiled step bucket fits the batch and the serving profile forbids compiling one."""

    default_code = "graph_capture_disabled"


# ---- failures after admission -------------------------------------------------------------


class RequestFailed(KilnError):
    """This request failed (500); other requests go on."""

    status = 500
    type = "internal_error"


class DeviceLost(KilnError):
    """The accelerator is gone: every request gets 503 until the process restarts."""

    status = 503
    type = "service_unavailable"
    default_code = "device_lost"


# ---- startup --------------------------------------------------------------------------------


class ConfigError(KilnError):
    """A fatal configuration error; the message names the source and the value."""

    type = "configuration_error"


class BackendUnavailable(KilnError):
    """A backend route cannot run here: what is missing and how to get it."""

    type = "route_unavailable"


class ModelLoadError(KilnError):
    """A model cannot be loaded; the message names the file and, where known, the tensor."""

    type = "model_load_error"

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file = file
        self.tensor = tensor
        where = [f"file {file}"] * bool(file) + [f"tensor {tensor}"] * bool(tensor)
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
