"""The router's types that several of its modules share: a pick's request, result and error (the core
and the gRPC API), what discovery knows of a worker (discovery, the core, the custom resources' pools)
and an InferencePool (the custom resources and the core). They live here so that those modules need
not import one another; of the router, this module imports only selectors (which imports none of it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kiln.router.selectors import Matcher


class PickError(Exception):
    """No pick: `kind` is not_found (no worker set serves the model), unavailable (no eligible worker)
    or invalid (the request is wrong)."""

    def __init__(self, kind: Literal["not_found", "unavailable", "invalid"], message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True, slots=True)
class PickInput:
    """One request to route. The prompt is `token_ids` when given, else `body`'s prompt fields: an
    OpenAI completion's `prompt`, or a chat's `messages` (with `tools`, `chat_template_kwargs`, ...)."""

    model: str
    token_ids: Sequence[int] | None = None
    body: dict[str, Any] | None = None
    tenant: str = ""
    inference_pool: str = ""
    request_id: str = ""  # empty: one is made up


@dataclass(frozen=True, slots=True)
class PickResult:
    request_id: str
    worker_id: str  # worker_id_str
    worker_id_num: int
    endpoint: str  # empty when the worker has none
    workerset: str
    predicted_ms: float
    cached_blocks: int
    prompt_blocks: int
    reason: str  # the picker's (only, best, load, random, replicate) or mock


@dataclass(frozen=True, slots=True)
class WorkerMeta:
    """What discovery knows of a worker beyond its Worker entry: its pod's labels (for pool selectors)
    and its Service's named ports (for a pool's targetPortName)."""

    labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Pool:
    """One InferencePool: which workers it admits, and the port requests go to."""

    key: str  # namespace/name
    worker_sets: frozenset[str] | None
    selector: Matcher | None
    target_port: str = "http"

    def admits(self, workerset: str, meta: WorkerMeta | None) -> bool:
        if self.worker_sets is not None and workerset not in self.worker_sets:
            return False
        return self.selector is None or self.selector(meta.labels if meta is not None else {})


class Pools(Protocol):
    """The InferencePools a pick looks a pool up in (resources.PoolWatcher)."""

    def lookup(self, name: str) -> Pool:
        """The pool `name` (or `namespace/name`); KeyError when there is none, ValueError when ambiguous."""
        ...
