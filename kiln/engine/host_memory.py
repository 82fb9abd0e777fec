"""The process's memory: what is free for new allocations (`free_bytes`, on the device or the host),
and on Linux handing host pages back to the OS and reading what is resident.

- `release_pages`: the CPU KV pool is allocated zero-filled and its pages are given back at once
  (madvise DONTNEED: they read as zeros again and take memory only once a step writes a block), so
  the pool's resident size follows the KV requests wrote, not its budget.
- `resident_bytes`: how much of an array is in memory (mincore), for /v1/config.
- `trim_heap`: glibc keeps what a start frees (the host copies of the weights, compiler scratch) in
  its per-thread arenas; `malloc_trim` hands the free pages back once the start is over.
Elsewhere (macOS, musl) these do nothing: MADV_DONTNEED need not zero pages there.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys

import jax

_MADV_DONTNEED = 4
LINUX = sys.platform.startswith("linux")


def free_bytes(on_host: bool = False) -> tuple[int, str | None]:
    """Bytes free now, and the device kind whose allocator says so: an accelerator's stats, or
    (None) the host's available memory (the CPU, or `on_host`)."""
    device = jax.local_devices()[0]
    stats = None if on_host or device.platform == "cpu" else device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)), device.device_kind
    return meminfo()["MemAvailable"], None


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    with open("/proc/meminfo") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}


def _buffers(arrays) -> list:
    """The arrays, each sharded one as its shards (one buffer per device)."""
    return [s.data for x in arrays for s in x.addressable_shards] if any(
        isinstance(x, jax.Array) and len(x.devices()) > 1 for x in arrays) else list(arrays)


def _on_host(x) -> bool:
    """A live JAX array in CPU memory (an IREE route's device arrays and accelerator arrays are not)."""
    return isinstance(x, jax.Array) and not x.is_deleted() and {d.platform for d in x.devices()} == {"cpu"}


def release_pages(arrays) -> int:
    """Hands the whole pages inside these zero-filled CPU arrays back to the OS (they read as zeros
    again, and take memory only once written); returns the bytes released. Only for buffers of
    private anonymous memory, which XLA:CPU's are, and only while they hold nothing but zeros."""
    released = 0
    if not LINUX:
        return 0
    for x in _buffers(arrays):
        if not _on_host(x):
            continue
        start = x.unsafe_buffer_pointer()
        lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = (start + x.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo and _libc().madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
            released += hi - lo
    return released


def resident_bytes(arrays) -> int | None:
    """Bytes of these CPU arrays' pages that are in memory (mincore), None where that cannot be read
    (not Linux, not all JAX arrays in CPU memory): the KV pool's share of the process's resident memory."""
    if not LINUX or not all(_on_host(x) for x in arrays):
        return None
    total = 0
    for x in _buffers(arrays):
        try:
            start, size = x.unsafe_buffer_pointer(), x.nbytes
        except (RuntimeError, ValueError):  # deleted, or not a single-device buffer
            return None
        lo = start // mmap.PAGESIZE * mmap.PAGESIZE
        pages = -(-(start + size - lo) // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        if _libc().mincore(lo, pages * mmap.PAGESIZE, vec) != 0:  # unmapped since: the pool was replaced
            return None
        # whole pages, of which the first and last may hold other data too: at most the array's bytes
        total += min(size, sum(b & 1 for b in bytes(vec)) * mmap.PAGESIZE)
    return total


def trim_heap() -> bool:
    """Hands the free pages of glibc's heaps back to the OS; False where there is no glibc."""
    try:
        return LINUX and bool(_libc().malloc_trim(0))
    except AttributeError:  # another C library
        return False


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc
