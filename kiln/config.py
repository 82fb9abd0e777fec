"""Settings: defaults <- TOML file (--config) <- KILN_<SECTION>_<KEY> <- command line.

Every resolved value keeps its source ("default", "config_file", "environment",
"command_line"). Any invalid value is fatal: ConfigError names the source and the value.
Adding a key is one line in SCHEMA.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from kiln.errors import ConfigError  # callers may import it from here too
from kiln.profiles import ResolvedProfile, ServingProfile
from kiln.toml_file import TomlFileError, read_toml

log = logging.getLogger("kiln.config")

Kind = Literal["str", "int", "float", "bool", "list[str]", "list[int]", "int|auto"]
# A check takes the typed value and returns it (possibly normalized) or raises ValueError(reason).
Check = Callable[[Any], Any]


def _rule(ok: Callable[[Any], bool], reason: str) -> Check:
    def check(value: Any) -> Any:
        if not ok(value):
            raise ValueError(reason)
        return value

    return check


def one_of(*choices: str) -> Check:
    def check(value: str) -> str:
        if (norm := value.strip().lower()) not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return norm

    return check


def at_least(lo: int) -> Check:
    return _rule(lambda v: v >= lo, f"expected an integer >= {lo}")


def between(lo: int, hi: int) -> Check:
    return _rule(lambda v: lo <= v <= hi, f"expected an integer from {lo} to {hi}")


def count_or_auto(value: int | str) -> int | str:
    if value != "auto" and value < 1:
        raise ValueError("expected auto or an integer >= 1")
    return value


def index_or_auto(value: int | str) -> int | str:
    if value != "auto" and value < 0:
        raise ValueError("expected auto or an integer >= 0")
    return value


def power_of_two(lo: int, hi: int) -> Check:
    return _rule(lambda v: lo <= v <= hi and v & (v - 1) == 0, f"expected a power of two from {lo} to {hi}")


def positive(value: float) -> float:
    if not value > 0:
        raise ValueError("expected a number > 0")
    return value


def fraction(value: float) -> float:
    if not 0 <= value < 1:
        raise ValueError("expected a number from 0 up to (not including) 1")
    return value


def non_negative(value: float) -> float:
    if not value >= 0:
        raise ValueError("expected a number >= 0")
    return value


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def memory_amount(value: str) -> str:
    """auto, a fraction in (0, 1], or bytes with an optional unit; normalized to "auto", "0.5" or a byte count."""
    text = value.strip().lower().replace(" ", "")
    if text == "auto":
        return text
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)([a-z]*)", text)
    if not match or match[2] not in _UNITS:
        raise ValueError("expected auto, a fraction such as 0.9, or bytes such as 8GiB or 536870912")
    number, unit = float(match[1]), match[2]
    if not unit and "." in match[1]:
        if not 0 < number <= 1:
            raise ValueError("a fraction of free memory is a number above 0 and at most 1")
        return repr(number)
    if number * _UNITS[unit] < 1:
        raise ValueError("expected at least one byte")
    return str(int(number * _UNITS[unit]))


def lora_modules(value: list[str]) -> list[str]:
    known = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts_gate_up",
             "experts_down")
    if not value or any(m not in known for m in value) or len(set(value)) != len(value):
        raise ValueError(f"expected distinct module names among {', '.join(known)}")
    return value


non_empty = _rule(lambda v: bool(v.strip()), "expected a non-empty string")
ascending_buckets = _rule(
    lambda v: bool(v) and v[0] > 0 and all(a < b for a, b in zip(v, v[1:], strict=False)),
    "expected a non-empty, strictly ascending list of positive integers",
)


def serving_profile(value: str) -> str:
    return ServingProfile.normalize(value).value


@dataclass(frozen=True)
class Key:
    section: str
    name: str
    kind: Kind
    default: Any
    check: Check | None
    help: str
    secret: bool = False  # redacted in to_json() and `kiln config`

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env(self) -> str:
        return f"KILN_{self.section}_{self.name}".upper()


# fmt: off
SCHEMA: tuple[Key, ...] = (
    Key("server", "host", "str", "127.0.0.1", non_empty, "address the HTTP server binds"),
    Key("server", "port", "int", 8000, between(1, 65535), "HTTP port"),
    Key("server", "serving_profile", "str", "stable", serving_profile,
        "stable | experimental | maintenance; immutable after startup"),
    Key("server", "api_keys", "list[str]", [], None, "accepted bearer keys; empty = no authentication", secret=True),
    Key("server", "max_request_body_bytes", "int", 8388608, at_least(1), "larger request bodies get 413"),
    Key("server", "max_waiting_requests", "int", 256, at_least(1), "queued requests beyond this get 429 queue_full"),
    Key("server", "log_level", "str", "info", one_of("debug", "info", "warning", "error"), "log level"),
    Key("server", "tool_call_parser", "str", "auto", one_of("auto", "hermes", "llama3_json", "mistral"),
        "format of tool calls in model output (tool_choice auto); auto = from the chat template"),
    Key("server", "reasoning_parser", "str", "auto", one_of("auto", "think", "none"),
        "split <think> reasoning into reasoning_content; auto = when the chat template thinks"),
    Key("server", "drain_timeout_s", "float", 30.0, non_negative,
        "on SIGTERM, how long running requests may finish before they are ended"),
    Key("server", "grammar_compile_timeout_s", "float", 10.0, positive,
        "a structured-output grammar that takes longer to compile gets 400"),
    Key("server", "mcp_commands", "list[str]", [], None,
        "MCP servers an agent run may start on stdio: command lines a request's mcp tool `command` must equal; "
        "empty = none"),
    Key("model", "path", "str", "", None, "HF directory or GGUF file; empty = the embedded default model"),
    Key("model", "dtype", "str", "auto", one_of("auto", "float32", "bfloat16", "float16"),
        "parameter and KV dtype; auto = bfloat16 on accelerators, float32 on CPU"),
    Key("model", "quantization", "str", "auto", one_of("auto", "none", "int8", "int4"),
        "layers' linear weights: none = the model's dtype; int8 or int4 = weight-only, in groups of 32 inputs; "
        "auto = a GGUF file's own format (Q8_0: int8, Q4_0/Q4_1: int4) off IREE routes, else none"),
    Key("model", "served_model_name", "str", "", None, "model id in the API; empty = the model's id"),
    Key("engine", "block_size", "int", 16, power_of_two(8, 256), "tokens per KV block"),
    Key("engine", "num_kv_blocks", "int", 0, at_least(0), "KV blocks in the pool; 0 = sized by kv_cache_memory"),
    Key("engine", "kv_cache_memory", "str", "auto", memory_amount,
        "KV pool budget: bytes (\"8GiB\"), a fraction (\"0.5\") of the memory free after the weights, or auto "
        "(0.9 of it on accelerators; on the CPU at most 2 GiB, taken as blocks are written)"),
    Key("engine", "kv_cache_dtype", "str", "auto", one_of("auto", "bfloat16"),
        "the KV pool's values: auto = the model's dtype; bfloat16 = half a float32 model's KV bytes (keys and "
        "values rounded to bfloat16, attention still computed in float32)"),
    Key("engine", "max_num_seqs", "int", 32, at_least(1), "most running sequences per step"),
    Key("engine", "max_num_batched_tokens", "int", 512, at_least(1), "token budget per step"),
    Key("engine", "max_model_len", "int", 0, at_least(0), "context limit; 0 = derive from the model"),
    Key("engine", "enable_prefix_caching", "bool", True, None, "reuse KV blocks of shared prefixes"),
    Key("engine", "async_scheduling", "str", "auto", one_of("auto", "on", "off"),
        "plan and lay out each step while the previous one runs; auto = when the host's work is worth hiding"),
    Key("engine", "decode_row_buckets", "list[int]", [1, 2, 4, 8, 16, 32], ascending_buckets,
        "rows of the compiled decode steps (max_num_seqs is always one)"),
    Key("engine", "prefill_token_buckets", "list[int]", [32, 64, 128, 256, 512], ascending_buckets,
        "flattened tokens of the compiled prefill steps (max_num_batched_tokens is always one)"),
    Key("engine", "kv_events_endpoint", "str", "", None,
        "ZMQ PUB endpoint for KV events, e.g. tcp://*:5557; empty = off"),
    Key("engine", "kv_events_replay_endpoint", "str", "", None, "ZMQ ROUTER endpoint for KV event replay; empty = off"),
    Key("engine", "kv_events_encoding", "str", "array", one_of("array", "map"),
        "KV event layout: array (vLLM's positional) or map (field names)"),
    Key("engine", "seed", "int", 0, None, "base seed for sampling"),
    Key("engine", "tensor_parallel", "int|auto", 1, count_or_auto,
        "devices the model is split over (a tp mesh axis: attention by heads, the MLP by its width, the KV "
        "pool by KV heads); auto = every local device"),
    Key("engine", "attention", "str", "auto", one_of("auto", "xla", "pallas", "cpu"),
        "paged attention: pallas (a ragged kernel, each row reading only its own blocks), cpu (Kiln's CPU "
        "kernel for decode tiles, the same reads), xla (gathers of blocks up to the step's longest context); "
        "auto = pallas on CUDA GPUs of compute capability 8.0+ for a model whose head size and block_size are "
        "powers of two (16 or more), cpu on a CPU where Kiln's CPU kernels are built"),
    Key("engine", "cpu_kernels", "str", "auto", one_of("auto", "off"),
        "Kiln's CPU kernels for a step: attention over few-query tiles and quantized products (int4 layers, "
        "int8 head; more than four rows only with AVX-512), built with the system's C++ compiler at the first "
        "start; auto = used where they build, off = XLA's paths only"),
    Key("adapters", "max_loras", "int", 4, at_least(1), "adapter slots loaded at once"),
    Key("adapters", "max_lora_rank", "int", 16, at_least(1), "largest LoRA rank a slot holds"),
    Key("adapters", "lora_experts", "bool", False, None,
        "slots also hold LoRA on a mixture's experts (per slot: layers x experts x rank x (hidden + 3 x width))"),
    Key("adapters", "store", "str", "", None, "adapter store (path or orbax URL); empty = <cache dir>/adapters"),
    Key("adapters", "load", "list[str]", [], None,
        "adapters loaded at startup: \"name\" (from the store) or \"name=path\""),
    Key("train", "lora_rank", "int", 16, at_least(1), "LoRA rank of a new adapter"),
    Key("train", "lora_alpha", "float", 32.0, positive, "LoRA alpha (the update is scaled by alpha / rank)"),
    Key("train", "target_modules", "list[str]", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
        "down_proj"], lora_modules, "projections a new adapter adapts"),
    Key("train", "learning_rate", "float", 2e-4, positive, "peak learning rate (OpenAI's multiplier scales it)"),
    Key("train", "n_epochs", "int", 3, at_least(1), "passes over the training data"),
    Key("train", "batch_size", "int", 8, at_least(1), "sequences per micro-batch"),
    Key("train", "gradient_accumulation", "int", 1, at_least(1), "micro-batches per optimizer step"),
    Key("train", "data_parallel", "int|auto", 1, count_or_auto,
        "devices an in-process run (kiln train) splits each batch's rows over, times engine.tensor_parallel's "
        "for the weights; auto = every device the tp axis leaves. A server's jobs train on its serving mesh"),
    Key("train", "max_seq_len", "int", 1024, at_least(8), "tokens per sequence; longer examples are cut"),
    Key("train", "warmup_ratio", "float", 0.03, fraction, "share of optimizer steps spent warming up"),
    Key("train", "lr_schedule", "str", "cosine", one_of("cosine", "linear", "constant"), "decay after warmup"),
    Key("train", "weight_decay", "float", 0.0, non_negative, "AdamW weight decay"),
    Key("train", "max_grad_norm", "float", 1.0, non_negative, "gradient clipping by global norm; 0 = off"),
    Key("train", "remat", "str", "auto", one_of("auto", "on", "off"),
        "recompute layer activations in the backward pass; auto = when memory needs it"),
    Key("train", "seed", "int", 0, None, "seed of LoRA initialisation and data order"),
    Key("train", "checkpoint_every", "int", 50, at_least(1), "a job checkpoints every this many optimizer steps"),
    Key("train", "memory_budget_bytes", "int", 0, at_least(0),
        "memory a job may use on the CPU; 0 = the host's available memory (accelerators report their own)"),
    Key("train", "serving_share", "float", 0.5, fraction,
        "while requests are being served, the share of accelerator time a training job leaves to them"),
    Key("train", "max_slice_ms", "float", 100.0, positive,
        "longest stretch a training step holds the accelerator while serving waits; longer steps run in slices"),
    Key("train", "data_dir", "str", "", None,
        "uploaded files, jobs, checkpoints and evals; empty = <cache dir>/data"),
    Key("train", "tensorboard", "bool", True, None,
        "write TensorBoard event files of every training run: each step's loss, reward, KL, learning rate, ..."),
    Key("train", "log_dir", "str", "", None,
        "TensorBoard event files: <log_dir>/<job id> for a job, <log_dir>/<name>/<time> for a run in Python; "
        "empty = the job's directory (<data dir>/jobs/<job id>/tensorboard) or <data dir>/runs"),
    Key("train", "teachers", "list[str]", [], None,
        "models a distillation job may name as teacher: \"name=path\" (HF directory or GGUF); loaded on first use"),
    Key("distributed", "coordinator", "str", "", None,
        "host:port of process 0, where every process of a run that spans processes (hosts) meets "
        "(jax.distributed); empty = one process"),
    Key("distributed", "num_processes", "int", 1, at_least(1), "processes of a run that spans hosts"),
    Key("distributed", "process_id", "int|auto", "auto", index_or_auto,
        "this process's index, 0 to num_processes - 1; auto = a Kubernetes Indexed Job's completion index, or "
        "the ordinal a StatefulSet pod's host name ends in"),
    Key("distributed", "timeout_s", "int", 120, at_least(1),
        "seconds a process waits for the coordinator and the others before it fails, naming the address"),
    Key("cache", "dir", "str", "", None, "cache directory; empty = $XDG_CACHE_HOME/kiln or ~/.cache/kiln"),
    Key("cache", "compilation_dir", "str", "", None, "JAX persistent compilation cache; empty = <cache dir>/jax"),
    Key("backend", "route", "str", "auto", one_of("auto", "xla", "vulkan", "iree-cpu"),
        "how steps run: xla (JAX's own backend), vulkan or iree-cpu (IREE); auto = chosen from capabilities"),
    Key("backend", "iree_cache_dir", "str", "", None, "compiled IREE modules; empty = <cache dir>/iree"),
    Key("debug", "inject_device_loss_after_steps", "int", 0, at_least(0),
        "for tests: the engine step after this many raises device loss; 0 = never"),
)
# fmt: on

KEYS: dict[str, Key] = {k.dotted: k for k in SCHEMA}
SECTIONS: dict[str, dict[str, Key]] = {}
for _k in SCHEMA:
    SECTIONS.setdefault(_k.section, {})[_k.name] = _k


def setting_default(dotted: str) -> Any:
    """A setting's default as a frozen config dataclass holds it (lists as tuples)."""
    value = KEYS[dotted].default
    return tuple(value) if isinstance(value, list) else value


# The only keys the command line may set, with their flags.
COMMAND_LINE_OPTIONS: dict[str, str] = {"server.host": "--host", "server.port": "--port", "model.path": "--model"}
RETIRED_ENV: dict[str, str] = {"KILN_SERVING_PROFILE": "KILN_SERVER_SERVING_PROFILE"}

_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_KIND_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
               "int|auto": "an integer or \"auto\""}


def _int_or_auto(raw: str) -> int | str:
    """An int|auto key's text: "auto" (any case) or an integer."""
    text = raw.strip().lower()
    if text == "auto":
        return text
    try:
        return int(text, 10)
    except ValueError:
        raise ValueError(f"expected {_KIND_NAMES['int|auto']}") from None


def _from_toml(kind: str, raw: Any) -> Any:
    if kind.startswith("list["):
        item = kind[5:-1]
        if not isinstance(raw, list):
            raise ValueError(f"expected an array of {_KIND_NAMES[item]}s")
        return [_from_toml(item, v) for v in raw]
    if kind == "int|auto":
        return _int_or_auto(raw) if isinstance(raw, str) else _from_toml("int", raw)
    ok = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}[kind]
    if not isinstance(raw, ok) or (kind in ("int", "float") and isinstance(raw, bool)):
        raise ValueError(f"expected {_KIND_NAMES[kind]}")
    return float(raw) if kind == "float" else raw


def _from_text(kind: str, raw: str) -> Any:
    """Environment and command-line values: typed from text; lists are comma-separated."""
    if kind.startswith("list["):
        item = kind[5:-1]
        try:
            return [_from_text(item, part.strip()) for part in raw.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"expected a comma-separated list of {_KIND_NAMES[item]}s") from None
    if kind == "str":
        return raw
    if kind == "int|auto":
        return _int_or_auto(raw)
    if kind == "bool":
        if (text := raw.strip().lower()) in _BOOLS:
            return _BOOLS[text]
        raise ValueError("expected a boolean (true/false, 1/0, yes/no)")
    try:
        return int(raw.strip(), 10) if kind == "int" else float(raw)
    except ValueError:
        raise ValueError(f"expected {_KIND_NAMES[kind]}") from None


def _accept(key: Key, raw: Any, where: str, convert: Callable[[str, Any], Any]) -> Any:
    try:
        value = convert(key.kind, raw)
        return key.check(value) if key.check else value
    except ValueError as e:
        raise ConfigError(f"{where}: invalid value {raw!r} for {key.dotted}: {e}") from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return read_toml(path)
    except TomlFileError as e:
        raise ConfigError(str(e)) from None


def _toml_values(path: Path, doc: dict[str, Any]) -> list[tuple[Key, Any]]:
    """(key, raw value) pairs of the file; unknown sections or keys are errors listing what is accepted."""
    sections = ", ".join(SECTIONS)
    out = []
    for section, table in doc.items():
        if section not in SECTIONS or not isinstance(table, dict):
            what = f"unknown section [{section}]" if isinstance(table, dict) else f"{section!r} is not a [section]"
            raise ConfigError(f"config file {path}: {what}; accepted sections: {sections}")
        for name, raw in table.items():
            if name not in SECTIONS[section]:
                accepted = ", ".join(SECTIONS[section])
                raise ConfigError(f"config file {path}: unknown key {name!r} in [{section}]; accepted keys: {accepted}")
            out.append((SECTIONS[section][name], raw))
    return out


@dataclass(frozen=True)
class Value:
    value: Any
    source: str  # "default" | "config_file" | "environment" | "command_line"


class Settings:
    """Resolved settings, read-only by convention; shared by server, engine and CLI."""

    def __init__(self, values: dict[str, Value], config_file: Path | None, xdg_cache_home: str | None = None):
        self._values = values
        self.config_file = config_file
        self._xdg_cache_home = xdg_cache_home
        self._sections = {
            s: SimpleNamespace(**{n: values[k.dotted].value for n, k in keys.items()})
            for s, keys in SECTIONS.items()
        }
        profile = values["server.serving_profile"]
        self.serving_profile = ResolvedProfile(ServingProfile(profile.value), profile.source)

    def __getattr__(self, name: str) -> Any:
        """settings.server.port: one namespace per section."""
        try:
            return self.__dict__["_sections"][name]
        except KeyError:
            raise AttributeError(f"no settings section {name!r}") from None

    def get(self, dotted: str) -> Any:
        return self._values[dotted].value

    def source(self, dotted: str) -> str:
        return self._values[dotted].source

    def cache_dir(self) -> Path:
        if self.cache.dir:
            return Path(self.cache.dir).expanduser()
        return Path(self._xdg_cache_home or "~/.cache").expanduser() / "kiln"

    def compilation_dir(self) -> Path:
        return Path(self.cache.compilation_dir).expanduser() if self.cache.compilation_dir else self.cache_dir() / "jax"

    def iree_cache_dir(self) -> Path:
        directory = self.backend.iree_cache_dir
        return Path(directory).expanduser() if directory else self.cache_dir() / "iree"

    def training_dir(self) -> Path:
        return Path(self.train.data_dir).expanduser() if self.train.data_dir else self.cache_dir() / "data"

    def adapter_store(self) -> str:
        """A local path or any URL orbax accepts (gs://..., a shared filesystem)."""
        if not self.adapters.store:
            return str(self.cache_dir() / "adapters")
        return self.adapters.store if "://" in self.adapters.store else str(Path(self.adapters.store).expanduser())

    def to_json(self) -> dict[str, Any]:
        """The `kiln config --json` / `/v1/config` object; secrets are redacted."""
        settings: dict[str, dict[str, Any]] = {}
        for key in SCHEMA:
            v = self._values[key.dotted]
            shown = ["<redacted>"] * len(v.value) if key.secret else v.value
            settings.setdefault(key.section, {})[key.name] = {"value": shown, "source": v.source}
        return {
            "config_file": str(self.config_file) if self.config_file else None,
            "settings": settings,
            "serving_profile": self.serving_profile.to_json(),
        }


def resolve_settings(
    config_file: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    command_line: Mapping[str, str] | None = None,
) -> Settings:
    """Resolve every key. `command_line` maps dotted keys of COMMAND_LINE_OPTIONS to raw text."""
    env = os.environ if env is None else env
    values = {k.dotted: Value(_accept(k, k.default, "default", _from_toml), "default") for k in SCHEMA}

    path = None
    if config_file is not None:
        path = Path(os.path.abspath(config_file))
        for key, raw in _toml_values(path, _read_toml(path)):
            where = f"config file {path} ([{key.section}] {key.name})"
            values[key.dotted] = Value(_accept(key, raw, where, _from_toml), "config_file")

    for retired, current in RETIRED_ENV.items():
        if retired in env:
            log.warning("%s is retired and ignored; use %s (or the config file) instead", retired, current)

    for key in SCHEMA:  # other KILN_* variables are not settings (e.g. read by tests or tools)
        if key.env in env:
            where = f"environment variable {key.env}"
            values[key.dotted] = Value(_accept(key, env[key.env], where, _from_text), "environment")

    for dotted, raw in (command_line or {}).items():
        if dotted not in COMMAND_LINE_OPTIONS:
            raise ValueError(f"{dotted} cannot be set on the command line")
        key = KEYS[dotted]
        where = f"command line {COMMAND_LINE_OPTIONS[dotted]}"
        values[dotted] = Value(_accept(key, raw, where, _from_text), "command_line")

    return Settings(values, path, env.get("XDG_CACHE_HOME"))
