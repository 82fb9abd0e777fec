"""CPU kernels for what a step's XLA:CPU program leaves slow, built from source on the machine
that runs them and called from the compiled step as XLA FFI custom calls (`cpu_kernels.cc`):

- paged attention for tiles of a few query rows (`ATTENTION_TARGET`): XLA's path gathers every tile's
  blocks chunk by chunk up to the step's longest context in a chain of small ops; the kernel reads each
  tile's own blocks through its block table, only as far as its queries reach (a 32-row step at 512
  tokens of context 1.5x faster, a one-row step 1.1-1.25x);
- products with quantized weights: int4 layers (`INT4_TARGET`) and an int8 table as the LM head
  (`INT8_TABLE_TARGET`, the default model's Q8_0 embedding). XLA:CPU multiplies by a quantized
  weight in two steps: a fusion writes the weight's float32 copy, then a library matmul reads it
  back. With one to a few rows that copy is nearly all of the work: the default model's one-row
  decode step writes and reads about 320 MB of float32 weights per token for a file of 94 MB. For a
  few rows the kernels stream the levels and their float16 scales once and keep their sums in
  registers (the default model's one-row step 1.9x faster); for more, each thread dequantizes a
  panel of the weight (or of the table's rows) into its own cache and multiplies every row by it
  (the projections 1.1-2x XLA's path from 8 to 512 rows, a 32-row decode step 1.2x).

With AVX-512 they run vectorized, elsewhere in portable loops (there the products take only a few
rows: `product_max_rows`). XLA's path stays for prefill's attention, where its own ops are as fast,
for gradients (a gradient through a product kernel is taken through XLA's path: `kiln.models.quant`),
and on every other backend.

The kernels are compiled once per machine, source and jaxlib with the system's C++ compiler (`CXX`,
else `c++`; about 5 s) into a cache directory, and registered with XLA for the CPU platform. Where
that fails (no compiler, another architecture's build error) the failure is logged once and XLA's
path serves: `[engine] cpu_kernels = off` skips the build. A step's executables record whether the
kernels were in them (`state`), so a stored step is never loaded where they are not registered.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

log = logging.getLogger("kiln.kernels")

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
INT4_TARGET = "kiln_int4_matmul"
INT8_TABLE_TARGET = "kiln_int8_table_logits"
ATTENTION_TARGET = "kiln_paged_attention"
ATTENTION_MAX_ROWS = 16  # query rows of a (KV head, tile) the attention kernel takes (a decode step's few)
ATTENTION_MAX_BLOCK = 256  # keys of a KV block it takes
STREAMING_MAX_ROWS = 4  # rows the streaming loops take (beyond four, XLA's path is as fast or faster than them)

_lock = threading.Lock()
_ready: bool | None = None  # None: not tried in this process


def wanted(setting: str, iree: bool, mesh: object | None) -> bool:
    """Whether the kernels are for this process's steps: `[engine] cpu_kernels = auto`, XLA's CPU
    backend (not an IREE route) and one device (a tensor-parallel mesh's steps use XLA's paths).
    `enable()` then says whether they could be built."""
    return setting == "auto" and not iree and mesh is None and jax.default_backend() == "cpu"


def enable() -> bool:
    """Builds (or finds) and registers the kernels for the CPU; True once they can be used. Only the
    first call in a process does the work."""
    global _ready
    with _lock:
        if _ready is None:
            _ready = _build_and_register()
        return _ready


def state() -> str:
    """The kernels' build in this process (part of a stored executable's key: a step that calls the
    kernel is never loaded where another source of it, or none, is registered)."""
    return f"kernels:{_source_digest()}" if _ready else "none"


@functools.cache
def _source_digest() -> str:  # (read once: every stored step's key asks for it)
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def _cache_dir() -> Path:
    jax_cache = jax.config.jax_compilation_cache_dir
    if jax_cache:
        return Path(jax_cache) / "kiln-kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "kiln" / "kernels"


@functools.cache
def cpu_flags() -> str:
    """This CPU's feature flags (/proc/cpuinfo), what code built for it depends on: Kiln's kernels
    and XLA's stored executables."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def product_max_rows() -> int | None:
    """Rows of x the product kernels take: any number where they are built with AVX-512 (their panels
    beat XLA's path from 5 to 512 rows), else the few their streaming loops take."""
    return None if "avx512f" in cpu_flags().split() else STREAMING_MAX_ROWS


def compiler() -> str | None:
    """The C++ compiler the kernels are built with: `CXX`, else the first of c++, g++, clang++ found."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _build_and_register() -> bool:
    compiler_path = compiler()
    if compiler_path is None:
        log.warning("CPU kernels off: no C++ compiler found (set CXX); attention and quantized products use "
                    "XLA's paths")
        return False
    key = hashlib.sha256("\n".join([_source_digest(), jaxlib.__version__, compiler_path, platform.machine(),
                                    cpu_flags()]).encode()).hexdigest()[:24]
    library = _cache_dir() / f"kiln_kernels_{key}.so"
    try:
        if not library.is_file():
            _compile(compiler_path, library)
        import ctypes

        handle = ctypes.cdll.LoadLibrary(str(library))
        jax.ffi.register_ffi_target(INT4_TARGET, jax.ffi.pycapsule(handle.KilnInt4Matmul), platform="cpu")
        jax.ffi.register_ffi_target(INT8_TABLE_TARGET, jax.ffi.pycapsule(handle.KilnInt8TableLogits), platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(handle.KilnPagedAttention), platform="cpu")
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning("CPU kernels off: %s; attention and quantized products use XLA's paths",
                    str(exc).strip().splitlines()[-1][:300])
        return False
    log.info("CPU kernels: decode attention, int4 and int8-table products (%s)", library.name)
    return True


def _compile(compiler: str, library: Path, arch: tuple[str, ...] = ("-march=native",)) -> None:
    """Compiles the kernels into `library`, whole or not at all, for the CPU `arch` flags name (this
    one's: its widest vectors)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        out = Path(tmp) / library.name
        cmd = [compiler, "-O3", *arch, "-std=c++17", "-shared", "-fPIC", "-w",
               f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise subprocess.SubprocessError(f"{Path(compiler).name} failed: {done.stderr.strip() or done.returncode}")
        os.replace(out, library)
