from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class PickRequest(_message.Message):
    __slots__ = ("model", "prompt", "messages", "token_ids", "inference_pool", "tenant", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_POOL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    inference_pool: str
    tenant: str
    request_id: str
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., inference_pool: _Optional[str] = ..., tenant: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class PickResponse(_message.Message):
    __slots__ = ("worker_id", "endpoint", "workerset", "predicted_ms", "cached_blocks", "request_id", "prompt_blocks", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WORKERSET_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    workerset: str
    predicted_ms: float
    cached_blocks: int
    request_id: str
    prompt_blocks: int
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., workerset: _Optional[str] = ..., predicted_ms: _Optional[float] = ..., cached_blocks: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt_blocks: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class BodyChunk(_message.Message):
    __slots__ = ("request_id", "data", "last", "tenant", "inference_pool")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_POOL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    data: bytes
    last: bool
    tenant: str
    inference_pool: str
    def __init__(self, request_id: _Optional[str] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., tenant: _Optional[str] = ..., inference_pool: _Optional[str] = ...) -> None: ...

class FeedbackRequest(_message.Message):
    __slots__ = ("request_id", "ttft_ms", "e2e_ms", "failed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ttft_ms: float
    e2e_ms: float
    failed: bool
    def __init__(self, request_id: _Optional[str] = ..., ttft_ms: _Optional[float] = ..., e2e_ms: _Optional[float] = ..., failed: _Optional[bool] = ...) -> None: ...

class FeedbackResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("tenant", "model", "request_id", "tokens")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model: str
    request_id: str
    tokens: int
    def __init__(self, tenant: _Optional[str] = ..., model: _Optional[str] = ..., request_id: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("admitted", "retry_after_ms")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    admitted: bool
    retry_after_ms: int
    def __init__(self, admitted: _Optional[bool] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class TokenReviewRequest(_message.Message):
    __slots__ = ("token", "audiences")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    AUDIENCES_FIELD_NUMBER: _ClassVar[int]
    token: str
    audiences: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token: _Optional[str] = ..., audiences: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenReviewResponse(_message.Message):
    __slots__ = ("authenticated", "username", "uid", "groups", "error")
    AUTHENTICATED_FIELD_NUMBER: _ClassVar[int]
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    authenticated: bool
    username: str
    uid: str
    groups: _containers.RepeatedScalarFieldContainer[str]
    error: str
    def __init__(self, authenticated: _Optional[bool] = ..., username: _Optional[str] = ..., uid: _Optional[str] = ..., groups: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ...) -> None: ...
