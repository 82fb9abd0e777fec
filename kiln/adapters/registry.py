"""The adapter registry: which adapters the process serves, by name.

Loading reads an artifact (or a PEFT directory, which becomes an artifact in the store),
checks it against the served base model and the slot limits (`check_fits`, the one place
those rules live), registers it under its name and places it in an accelerator slot at
the next iteration boundary. Slots are recycled least recently used first, so more adapters
can be registered than there are slots. Every adapter in the store is served by name: one not
loaded yet (a fine-tuning job's model after a restart, an imported one) loads on its first
request (`ensure_loaded`), unless this process unloaded it (until it is loaded again) or it
failed its promotion gate. Unloading or replacing takes effect for
new requests at once; requests already running on the old version finish with it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

from kiln.adapters import peft_io
from kiln.adapters.manifest import BaseModelRef, Manifest, provenance, validate_name
from kiln.adapters.store import AdapterStore, Artifact, load_weights, read_artifact
from kiln.engine.client import AsyncEngine
from kiln.engine.lora_slots import AdapterWeights, slot_modules
from kiln.errors import (
    AdapterNotFound,
    AdmissionRejected,
    InvalidAdapter,
    InvalidRequest,
    KilnError,
    RequestFailed,
)
from kiln.models.loader import LoadedModel
from kiln.models.lora import EXPERT_MODULES, TARGET_MODULES

log = logging.getLogger("kiln.adapters")


def artifact_weights(artifact: Artifact, name: str | None = None) -> AdapterWeights:
    """An artifact's verified LoRA weights, as the engine's slots take them (named `name`, or
    the manifest's name; versioned by the manifest digest)."""
    m = artifact.manifest
    return AdapterWeights(name or m.name, artifact.manifest_digest, load_weights(artifact), m.scale, m.rank)


def check_fits(manifest: Manifest, model: LoadedModel, max_rank: int, modules=TARGET_MODULES) -> None:
    """An adapter serves only on the base weights it was made for, within the slots' rank and
    modules (`modules`: what the slots hold)."""
    if manifest.base_model.weights_digest != model.weights_digest:
        raise InvalidRequest(
            f"adapter {manifest.name!r} was made for base model {manifest.base_model.id!r} "
            f"(weights {manifest.base_model.weights_digest[:19]}), but this server runs {model.model_id!r} "
            f"(weights {model.weights_digest[:19]})", code="adapter_base_model_mismatch")
    if manifest.rank > max_rank:
        raise InvalidRequest(f"adapter rank {manifest.rank} exceeds max_lora_rank {max_rank}",
                             code="adapter_rank_too_large")
    unknown = set(manifest.target_modules) - set(TARGET_MODULES)
    if unknown:
        raise InvalidAdapter(f"adapter targets unsupported modules {sorted(unknown)}")
    experts = sorted(set(manifest.target_modules) & set(EXPERT_MODULES) - set(modules))
    if experts:
        raise InvalidAdapter(f"adapter {manifest.name!r} adapts the experts ({', '.join(experts)}), which this "
                             "server's adapter slots do not hold: set [adapters] lora_experts = true")


def peft_artifact(name: str, path: str | Path, model: LoadedModel) -> tuple[Manifest, dict]:
    """A PEFT adapter directory as the manifest and weights of a Kiln artifact bound to `model`."""
    weights, info = peft_io.read_peft(path, model.config)
    manifest = Manifest(
        name=validate_name(name), base_model=BaseModelRef(model.model_id, model.weights_digest,
                                                          model.config.architecture),
        rank=info["rank"], alpha=info["alpha"], use_rslora=info["use_rslora"], target_modules=info["target_modules"],
        weights_digest="", provenance=provenance("import:peft"),
        config={"peft": info["peft_config"], "imported_from": str(path)},
    )
    return manifest, weights


def import_peft(store: AdapterStore, name: str, path: str | Path, model: LoadedModel, max_rank: int,
                modules=TARGET_MODULES) -> Artifact:
    """A PEFT adapter becomes a Kiln artifact in the store; one that cannot serve is refused
    before anything is written."""
    manifest, weights = peft_artifact(name, path, model)
    check_fits(manifest, model, max_rank, modules)
    try:
        return store.save(manifest, weights)
    except KilnError:
        raise
    except Exception as exc:  # the store could not be written (permissions, full disk, ...)
        raise RequestFailed(f"cannot write adapter {name!r} to the store {store.root}: {exc}",
                            code="adapter_store_error") from None


def export_peft(artifact: Artifact, path: str | Path) -> Path:
    """Writes a Kiln artifact as a PEFT directory (for transformers + peft, vLLM)."""
    m = artifact.manifest
    return peft_io.write_peft(path, load_weights(artifact), m.rank, m.alpha, m.use_rslora, m.base_model.id,
                              m.base_model.architecture)


@dataclasses.dataclass
class LoadedAdapter:
    artifact: Artifact
    weights: AdapterWeights
    source: str  # what the operator loaded it from
    loaded_at: float

    @property
    def name(self) -> str:
        return self.weights.name

    def describe(self) -> dict[str, Any]:
        return {**self.artifact.summary(), "name": self.name, "loaded": True, "source": self.source,
                "loaded_at": int(self.loaded_at)}


class AdapterRegistry:
    def __init__(self, engine: AsyncEngine, store: AdapterStore, transitions_allowed: bool = True):
        self.engine = engine
        self.store = store
        self.transitions_allowed = transitions_allowed
        self.model = engine.model
        self.max_rank = engine.config.max_lora_rank
        self.modules = slot_modules(engine.config.lora_experts)  # what the engine's slots hold
        self._loaded: dict[str, LoadedAdapter] = {}
        self._admin = threading.Lock()  # loads and unloads run one at a time
        self._on_demand = threading.Lock()  # a name's first requests wait for one load
        self._unloaded: set[str] = set()  # names unloaded here: no longer served by name until loaded again

    # ---- lookups (any thread) -------------------------------------------------------------

    def get(self, name: str) -> LoadedAdapter | None:
        return self._loaded.get(name)

    def loaded(self) -> list[LoadedAdapter]:
        return sorted(self._loaded.values(), key=lambda a: a.name)

    def _serves_by_name(self, artifact: Artifact) -> bool:
        """Made for the served base model, and not held back by a promotion gate it failed (only an
        explicit load serves that one)."""
        gate = (artifact.manifest.eval_results or {}).get("gate") or {}
        same_base = artifact.manifest.base_model.weights_digest == self.model.weights_digest
        return same_base and gate.get("passed") is not False

    def stored(self, name: str) -> Artifact | None:
        """The store's latest version of `name`, if a request may load it by name."""
        try:
            artifact = self.store.latest(validate_name(name))
        except (InvalidRequest, InvalidAdapter):
            return None
        return artifact if artifact is not None and self._serves_by_name(artifact) else None

    def loadable(self) -> list[Artifact]:
        """The store's adapters a request may load by name that are not loaded (nor unloaded here)."""
        return [a for a in self.store.list()
                if a.name not in self._loaded and a.name not in self._unloaded and self._serves_by_name(a)]

    def ensure_loaded(self, name: str) -> LoadedAdapter | None:
        """The adapter `name`: loaded, or loaded now from the store (blocking; call from a worker
        thread); None when the store has no adapter of that name for this base model."""
        entry = self._loaded.get(name)
        if entry is not None or name in self._unloaded or self.stored(name) is None:
            return entry
        with self._on_demand:
            entry = self._loaded.get(name)
            if entry is None:
                log.info("adapter %s requested by name: loading it from the store", name)
                entry = self.load(name)
            return entry

    def describe_all(self) -> list[dict[str, Any]]:
        """Loaded adapters (with their slot) and artifacts in the store that are not loaded."""
        resident = {(r["adapter"], r["version"]): r for r in self.engine.snapshot["resident_adapters"]}
        out = []
        for a in self.loaded():
            slot = resident.get((a.name, a.weights.version))
            out.append({**a.describe(), "slot": slot["slot"] if slot else None,
                        "active_requests": slot["requests"] if slot else 0})
        for art in self.store.list():
            if art.name not in self._loaded:
                out.append({**art.summary(), "loaded": False, "source": "store", "slot": None, "active_requests": 0})
        return out

    # ---- transitions (blocking; call from a worker thread) --------------------------------

    def load(self, name: str, path: str | None = None, replace: bool = False) -> LoadedAdapter:
        """Loads `name` from `path` (a Kiln artifact or a PEFT directory) or from the store."""
        validate_name(name)
        if name == self.model.model_id:
            raise InvalidRequest(f"{name!r} is the base model's id", code="invalid_adapter_name", param="name")
        self._check_transitions()
        with self._admin:
            old = self._loaded.get(name)
            if old is not None and not replace:
                raise InvalidRequest(f"The lora adapter '{name}' has already been loaded.",
                                     code="adapter_already_loaded")
            artifact, source = self._resolve(name, path)
            entry = LoadedAdapter(artifact, artifact_weights(artifact, name), source, time.time())
            self._loaded[name] = entry  # new requests select the new version from here on
            self._unloaded.discard(name)
            if old is not None:
                self._at_boundary(self.engine.retire_adapter(old.weights))
            try:
                self._activate(entry)
            except KilnError:
                self._loaded.pop(name, None)  # never leave a name pointing at weights that failed to load
                raise
            log.info("adapter %s loaded (version %s, %s)%s", name, artifact.version, artifact.manifest_digest[:19],
                     " replacing the previous version" if old else "")
            return entry

    def activate(self, name: str) -> int | None:
        """Places a loaded adapter in an accelerator slot now (evicting the least recently used
        idle one); returns the slot, or None while every slot serves live requests."""
        entry = self._loaded.get(name)
        if entry is None:
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        return self._activate(entry)

    def unload(self, name: str) -> LoadedAdapter:
        self._check_transitions()
        with self._admin:
            entry = self._loaded.pop(name, None)
            if entry is None:
                raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
            self._unloaded.add(name)
            self._at_boundary(self.engine.retire_adapter(entry.weights))
            log.info("adapter %s unloaded", name)
            return entry

    # ---- helpers ----------------------------------------------------------------------------

    def _check_transitions(self) -> None:
        if not self.transitions_allowed:
            raise AdmissionRejected("adapter weight transitions are disabled by the serving profile",
                                    code="adapter_transitions_disabled_by_profile")

    def _activate(self, entry: LoadedAdapter) -> int | None:
        return self._at_boundary(self.engine.place_adapter(entry.weights))

    def _at_boundary(self, future, timeout: float = 300.0):
        """Waits for an engine-thread transition."""
        try:
            return future.result(timeout)
        except TimeoutError:
            raise AdmissionRejected("the engine did not reach an iteration boundary in time",
                                    code="engine_unavailable") from None
        except Exception as exc:  # the transition itself failed (e.g. out of accelerator memory)
            raise RequestFailed(f"adapter transition failed: {type(exc).__name__}: {exc}",
                                code="adapter_transition_failed") from None

    def _resolve(self, name: str, path: str | None) -> tuple[Artifact, str]:
        """The artifact to load, checked against the served model; a PEFT directory is imported first."""
        if path is None:
            artifact = self.store.latest(name)
            if artifact is None:
                raise AdapterNotFound(f"no adapter named {name!r} in the store {self.store.root}")
            source = "store"
        elif "://" not in path and peft_io.is_peft_dir(path):
            return import_peft(self.store, name, path, self.model, self.max_rank, self.modules), f"peft:{path}"
        else:
            try:
                artifact, source = read_artifact(path), path
            except OSError as exc:
                raise InvalidAdapter(f"cannot read {path}: {exc.strerror or exc}") from None
        check_fits(artifact.manifest, self.model, self.max_rank, self.modules)
        return artifact, source
