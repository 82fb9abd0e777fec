"""From a jitted step function to an IREE module: `jax.export` lowers it to StableHLO for the
given abstract arguments, and IREE compiles that for one target (`vulkan-spirv`, `llvm-cpu`).

Modules are cached on disk, one file per step bucket, named by the hash of everything that
decides the bytes: the StableHLO text, the target, the compiler flags and the compiler's version.
Processes share the cache, so a bucket is compiled once per machine (`kiln warmup` fills it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from importlib import metadata
from pathlib import Path

import jax
from jax import export as jax_export
from jax._src import config as jax_config

from kiln.atomic_file import write_atomic
from kiln.errors import BackendUnavailable

log = logging.getLogger("kiln.iree")

# On Vulkan, a constant expression hoisted into a module global came out changed by the first call
# (Mesa's lavapipe: every later call of a step returned wrong tokens), so nothing is hoisted there.
TARGET_FLAGS = {
    "llvm-cpu": ("--iree-llvmcpu-target-cpu=host",),
    "vulkan-spirv": ("--iree-opt-const-expr-hoisting=false", "--iree-opt-const-eval=false"),
}


@dataclasses.dataclass(frozen=True)
class ExportedStep:
    """A step lowered to StableHLO: the module's text and how its flat arguments and results map to
    the step's pytrees (exported modules drop arguments the step never reads)."""

    mlir: str
    in_tree: object
    out_tree: object
    kept: tuple[int, ...]  # indices of the flat arguments the module takes, in order


def _plain(x):
    """An abstract argument without placement: the module must not carry sharding annotations."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x


def export_step(fn, *args, **static) -> ExportedStep:
    """Lowers `fn` (a jitted function) for these abstract arguments; keyword arguments are static."""
    args = jax.tree.map(_plain, args)
    # IREE reads plain StableHLO: no Shardy dialect in the module
    with jax_config.use_shardy_partitioner(False):
        exported = jax_export.export(fn, platforms=["cpu"])(*args, **static)
    return ExportedStep(exported.mlir_module(), exported.in_tree, exported.out_tree,
                        tuple(sorted(exported.module_kept_var_idx)))


def compiler_version() -> str:
    try:
        return metadata.version("iree-base-compiler")
    except metadata.PackageNotFoundError as exc:
        raise BackendUnavailable(
            "the IREE compiler is not installed; install Kiln's vulkan extra: pip install 'kiln[vulkan]'") from exc


def module_key(mlir: str, target: str) -> str:
    h = hashlib.sha256()
    for part in (mlir, target, " ".join(TARGET_FLAGS[target]), compiler_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


class ModuleCache:
    """Compiled modules on disk, by module key."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.hits = 0
        self.compiles = 0

    def path(self, key: str, target: str) -> Path:
        return self.dir / f"{key}.{target}.vmfb"

    def get_or_compile(self, mlir: str, target: str) -> bytes:
        return self.get_or_compile_keyed(mlir, target)[1]

    def get_or_compile_keyed(self, mlir: str, target: str) -> tuple[str, bytes]:
        """(the module's key, its compiled bytes)."""
        key = module_key(mlir, target)
        return key, self._get_or_compile(key, mlir, target)

    def _get_or_compile(self, key: str, mlir: str, target: str) -> bytes:
        path = self.path(key, target)
        if path.exists():
            self.hits += 1
            return path.read_bytes()
        vmfb = compile_module(mlir, target)
        self.compiles += 1
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, vmfb)  # another process may be reading or writing the same key
        return vmfb


    def verdict(self, key: str, device: str) -> dict | None:
        """A correctness gate's recorded verdict on this module and device ({"why": None} passed)."""
        try:
            return json.loads((self.dir / f"{key}.{device}.gate.json").read_text())
        except (OSError, ValueError):
            return None

    def record_verdict(self, key: str, device: str, why: str | None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.dir / f"{key}.{device}.gate.json", json.dumps({"why": why}).encode())


def compile_module(mlir: str, target: str) -> bytes:
    try:
        import iree.compiler as ic
    except ImportError as exc:
        raise BackendUnavailable(
            "the IREE compiler is not installed; install Kiln's vulkan extra: pip install 'kiln[vulkan]'") from exc
    return ic.compile_str(mlir, target_backends=[target], input_type="stablehlo",
                          extra_args=list(TARGET_FLAGS[target]))
