"""The router's configuration: one TOML file (`kiln router --config router.toml`) and, for each
statically discovered worker set, a workers file holding a flat `[[workers]]` list.

Pydantic checks shapes and types, strictly: a string is never read as a number and a boolean
never as an integer, though an integer is accepted where a float is expected. Rules that span
keys, sections or files run after it (`_check`, `_attach_workers`). Every failure is a
RouterConfigError naming the file, the dotted key (`workerset[1].kv_block_size`) and the value.

Unknown keys inside a section and in a workers file are ignored (logged at debug); an unknown
top-level key is an error, since a misspelt section would otherwise silently keep its defaults.

This module imports nothing from the serving side of Kiln: the router loads no model.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kiln.router.selectors import parse_selector
from kiln.toml_file import TomlFileError, read_toml

log = logging.getLogger("kiln.router")

# Where a pod finds its service account token (with KUBERNETES_SERVICE_HOST: running in a cluster).
SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


class RouterConfigError(Exception):
    """The router's configuration is invalid; fatal at startup. The message names file, key and value."""


# ---- field types -----------------------------------------------------------------------------

T = TypeVar("T")


def _array(value: Any) -> Any:
    # TOML arrays arrive as lists; the model keeps tuples so that a loaded config is immutable.
    return tuple(value) if isinstance(value, list) else value


Array = Annotated[tuple[T, ...], BeforeValidator(_array)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
Positive = Annotated[int, Field(gt=0)]


def _config_path(value: Any, info: ValidationInfo) -> Any:
    """A path key: relative paths are taken from the config file's directory."""
    if not isinstance(value, str):
        return value  # a Path passes; anything else fails the strict Path check
    if not value:
        raise ValueError("must be a non-empty path")
    base = (info.context or {}).get("base_dir")
    path = Path(value)
    return base / path if base is not None and not path.is_absolute() else path


ConfigPath = Annotated[Path, BeforeValidator(_config_path)]


def endpoint_from_url(url: str) -> str:
    """`host:port` of an http(s) URL, the scheme's default port when it names none.

    http://10.0.0.5:8000/ -> 10.0.0.5:8000; https://w0.example -> w0.example:443; IPv6 keeps brackets.
    """
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise ValueError(f"cannot derive endpoint from http_url = {json.dumps(url)}; expected http(s)://host[:port]")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    return f"{host}:{port}"


# ---- sections ----------------------------------------------------------------------------------


class Section(BaseModel):
    """A table of the file: typed, strict, immutable; unknown keys are ignored."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore", protected_namespaces=())
    section: ClassVar[str] = ""  # as written in the file, for the debug log of ignored keys

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data: Any) -> Any:
        # (RouterConfig forbids unknown keys instead)
        if isinstance(data, dict) and cls.model_config.get("extra") == "ignore":
            if unknown := sorted(set(data) - set(cls.model_fields)):
                log.debug("ignoring unknown key(s) %s in [%s]", ", ".join(unknown), cls.section)
        return data


def _http_is_render(value: Any) -> Any:
    return "render" if value == "http" else value  # `http`: an accepted alias


class ProfileTokenize(Section):
    section = "profile.tokenize"
    # render: the worker's /render; local: the in-process tokenizer; compare: local, checked against /render
    mode: Annotated[Literal["render", "local", "compare"], BeforeValidator(_http_is_render)] = "render"


class Predictor(Section):
    section = "profile.predictor"
    base_ms: float = 400.0
    forward_pass_ms: float = 0.0
    queue_ms_per_entry: float = 1000.0
    attention_uncached_block_ms: float = 2.3
    attention_uncached_per_every_block_ms: float = 0.009
    cache_pressure_penalty_ms: float = 0.0
    cache_pressure_saturated_threshold: float = 0.9
    saturated_cold_ms_per_entry: float = 10000.0
    q_running_penalty_peak_ms: float = 700.0
    q_running_penalty_peak_qr: int = 2
    q_running_penalty_falloff_qr: int = 5
    inflight_concurrent_capacity: int = 5
    expected_overlap_alpha: float = 1.0
    # Kiln's: what a worker that lists the request's adapter but has not loaded it pays to load it
    adapter_load_ms: float = 1000.0


class Picker(Section):
    section = "profile.picker"
    top_k_min: int = 2
    top_k_fraction: float = 0.2
    tie_tolerance_ms: float = 50.0
    inflight_tracking: bool = True
    replication_threshold_pct: float = 0.0  # 0 disables replication
    replication_warm_target: int = 2
    replication_warm_threshold_fraction: float = 0.5


class Profile(Section):
    """One [[profile]]: how latency is predicted, workers picked and prompts tokenized."""

    section = "profile"
    name: NonEmptyStr
    tokenize: ProfileTokenize = Field(default_factory=ProfileTokenize)
    predictor: Predictor = Field(default_factory=Predictor)
    picker: Picker = Field(default_factory=Picker)


class DiscoveryDefaults(Section):
    """Ports used when discovery finds no named port."""

    section = "workerset.discovery.defaults"
    http_port: int = 8000
    zmq_port: int = 5557
    replay_port: int | None = None


class Discovery(Section):
    section = "workerset.discovery"
    mode: Literal["static", "kubernetes"] = "static"
    workers_file: ConfigPath | None = None  # required for static
    service_name: str | None = None  # required for kubernetes
    namespace: str | None = None  # None: inherited (the router's own namespace)
    defaults: DiscoveryDefaults = Field(default_factory=DiscoveryDefaults)


class Worker(Section):
    """One entry of a workers file's [[workers]] list."""

    section = "workers"
    worker_id_str: NonEmptyStr
    worker_id_num: int
    model_name: str
    zmq_endpoint: str | None = None  # required unless mock_mode (checked with the whole config)
    replay_endpoint: str | None = None
    metrics_url: str | None = None
    http_url: str | None = None
    endpoint: str | None = Field(default=None, validate_default=True)  # derived from http_url when unset
    # topology labels
    pod_name: str | None = None
    namespace: str | None = None
    node_name: str | None = None
    node_ip: str | None = None
    pod_ip: str | None = None
    availability_zone: str | None = None
    instance_type: str | None = None

    @field_validator("endpoint")
    @classmethod
    def _derive_endpoint(cls, value: str | None, info: ValidationInfo) -> str | None:
        url = info.data.get("http_url")
        return endpoint_from_url(url) if value is None and url is not None else value


class WorkersFile(Section):
    section = "workers file"
    workers: Array[Worker] = ()


class WorkerSet(Section):
    """One [[workerset]]: workers sharing a model, an engine and a KV block size."""

    section = "workerset"
    name: NonEmptyStr
    profile: str
    kv_block_size: Positive
    render_url: str | None = None
    discovery: Discovery = Field(default_factory=Discovery)
    # Filled from discovery.workers_file after validation (never read from [[workerset]] itself);
    # empty for kubernetes discovery, whose workers are found at run time.
    workers: tuple[Worker, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _workers_come_from_the_file(cls, data: Any) -> Any:
        if isinstance(data, dict) and "workers" in data:
            log.debug("ignoring key workers in [workerset]: workers come from discovery.workers_file")
            return {k: v for k, v in data.items() if k != "workers"}
        return data


class TokenizeLocal(Section):
    section = "tokenize.local"
    mount_dir: ConfigPath | None = None  # {mount_dir}/{model}/tokenizer.json; local and compare modes need it
    warmup: bool = True


class Tokenize(Section):
    section = "tokenize"
    pool_max_idle_per_host: int | None = None
    local: TokenizeLocal = Field(default_factory=TokenizeLocal)


class Metrics(Section):
    section = "metrics"
    tenant_labels: Literal["none", "all"] | tuple[str, ...] = "none"

    @field_validator("tenant_labels", mode="before")
    @classmethod
    def _tenant_labels(cls, value: Any) -> Any:
        # checked here, whole, so that a bad value reads as one error rather than one per union member
        if isinstance(value, str) and value in ("none", "all"):
            return value
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ValueError('expected "none", "all" or a list of strings')


class Policy(Section):
    section = "policy"
    enabled: bool = False
    namespace: str | None = None  # None: all namespaces


class Kubernetes(Section):
    section = "kubernetes"
    enabled: bool = False
    namespace: str | None = None  # None: all namespaces
    selector: str | None = None
    discovery_defaults: DiscoveryDefaults = Field(default_factory=DiscoveryDefaults)

    @field_validator("selector")
    @classmethod
    def _selector_reads(cls, value: str | None) -> str | None:
        if value is not None:
            parse_selector(value)  # raises ValueError, which names the term it cannot read
        return value


class TokenReview(Section):
    section = "token_review"
    enabled: bool = False
    default_deadline_ms: int = 2000
    positive_ttl_secs: int = 60
    negative_ttl_secs: int = 10
    max_cache_entries: int = 4096


class RateLimit(Section):
    section = "rate_limit"
    enabled: bool = False


class LeaderElection(Section):
    section = "leader_election"
    enabled: bool = False
    lease_name: NonEmptyStr = "bllmp"
    namespace: str | None = None  # None: inherited (the router's own namespace)
    lease_duration_secs: Positive = 15
    renew_grace_secs: Positive = 10
    retry_secs: Positive = 2

    @field_validator("renew_grace_secs")
    @classmethod
    def _renew_within_lease(cls, value: int, info: ValidationInfo) -> int:
        duration = info.data.get("lease_duration_secs")  # absent when it was invalid itself
        if duration is not None and value >= duration:
            raise ValueError(f"must be less than lease_duration_secs ({duration})")
        return value


class RolloutSettings(Section):
    """Kiln's [rollout]: fleet-wide adapter promotion (rollout.py)."""

    section = "rollout"
    state_file: ConfigPath | None = None  # None: rollouts are kept in memory only
    bake_secs: Annotated[float, Field(ge=0)] = 30.0  # a stage's time under traffic before its check
    max_error_rate: Annotated[float, Field(ge=0, le=1)] = 0.05
    drain_secs: Annotated[float, Field(ge=0)] = 2.0  # off the adapter's picks before an unload


class RouterConfig(Section):
    """The whole resolved configuration. Field names are the file's keys."""

    model_config = ConfigDict(extra="forbid")  # merged with Section's: strict and frozen

    listen: str  # gRPC bind address
    admin_listen: str | None = None  # HTTP: dashboard, /metrics, /readyz; None disables all three
    mock_mode: bool = False

    dashboard_max_workers: int = 16
    metrics_poll_ms: int = 1000
    models_refresh_secs: int = 30
    replay_timeout_ms: int = 60000
    observation_ttl_secs: int = 600
    body_max_total_kb: int = 262144
    body_max_request_kb: int = 8192
    body_ttl_secs: int = 60
    body_idle_timeout_secs: int = 30

    profile: Array[Profile] = ()
    workerset: Array[WorkerSet] = ()
    tokenize: Tokenize = Field(default_factory=Tokenize)
    metrics: Metrics = Field(default_factory=Metrics)
    policy: Policy = Field(default_factory=Policy)
    kubernetes: Kubernetes = Field(default_factory=Kubernetes)
    token_review: TokenReview = Field(default_factory=TokenReview)
    rate_limit: RateLimit = Field(default_factory=RateLimit)
    leader_election: LeaderElection = Field(default_factory=LeaderElection)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)

    def profile_named(self, name: str) -> Profile:
        for profile in self.profile:
            if profile.name == name:
                return profile
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        """Every key with its resolved value (defaults filled, paths absolute, workers under their set)."""
        return self.model_dump(mode="json")


# ---- loading ------------------------------------------------------------------------------------


def load_router_config(path: str | os.PathLike[str]) -> RouterConfig:
    """Read, validate and resolve the router configuration; raises RouterConfigError."""
    path = Path(path)
    raw = _read_toml(path)
    try:
        config = RouterConfig.model_validate(raw, context={"base_dir": path.absolute().parent})
    except ValidationError as e:
        raise RouterConfigError(_describe(path, e, RouterConfig)) from None
    _check(config, path)
    config = _attach_workers(config, path)
    if config.rate_limit.enabled:
        log.warning("[rate_limit] enabled: the rate limiter admits every reservation and tracks no budget")
    return config


def kubernetes_credentials_available(env: Mapping[str, str] | None = None) -> bool:
    """In a cluster (service host set and a service account token), or a kubeconfig file exists."""
    env = os.environ if env is None else env
    if env.get("KUBERNETES_SERVICE_HOST") and SERVICE_ACCOUNT_TOKEN.is_file():
        return True
    if env.get("KUBECONFIG"):
        return any(Path(p).expanduser().is_file() for p in env["KUBECONFIG"].split(os.pathsep) if p)
    home = env.get("HOME")
    return home is not None and (Path(home) / ".kube" / "config").is_file()


def _read_toml(path: Path, named_by: str = "") -> dict[str, Any]:
    """The parsed file; named_by is `config: key` when another file names this one."""
    try:
        return read_toml(path, f"{named_by} = {_show(path)}: file" if named_by else "config file")
    except TomlFileError as e:
        raise RouterConfigError(str(e)) from None


def _fail(path: Path, key: str, value: Any, reason: str) -> RouterConfigError:
    return RouterConfigError(f"{path}: {key} = {_show(value)}: {reason}")


def _check(config: RouterConfig, path: Path) -> None:
    """Rules that span keys or sections."""
    for what, items in (("profile", config.profile), ("workerset", config.workerset)):
        first: dict[str, int] = {}
        for i, item in enumerate(items):
            if item.name in first:
                raise _fail(path, f"{what}[{i}].name", item.name, f"duplicate name (also {what}[{first[item.name]}])")
            first[item.name] = i
    profiles = [p.name for p in config.profile]
    for i, ws in enumerate(config.workerset):
        if ws.profile not in profiles:
            defined = ", ".join(profiles) or "none"
            raise _fail(
                path, f"workerset[{i}].profile", ws.profile, f"no [[profile]] has this name (defined: {defined})"
            )
        d = ws.discovery
        if d.mode == "static" and d.workers_file is None:
            raise RouterConfigError(f"{path}: workerset[{i}].discovery.workers_file: required when mode is static")
        if d.mode == "kubernetes" and d.service_name is None:
            raise RouterConfigError(f"{path}: workerset[{i}].discovery.service_name: required when mode is kubernetes")
    if config.kubernetes.enabled and not config.profile:
        raise _fail(
            path, "kubernetes.enabled", True, "needs at least one [[profile]] (every InferenceWorkerSet names one)"
        )
    if not config.workerset and not config.kubernetes.enabled:
        raise RouterConfigError(
            f"{path}: workerset: at least one [[workerset]] is required unless [kubernetes] enabled = true"
        )
    if config.token_review.enabled and not kubernetes_credentials_available():
        raise _fail(
            path,
            "token_review.enabled",
            True,
            "no Kubernetes credentials: not in a cluster (KUBERNETES_SERVICE_HOST and a service account token) "
            "and no kubeconfig (KUBECONFIG or ~/.kube/config)",
        )


def _attach_workers(config: RouterConfig, path: Path) -> RouterConfig:
    """Read each static worker set's workers file; ids must be unique across every set."""
    seen_num: dict[int, tuple[str, str]] = {}
    seen_str: dict[str, str] = {}
    sets = []
    for i, ws in enumerate(config.workerset):
        if ws.discovery.mode != "static":
            sets.append(ws)
            continue
        file = ws.discovery.workers_file
        raw = _read_toml(file, f"{path}: workerset[{i}].discovery.workers_file")
        try:
            workers = WorkersFile.model_validate(raw).workers
        except ValidationError as e:
            raise RouterConfigError(_describe(file, e, WorkersFile)) from None
        for j, w in enumerate(workers):
            if w.zmq_endpoint is None and not config.mock_mode:
                raise RouterConfigError(f"{file}: workers[{j}].zmq_endpoint: required unless mock_mode = true")
            if w.worker_id_num in seen_num:
                other, other_set = seen_num[w.worker_id_num]
                reason = f"duplicate; worker {json.dumps(other)} of worker set {json.dumps(other_set)} has it"
                raise _fail(file, f"workers[{j}].worker_id_num", w.worker_id_num, reason)
            if w.worker_id_str in seen_str:
                reason = f"duplicate; a worker of worker set {json.dumps(seen_str[w.worker_id_str])} has it"
                raise _fail(file, f"workers[{j}].worker_id_str", w.worker_id_str, reason)
            seen_num[w.worker_id_num] = (w.worker_id_str, ws.name)
            seen_str[w.worker_id_str] = ws.name
        sets.append(ws.model_copy(update={"workers": workers}))
    return config.model_copy(update={"workerset": tuple(sets)})


# ---- pydantic errors -> messages ----------------------------------------------------------------

_ARRAYS_OF_TABLES = {("profile",), ("workerset",), ("workers",)}


def _describe(path: Path, error: ValidationError, model: type[BaseModel]) -> str:
    """One line per problem: `file: key.path = value: reason`."""
    lines = []
    for e in error.errors(include_url=False):
        loc = e["loc"]
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        if e["type"] == "extra_forbidden" and len(loc) == 1:
            accepted = ", ".join(model.model_fields)
            lines.append(f"{path}: unknown top-level key {loc[0]!r}; accepted keys: {accepted}")
        elif e["type"] == "missing":
            lines.append(f"{path}: {key}: required")
        elif e["input"] is None:  # a default that failed a check, e.g. an endpoint that cannot be derived
            lines.append(f"{path}: {key}: {_reason(e, loc)}")
        else:
            lines.append(f"{path}: {key} = {_show(e['input'])}: {_reason(e, loc)}")
    return "\n".join(lines)


def _reason(e: Any, loc: tuple[Any, ...]) -> str:
    ctx = e.get("ctx") or {}
    match e["type"]:
        case "int_type":
            return "expected an integer"
        case "float_type":
            return "expected a number"
        case "bool_type":
            return "expected a boolean (true or false)"
        case "string_type":
            return "expected a string"
        case "is_instance_of" | "path_type":
            return "expected a path (a string)"
        case "model_type" | "dict_type":
            return "expected a table"
        case "tuple_type" if loc in _ARRAYS_OF_TABLES:
            return f"expected an array of tables ([[{loc[0]}]])"
        case "tuple_type":
            return "expected an array"
        case "string_too_short":
            return "must be non-empty"
        case "greater_than":
            return f"must be > {ctx['gt']}"
        case "literal_error":
            alias = " (or http, an alias of render)" if loc[-2:] == ("tokenize", "mode") else ""
            return f"expected one of {ctx['expected']}{alias}"
        case "value_error":
            return str(ctx["error"])
    return e["msg"]


def _show(value: Any) -> str:
    """A value as TOML would spell it, near enough: strings quoted, booleans lower case."""
    if isinstance(value, Path):
        value = str(value)
    return json.dumps(value, default=str)
