"""Compiled steps kept on disk, so that a restart loads its executables instead of building them.

JAX's persistent compilation cache keys an executable by its lowered program, so even a hit
traces and lowers the step first (about 0.6 s for an unrolled 30-layer model on a small CPU).
Kiln keys its step executables by what determines them: the step's name and bucket, the
abstract arguments (shapes, dtypes, placement), the model configuration, the Kiln sources
that define the computation, the JAX/XLA versions, the backend and device, the host CPU's
features and XLA's flags. A hit deserializes the executable without tracing. Files are
written atomically, so several processes may share one directory. The directory sits beside
JAX's cache (`<compilation dir>/kiln-steps`); without a configured JAX cache nothing is kept.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import platform
import threading
from pathlib import Path

import jax
import jaxlib

from kiln.atomic_file import write_atomic
from kiln.kernels import cpu as kernels

log = logging.getLogger("kiln.engine")

_jax_cache_hits = threading.local()  # per compiling thread: how many executables JAX took from its cache


def _count_jax_cache_hits(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":  # recorded on the thread that compiles
        _jax_cache_hits.count = getattr(_jax_cache_hits, "count", 0) + 1


jax.monitoring.register_event_listener(_count_jax_cache_hits)

# the sources whose code becomes a step executable
_SOURCES = ("kernels/cpu.py", "models/config.py", "models/decoder.py", "models/lora.py", "models/quant.py",
            "models/rope.py", "engine/sampling.py", "engine/steps.py")


@functools.cache
def _environment() -> str:
    kiln_root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update(name.encode())
        h.update((kiln_root / name).read_bytes())
    device = jax.devices()[0]
    parts = (h.hexdigest(), jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
             getattr(device.client, "platform_version", ""), platform.machine(), kernels.cpu_flags(),
             os.environ.get("XLA_FLAGS", ""))
    return "\n".join(map(str, parts))


def executable_key(name: str, abstract_args, static) -> str:
    leaves, tree = jax.tree.flatten(abstract_args)
    described = [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]
    text = "\n".join([_environment(), kernels.state(), name, repr(static), str(tree), repr(described)])
    return hashlib.sha256(text.encode()).hexdigest()


class ExecutableStore:
    """Serialized step executables in one directory (None: keep nothing)."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        self.loads = 0
        self.saves = 0
        self.compiles = 0  # compiled here or taken from JAX's cache: not loaded from this store

    @classmethod
    def beside_jax_cache(cls) -> ExecutableStore:
        cache = jax.config.jax_compilation_cache_dir
        return cls(Path(cache) / "kiln-steps" if cache else None)

    def load(self, key: str):
        """The executable stored under `key`, or None (absent, or stored by an incompatible build)."""
        if self.directory is None:
            return None
        path = self.directory / f"{key}.bin"
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            entry = pickle.loads(blob)
            if len(entry) != 4:  # stored without its devices (an older build): rebuilt
                return None
            payload, in_tree, out_tree, device_ids = entry
            by_id = {d.id: d for d in jax.devices()}
            if any(i not in by_id for i in device_ids):
                return None
            # on the devices it was compiled for (by default it would span every device of the process)
            executable = deserialize_and_load(payload, in_tree, out_tree,
                                              execution_devices=[by_id[i] for i in device_ids])
        except Exception as exc:  # a stale or damaged entry is rebuilt, never fatal
            log.warning("stored step executable %s could not be loaded (%s); compiling it again", path.name, exc)
            return None
        self.loads += 1
        return executable

    def compile(self, key: str, lowered):
        """`lowered` compiled, and stored under `key`. On XLA:CPU (jaxlib 0.10) an executable that JAX
        took from its own persistent cache serializes again without some of its kernels, and that copy
        fails at its first run ("Function add_multiply_fusion not found"). That happens after an
        upgrade that changed the step sources (so their keys here) but not the programs. Such a step
        is compiled once more under an option that changes only JAX's cache key (it disables a pass
        that does not exist), and that complete executable is stored, so the next start loads it."""
        hits = getattr(_jax_cache_hits, "count", 0)
        executable = lowered.compile()
        self.compiles += 1
        if getattr(_jax_cache_hits, "count", 0) != hits and self.directory is not None:
            hits = getattr(_jax_cache_hits, "count", 0)
            executable = lowered.compile(compiler_options={"xla_disable_hlo_passes": f"kiln-fresh-{key[:16]}"})
        if getattr(_jax_cache_hits, "count", 0) == hits:
            self.save(key, executable)
        return executable

    def save(self, key: str, executable) -> None:
        if self.directory is None:
            return
        from jax.experimental.serialize_executable import serialize

        try:
            devices = [d.id for d in executable.runtime_executable().local_devices()]
            blob = pickle.dumps((*serialize(executable), devices))
        except Exception as exc:  # a backend that cannot serialize still serves; it just compiles at start
            log.warning("step executable could not be serialized (%s)", exc)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomic(self.directory / f"{key}.bin", blob)
        self.saves += 1
