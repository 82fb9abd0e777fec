"""The adapter registry: which adapters the process serves, by name.

Loading reads an artifact (or imports a PEFT directory into the store), checks it against
the served base model and the slot limits, registers it under its name and places it in
an accelerator slot at the next iteration boundary. Slots are recycled least recently used
first, so more adapters can be registered than there are slots. Unloading or replacing
takes effect for new requests at once; requests already running on the old version finish
with it (see `kiln.engine.lora_slots`).
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
from kiln.adapters.store import AdapterStore, Artifact, ArtifactError, load_weights, read_artifact
from kiln.engine.engine import Engine
from kiln.engine.lora_slots import AdapterWeights
from kiln.models.lora import TARGET_MODULES

log = logging.getLogger("kiln.adapters")


class AdapterError(Exception):
    """A load/unload the registry refuses; `code` names the reason for the API."""

    def __init__(self, message: str, code: str, status: int = 400):
        super().__init__(message)
        self.code, self.status = code, status


def import_peft(store: AdapterStore, name: str, path: str | Path, model, max_rank: int | None = None) -> Artifact:
    """A PEFT adapter becomes a Kiln artifact in the store, bound to `model` (a LoadedModel).
    An adapter above `max_rank` is refused before anything is written."""
    weights, info = peft_io.read_peft(path, model.config)
    if max_rank is not None and info["rank"] > max_rank:
        raise AdapterError(f"adapter rank {info['rank']} exceeds max_lora_rank {max_rank}", "adapter_rank_too_large")
    manifest = Manifest(
        name=validate_name(name), base_model=BaseModelRef(model.model_id, model.weights_digest),
        rank=info["rank"], alpha=info["alpha"], use_rslora=info["use_rslora"], target_modules=info["target_modules"],
        weights_digest="", provenance=provenance("import:peft"),
        config={"peft": info["peft_config"], "imported_from": str(path)},
    )
    return store.save(manifest, weights)


def export_peft(artifact: Artifact, path: str | Path) -> Path:
    """Writes a Kiln artifact as a PEFT directory (for transformers + peft, vLLM)."""
    m = artifact.manifest
    return peft_io.write_peft(path, load_weights(artifact), m.rank, m.alpha, m.use_rslora, m.base_model.id)


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
    def __init__(self, engine: Engine, store: AdapterStore, transitions_allowed: bool = True):
        self.engine = engine
        self.store = store
        self.transitions_allowed = transitions_allowed
        self.model = engine.model
        self._loaded: dict[str, LoadedAdapter] = {}
        self._admin = threading.Lock()  # loads and unloads run one at a time

    # ---- lookups (any thread) -------------------------------------------------------------

    def get(self, name: str) -> LoadedAdapter | None:
        return self._loaded.get(name)

    def loaded(self) -> list[LoadedAdapter]:
        return sorted(self._loaded.values(), key=lambda a: a.name)

    def describe_all(self) -> list[dict[str, Any]]:
        """Loaded adapters (with their slot) and artifacts in the store that are not loaded."""
        resident = {(r["adapter"], r["version"]): r for r in self.engine.lora_slots.resident()}
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
        try:
            validate_name(name)
        except ValueError as exc:
            raise AdapterError(str(exc), "invalid_adapter_name") from None
        if name == self.model.model_id:
            raise AdapterError(f"{name!r} is the base model's id", "invalid_adapter_name")
        if not self.transitions_allowed:
            raise AdapterError("adapter weight transitions are disabled by the serving profile",
                               "adapter_transitions_disabled_by_profile", 503)
        with self._admin:
            old = self._loaded.get(name)
            if old is not None and not replace:
                raise AdapterError(f"The lora adapter '{name}' has already been loaded.", "adapter_already_loaded")
            artifact, source = self._resolve(name, path)
            weights = self._weights(artifact)
            self._check(artifact, weights)
            entry = LoadedAdapter(artifact, AdapterWeights(name, artifact.manifest_digest, weights,
                                                           artifact.manifest.scale, artifact.manifest.rank),
                                  source, time.time())
            self._loaded[name] = entry  # new requests select the new version from here on
            if old is not None:
                self._at_boundary(self.engine.retire_adapter(old.weights))
            try:
                self._activate(entry)
            except AdapterError:
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
            raise AdapterError(f"The lora adapter '{name}' cannot be found.", "adapter_not_found", 404)
        return self._activate(entry)

    def _activate(self, entry: LoadedAdapter) -> int | None:
        return self._at_boundary(self.engine.place_adapter(entry.weights))

    def unload(self, name: str) -> LoadedAdapter:
        if not self.transitions_allowed:
            raise AdapterError("adapter weight transitions are disabled by the serving profile",
                               "adapter_transitions_disabled_by_profile", 503)
        with self._admin:
            entry = self._loaded.pop(name, None)
            if entry is None:
                raise AdapterError(f"The lora adapter '{name}' cannot be found.", "adapter_not_found", 404)
            self._at_boundary(self.engine.retire_adapter(entry.weights))
            log.info("adapter %s unloaded", name)
            return entry

    # ---- helpers ----------------------------------------------------------------------------

    def _at_boundary(self, future, timeout: float = 300.0):
        """Waits for an engine-thread transition; failures become API errors."""
        try:
            return future.result(timeout)
        except TimeoutError:
            raise AdapterError("the engine did not reach an iteration boundary in time", "engine_unavailable", 503) from None
        except Exception as exc:  # the transition itself failed (e.g. out of accelerator memory)
            raise AdapterError(f"adapter transition failed: {type(exc).__name__}: {exc}", "adapter_transition_failed",
                               500) from None

    def _resolve(self, name: str, path: str | None) -> tuple[Artifact, str]:
        if path is None:
            artifact = self.store.latest(name)
            if artifact is None:
                raise AdapterError(f"no adapter named {name!r} in the store {self.store.root}", "adapter_not_found", 404)
            return artifact, "store"
        local = Path(path)
        try:
            if "://" not in path and peft_io.is_peft_dir(local):
                return self._import_peft(name, local), f"peft:{path}"
            artifact = read_artifact(path)
        except peft_io.PeftFormatError as exc:
            raise AdapterError(str(exc), "invalid_adapter") from None
        except ArtifactError as exc:
            code = "adapter_not_found" if not Path(path).exists() and "://" not in path else "invalid_adapter"
            raise AdapterError(str(exc), code, 404 if code == "adapter_not_found" else 400) from None
        except OSError as exc:
            raise AdapterError(f"cannot read {path}: {exc.strerror or exc}", "invalid_adapter") from None
        return artifact, path

    def _import_peft(self, name: str, path: Path) -> Artifact:
        try:
            return import_peft(self.store, name, path, self.model, self.engine.config.max_lora_rank)
        except (peft_io.PeftFormatError, AdapterError):
            raise
        except Exception as exc:  # the store could not be written (permissions, full disk, ...)
            raise AdapterError(f"cannot write adapter {name!r} to the store {self.store.root}: {exc}",
                               "adapter_store_error", 500) from None

    def _weights(self, artifact: Artifact) -> dict:
        try:
            return load_weights(artifact)
        except ArtifactError as exc:
            raise AdapterError(str(exc), "invalid_adapter") from None

    def _check(self, artifact: Artifact, weights: dict) -> None:
        m = artifact.manifest
        if m.base_model.weights_digest != self.model.weights_digest:
            raise AdapterError(
                f"adapter {m.name!r} was made for base model {m.base_model.id!r} (weights {m.base_model.weights_digest[:19]}), "
                f"but this server runs {self.model.model_id!r} (weights {self.model.weights_digest[:19]})",
                "adapter_base_model_mismatch")
        if m.rank > self.engine.config.max_lora_rank:
            raise AdapterError(f"adapter rank {m.rank} exceeds max_lora_rank {self.engine.config.max_lora_rank}",
                               "adapter_rank_too_large")
        unknown = set(weights) - set(TARGET_MODULES)
        if unknown:
            raise AdapterError(f"adapter targets unsupported modules {sorted(unknown)}", "invalid_adapter")
