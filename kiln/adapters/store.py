"""The adapter store: versioned artifacts, each an orbax checkpoint plus `manifest.json`.

Layout: <root>/<name>/<version>/{checkpoint/, optimizer/, manifest.json}, versions being
zero-padded integers. A save writes a new version: orbax writes the checkpoint into a
temporary directory and renames it when complete, and the manifest is written last (to a
temporary name, then renamed). A version without a manifest is incomplete and ignored,
so a crash mid-save leaves the previous version as the current one. Paths go through
`etils.epath`, so the root may be anything orbax accepts (a local or shared filesystem,
gs://...).
"""

from __future__ import annotations

import dataclasses
import logging
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
                "created_at": m.provenance.created_at, "path": str(self.path)}


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


def load_weights(artifact: Artifact) -> dict[str, dict[str, np.ndarray]]:
    """The LoRA params, verified against the manifest's weights digest."""
    import orbax.checkpoint as ocp

    try:
        with ocp.StandardCheckpointer() as ckpt:
            tree = ckpt.restore(artifact.path / "checkpoint")
    except Exception as exc:  # orbax raises many types for a damaged checkpoint
        raise InvalidAdapter(f"{artifact.path}: cannot restore the checkpoint: {exc}") from None
    weights = {m: {k: np.asarray(v, np.float32) for k, v in parts.items()} for m, parts in tree.items()}
    if weights_digest(weights) != artifact.manifest.weights_digest:
        raise InvalidAdapter(f"{artifact.path}: checkpoint does not match the manifest's weights digest")
    return weights


def load_optimizer_state(artifact: Artifact, target: Any = None) -> Any:
    import orbax.checkpoint as ocp

    if not artifact.manifest.has_optimizer_state:
        raise InvalidAdapter(f"{artifact.path}: the artifact has no optimizer state")
    with ocp.StandardCheckpointer() as ckpt:
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
        """Writes a new version of `manifest.name`; returns it once complete."""
        import jax
        import orbax.checkpoint as ocp

        name = validate_name(manifest.name)
        adapter_dir = self.root / name
        adapter_dir.mkdir(parents=True, exist_ok=True)
        existing = [p for p in adapter_dir.iterdir() if p.name.split(".")[0].isdigit()]
        number = max((int(p.name.split(".")[0]) for p in existing), default=0) + 1
        path = adapter_dir / f"{number:06d}"
        weights = {m: {k: np.asarray(v, np.float32) for k, v in parts.items()} for m, parts in weights.items()}
        manifest = msgspec.structs.replace(manifest, weights_digest=weights_digest(weights),
                                           has_optimizer_state=opt_state is not None)
        with ocp.StandardCheckpointer() as ckpt:  # each write: orbax temporary directory + rename
            ckpt.save(path / "checkpoint", weights)
            if opt_state is not None:
                ckpt.save(path / "optimizer", opt_state)
            ckpt.wait_until_finished()
        data = manifest.encode()
        if jax.process_index() == 0:
            tmp = path / f".{MANIFEST}.{uuid.uuid4().hex}"
            tmp.write_bytes(data)
            tmp.rename(path / MANIFEST)  # the manifest last: its presence marks the version complete
        self._prune(adapter_dir, keep=path.name)
        log.info("saved adapter %s version %s", name, path.name)
        return Artifact(name, path, manifest, manifest_digest(data))

    def _prune(self, adapter_dir: epath.Path, keep: str) -> None:
        """Drops incomplete leftovers below the new version and all but the newest complete ones."""
        complete = _complete_versions(adapter_dir)
        stale = set(complete[: -self.keep_versions]) if self.keep_versions else set()
        for p in adapter_dir.iterdir():
            number = p.name.split(".")[0]
            if not number.isdigit() or int(number) >= int(keep):
                continue
            if p.name in stale or p.name not in complete:
                p.rmtree() if p.is_dir() else p.unlink()

    def delete(self, name: str) -> None:
        adapter_dir = self.root / validate_name(name)
        if adapter_dir.exists():
            adapter_dir.rmtree()
