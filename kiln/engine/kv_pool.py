"""How many blocks the paged KV pool gets, and why. (On the CPU the pool's unwritten pages are left
to the OS: host_memory.py.)

The pool is sized from `[engine] kv_cache_memory` unless `[engine] num_kv_blocks` names a count:
- bytes (`"8GiB"`, `"536870912"`), or a fraction (`"0.5"`) of the memory free once the weights and
  adapter slots are placed (the device's allocator on an accelerator, the host's available memory
  on the CPU);
- `auto`: on an accelerator 0.9 of that free memory, as vLLM's `gpu_memory_utilization`; on the
  CPU a modest share of the host (at most 2 GiB): its pages are only taken as blocks are written,
  so the pool's resident size grows with the traffic, not with the setting. On a Vulkan device
  (an IREE route), which reports its memory heap but not what is free, half of 0.9 of the heap
  once the weights and adapter slots are placed: the other half is for the steps' temporaries
  (a prefill's gathered context, a bucket gate's own pool), and no more blocks than keep each of
  its K and V arrays within the largest buffer a shader may bind (lavapipe: a 2 GiB heap, 128 MiB
  buffers); a pool set larger than that buffer is a startup error.
`auto` never exceeds what `max_num_seqs` sequences of the longest length can fill. A budget that
cannot hold one longest sequence is a startup error.

The pool's values are the model's float type, or with `[engine] kv_cache_dtype = bfloat16` bfloat16
for a float32 model (`pool_dtype`): half the bytes per block, so twice the tokens in a budget, and
half the bytes attention gathers per key. Keys and values are rounded to bfloat16 when written;
attention still computes in float32.
"""

from __future__ import annotations

import dataclasses

import jax

from kiln.engine.host_memory import free_bytes, meminfo
from kiln.errors import ConfigError

ACCELERATOR_AUTO_FRACTION = 0.9
CPU_AUTO_BYTES = 2 << 30  # ...or an eighth of the host's memory, whichever is less
DEVICE_POOL_SHARE = 0.5  # of a Vulkan device's heap left after the weights (the rest: temporaries)
BLOCK_ROUNDING = 64  # budget-sized pools round down to this many blocks, so that a start's step shapes repeat


def pool_dtype(setting: str, model_dtype, on_iree: bool = False):
    """The float type of the pool's values for `[engine] kv_cache_dtype`: the model's for auto, else
    bfloat16, which only a float32 model on an XLA route takes (a 16-bit model's pool is already 16-bit,
    and `decoder.kv_float_dtype` reads a float16 model's 16-bit pool as float16)."""
    model_dtype = jax.numpy.dtype(model_dtype)
    if setting == "auto" or model_dtype == jax.numpy.bfloat16:
        return model_dtype
    if model_dtype != jax.numpy.float32:
        raise ConfigError(f"[engine] kv_cache_dtype = {setting}: the model is {model_dtype.name}, and its KV pool "
                          f"holds {model_dtype.name} already; use auto")
    if on_iree:
        raise ConfigError(f"[engine] kv_cache_dtype = {setting} runs on XLA routes only; use auto on an IREE route")
    return jax.numpy.dtype(setting)


@dataclasses.dataclass(frozen=True)
class KVPoolSize:
    blocks: int  # block 0 included (the padding target)
    block_size: int  # tokens per block
    block_bytes: int  # every layer's K and V of one block
    reason: str
    dtype: str  # the float type of its values (`pool_dtype`)

    @property
    def tokens(self) -> int:
        return (self.blocks - 1) * self.block_size

    def to_json(self) -> dict:
        return {"blocks": self.blocks, "block_size": self.block_size, "tokens": self.tokens,
                "bytes": self.blocks * self.block_bytes, "block_bytes": self.block_bytes, "dtype": self.dtype,
                "reason": self.reason}


def block_bytes(cfg, block_size: int, kv_dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * jax.numpy.dtype(kv_dtype).itemsize


@dataclasses.dataclass(frozen=True)
class DeviceHeap:
    """A device that reports its memory but not what is free (an IREE Vulkan device): its heap, and
    what the engine places there before the pool (weights, adapter slots)."""

    memory: int
    placed: int
    max_buffer: int  # the largest buffer a step may bind: each of the pool's K and V arrays is one

    @property
    def free(self) -> int:
        return max(0, self.memory - self.placed)


def free_memory(on_host: bool, heap: DeviceHeap | None = None) -> tuple[int, str]:
    """Bytes free for the pool now, and where the number comes from."""
    if heap is not None:
        return heap.free, f"device memory (a {_size(heap.memory)} heap less {_size(heap.placed)} of weights)"
    free, device_kind = free_bytes(on_host)
    return free, f"free {device_kind} memory" if device_kind else "available host memory"


def size_pool(cfg, config, kv_dtype, max_len: int, on_host: bool, heap: DeviceHeap | None = None) -> KVPoolSize:
    """The pool for these settings. `max_len`: the longest sequence the engine must hold (the
    configured max_model_len, else the model's positions); `on_host`: the pool lives in host memory;
    `heap`: the pool lives on a device that reports only its heap size."""
    bs = config.block_size
    per_block = block_bytes(cfg, bs, kv_dtype)
    dtype = jax.numpy.dtype(kv_dtype).name
    # the most blocks whose K (and V) array fits the largest buffer the device binds
    most = heap.max_buffer // (per_block // 2) if heap is not None else None
    if config.num_kv_blocks > 0:
        if most is not None and config.num_kv_blocks > most:
            raise ConfigError(
                f"[engine] num_kv_blocks: {config.num_kv_blocks} blocks make K and V arrays of "
                f"{_size(config.num_kv_blocks * (per_block // 2))} each, and the device binds at most "
                f"{_size(heap.max_buffer)} as one buffer ({most} blocks)")
        return KVPoolSize(config.num_kv_blocks, bs, per_block, "[engine] num_kv_blocks", dtype)
    one_sequence = -(-max_len // bs) + 1
    setting = config.kv_cache_memory
    if setting == "auto":
        if heap is not None:
            free, source = free_memory(on_host, heap)
            budget = int(free * ACCELERATOR_AUTO_FRACTION * DEVICE_POOL_SHARE)
            why = (f"auto: {DEVICE_POOL_SHARE} of {ACCELERATOR_AUTO_FRACTION} of {_size(free)} {source}; the rest "
                   f"is for the steps' temporaries")
        elif on_host or jax.devices()[0].platform == "cpu":
            budget = min(CPU_AUTO_BYTES, meminfo()["MemTotal"] // 8)
            why = f"auto: {_size(budget)} of host memory (pages are taken as blocks are written)"
        else:
            free, source = free_memory(on_host)
            budget = int(free * ACCELERATOR_AUTO_FRACTION)
            why = f"auto: {ACCELERATOR_AUTO_FRACTION} of {_size(free)} {source}"
        every_sequence = config.max_num_seqs * (one_sequence - 1) + 1
        blocks = min(_rounded(budget // per_block), every_sequence)
        if blocks == every_sequence:
            why += f"; capped at {config.max_num_seqs} sequences of {max_len} tokens"
    elif "." in setting:
        free, source = free_memory(on_host, heap)
        budget = int(free * float(setting))
        blocks = _rounded(budget // per_block)
        why = f"[engine] kv_cache_memory = {setting} of {_size(free)} {source}"
    else:
        budget = int(setting)
        blocks = budget // per_block
        why = f"[engine] kv_cache_memory = {_size(budget)}"
    if most is not None and blocks > most:
        if setting != "auto" and "." not in setting:
            raise ConfigError(
                f"[engine] kv_cache_memory: a KV pool of {blocks} blocks ({why}) does not fit the device's largest "
                f"buffer: its K and V arrays are {_size(blocks * (per_block // 2))} each, and the device binds at most "
                f"{_size(heap.max_buffer)} (at most {most} blocks); lower kv_cache_memory")
        blocks = _rounded(most)
        why += f"; capped at {blocks} blocks, as the device binds at most {_size(heap.max_buffer)} as one buffer"
        if not config.max_model_len:  # the model's positions were only a default: contexts get shorter
            why += f", which holds contexts of up to {(blocks - 1) * bs} tokens"
            one_sequence = min(one_sequence, blocks)
    if blocks < one_sequence:
        raise ConfigError(
            f"[engine] kv_cache_memory: a KV pool of {_size(budget)} ({why}) holds {blocks} blocks of "
            f"{_size(per_block)}, but one {max_len}-token sequence needs {one_sequence} blocks "
            f"({_size(one_sequence * per_block)}); raise kv_cache_memory or lower [engine] max_model_len")
    return KVPoolSize(blocks, bs, per_block, why, dtype)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _rounded(blocks: int) -> int:
    return blocks - blocks % BLOCK_ROUNDING if blocks >= 2 * BLOCK_ROUNDING else blocks
