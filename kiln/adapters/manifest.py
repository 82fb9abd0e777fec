"""The adapter manifest: what an artifact is, what it binds to, where it came from.

`manifest.json` sits next to the orbax checkpoint of the LoRA params. It binds the
weights (by digest) to a base model (id and weights digest), records rank/alpha/targets,
the training-inputs digest and configuration, provenance and eval results. The manifest
digest (sha256 of its bytes) is the adapter version that lineage reports.
"""

from __future__ import annotations

import datetime
import hashlib
import re
from typing import Any

import msgspec
import numpy as np

from kiln import __version__
from kiln.errors import InvalidRequest

FORMAT = "kiln.adapter/1"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def validate_name(name: object) -> str:
    """An adapter name is a plain identifier, so it can never address a file."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidRequest(
            f"invalid adapter name {name!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit, without '..' or path separators", code="invalid_adapter_name", param="name")
    return name


class BaseModelRef(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    id: str
    weights_digest: str
    architecture: str | None = None  # HF's name for the family: how a PEFT export lays out fused modules


class ParentRef(msgspec.Struct, forbid_unknown_fields=False):
    name: str
    manifest_digest: str


class Provenance(msgspec.Struct, forbid_unknown_fields=False):
    kiln_version: str
    jax_version: str
    backend: str
    device_kind: str
    created_at: str
    source: str  # "import:peft", "training:sft", ...
    parent_adapter: ParentRef | None = None


class Manifest(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=False):
    name: str
    base_model: BaseModelRef
    rank: int
    alpha: float
    target_modules: list[str]
    weights_digest: str  # of the LoRA params in the checkpoint
    provenance: Provenance
    use_rslora: bool = False
    training_inputs_digest: str | None = None
    training_inputs: list[dict[str, Any]] | None = None  # each: purpose, sha256 (and file id for jobs)
    training: dict[str, Any] | None = None  # job id, started_at, finished_at, steps, trained_tokens, final_metrics
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    eval_results: dict[str, Any] | None = None
    has_optimizer_state: bool = False
    format: str = FORMAT

    @property
    def scale(self) -> float:
        """LoRA output scale: alpha / r, or alpha / sqrt(r) for rank-stabilised LoRA."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)

    def encode(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n"

    @staticmethod
    def decode(data: bytes) -> Manifest:
        manifest = msgspec.json.decode(data, type=Manifest)
        if manifest.format != FORMAT:
            raise ValueError(f"unsupported adapter manifest format {manifest.format!r} (expected {FORMAT!r})")
        return manifest


def manifest_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def weights_digest(weights: dict[str, dict[str, np.ndarray]]) -> str:
    """Content digest of LoRA params: module names, shapes and float32 bytes, in sorted order."""
    h = hashlib.sha256()
    for module in sorted(weights):
        for part in ("a", "b"):
            arr = np.ascontiguousarray(np.asarray(weights[module][part], np.float32))
            h.update(f"{module}.{part}:{arr.shape}".encode())
            h.update(arr.tobytes())
    return "sha256:" + h.hexdigest()


def provenance(source: str, parent: ParentRef | None = None) -> Provenance:
    import jax

    device = jax.devices()[0]
    return Provenance(
        kiln_version=__version__, jax_version=jax.__version__, backend=jax.default_backend(),
        device_kind=device.device_kind, created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        source=source, parent_adapter=parent,
    )
