"""The adapter store: versioned artifacts, each an orbax checkpoint plus `manifest.json`.

Layout: <root>/<name>/<version>/{checkpoint/, optimizer/, manifest.json}, versions being
zero-padded integers. A save writes a whole version into a staging directory and renames it
to its version number, so a version directory is always complete, a crash mid-save leaves
the previous version as the current one, and concurrent savers on a shared store never mix
(see `AdapterStore.save`). A version without a manifest is ignored. Paths go through
`etils.epath`, so the root may be anything orbax accepts (a local or shared filesystem,
gs://...).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Any

import msgspec
import numpy as np
from etils import epath

from kiln.adapters.manifest import Manifest, manifest_digest, validate_name, weights_digest
from kiln.errors import AdapterNotFound, InvalidAdapter

log = logging.getLogger("kiln.adapters")
logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO through absl
MANIFEST = "manifest.json"
_STAGING = ".staging-"


@dataclasses.dataclass
class Artifact:
    name: str
    path: epath.Path  # the version directory
    manifest: Manifest
    manifest_digest: str

    @property
    def version(self) -> str:
        return self.path.name

    def summary(self) -> dict[str, Any]:
        """What listings show of an artifact (API, CLI)."""
        m = self.manifest
        return {"name": self.name, "version": self.version, "manifest_digest": self.manifest_digest, "rank": m.rank,
                "alpha": m.alpha, "target_modules": m.target_modules, "base_model": m.base_model.id,
                "created_at": m.provenance.created_at, "path": str(self.path), "eval_results": m.eval_results}


def read_artifact(path: str | epath.Path) -> Artifact:
    """A version directory, or an adapter directory (its latest complete version)."""
    path = epath.Path(path)
    if not path.exists():
        raise AdapterNotFound(f"{path}: no such adapter directory")
    if not (path / MANIFEST).exists():
        versions = _complete_versions(path)
        if not versions:
            raise InvalidAdapter(f"{path}: no complete Kiln adapter artifact (no {MANIFEST})")
        path = path / versions[-1]
    data = (path / MANIFEST).read_bytes()
    try:
        manifest = Manifest.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise InvalidAdapter(f"{path / MANIFEST}: {exc}") from None
    return Artifact(manifest.name, path, manifest, manifest_digest(data))


def _is_version(p: epath.Path) -> bool:
    return p.name.isdigit() and p.is_dir()


def _complete_versions(adapter_dir: epath.Path) -> list[str]:
    if not adapter_dir.is_dir():
        return []
    return sorted((p.name for p in adapter_dir.iterdir() if _is_version(p) and (p / MANIFEST).exists()), key=int)


def _checkpointer():
    """An orbax checkpointer that this process alone drives: an artifact holds whole host arrays, and
    of a run that spans processes only one saves it (orbax would otherwise wait for every process)."""
    import jax
    import orbax.checkpoint as ocp

    me = jax.process_index()
    return ocp.StandardCheckpointer(
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me}))


def load_weights(artifact: Artifact) -> dict[str, dict[str, np.ndarray]]:
    """The LoRA params, verified against the manifest's weights digest."""
    try:
        with _checkpointer() as ckpt:
            tree = ckpt.restore(artifact.path / "checkpoint")
    except Exception as exc:  # orbax raises many types for a damaged checkpoint
        raise InvalidAdapter(f"{artifact.path}: cannot restore the checkpoint: {exc}") from None
    weights = {m: {k: np.asarray(v, np.float32) for k, v in parts.items()} for m, parts in tree.items()}
    if weights_digest(weights) != artifact.manifest.weights_digest:
        raise InvalidAdapter(f"{artifact.path}: checkpoint does not match the manifest's weights digest")
    return weights


def load_optimizer_state(artifact: Artifact, target: Any = None) -> Any:
    if not artifact.manifest.has_optimizer_state:
        raise InvalidAdapter(f"{artifact.path}: the artifact has no optimizer state")
    with _checkpointer() as ckpt:
        return ckpt.restore(artifact.path / "optimizer", target)


class AdapterStore:
    def __init__(self, root: str | epath.Path, keep_versions: int = 3):
        self.root = epath.Path(root)
        self.keep_versions = keep_versions

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _complete_versions(p))

    def latest(self, name: str) -> Artifact | None:
        versions = _complete_versions(self.root / validate_name(name))
        return read_artifact(self.root / name / versions[-1]) if versions else None

    def list(self) -> list[Artifact]:
        return [a for a in (self.latest(n) for n in self.names()) if a is not None]

    def save(self, manifest: Manifest, weights: dict[str, dict[str, np.ndarray]], opt_state: Any = None) -> Artifact:
        """Writes a new version of `manifest.name`; returns it once complete.

        The version is written whole into a private staging directory (orbax checkpoint, then
        the manifest) and renamed to the next free version number. Renaming a directory onto an
        existing version fails, so two processes saving the same name at once (a shared store)
        each get a version of their own, complete and never mixed; the later rename is the
        later version, and wins."""
        name = validate_name(manifest.name)
        adapter_dir = self.root / name
        adapter_dir.mkdir(parents=True, exist_ok=True)
        staging = adapter_dir / f"{_STAGING}{uuid.uuid4().hex}"
        weights = {m: {k: np.asarray(v, np.float32) for k, v in parts.items()} for m, parts in weights.items()}
        manifest = msgspec.structs.replace(manifest, weights_digest=weights_digest(weights),
                                           has_optimizer_state=opt_state is not None)
        with _checkpointer() as ckpt:
            ckpt.save(staging / "checkpoint", weights)
            if opt_state is not None:
                ckpt.save(staging / "optimizer", opt_state)
            ckpt.wait_until_finished()
        data = manifest.encode()
        (staging / MANIFEST).write_bytes(data)
        for _ in range(1000):
            taken = [int(p.name) for p in adapter_dir.iterdir() if p.name.isdigit()]
            path = adapter_dir / f"{max(taken, default=0) + 1:06d}"
            try:
                staging.rename(path)
                break
            except OSError:  # another process took this number first: take the next
                if not staging.exists():
                    raise
        else:
            raise InvalidAdapter(f"{adapter_dir}: could not claim a version number")
        self._prune(adapter_dir, keep=path.name)
        log.info("saved adapter %s version %s", name, path.name)
        return Artifact(name, path, manifest, manifest_digest(data))

    def _prune(self, adapter_dir: epath.Path, keep: str) -> None:
        """Drops incomplete leftovers below the new version, all but the newest complete ones,
        and staging directories a crashed save left behind (older than a day)."""
        complete = _complete_versions(adapter_dir)
        stale = set(complete[: -self.keep_versions]) if self.keep_versions else set()
        for p in adapter_dir.iterdir():
            try:
                if p.name.startswith(_STAGING):
                    if time.time() - p.stat().mtime > 86400:
                        p.rmtree()
                    continue
                number = p.name.split(".")[0]
                if not number.isdigit() or int(number) >= int(keep):
                    continue
                if p.name in stale or p.name not in complete:
                    p.rmtree() if p.is_dir() else p.unlink()
            except FileNotFoundError:  # another process renamed or pruned it meanwhile
                continue

    def delete(self, name: str) -> None:
        adapter_dir = self.root / validate_name(name)
        if adapter_dir.exists():
            adapter_dir.rmtree()
