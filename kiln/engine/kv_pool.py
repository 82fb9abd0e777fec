"""How many blocks the paged KV pool gets, and why. (On the CPU the pool's unwritten pages are left
to the OS: host_memory.py.)

The pool is sized from `[engine] kv_cache_memory` unless `[engine] num_kv_blocks` names a count:
- bytes (`"8GiB"`, `"536870912"`), or a fraction (`"0.5"`) of the memory free once the weights and
  adapter slots are placed (the device's allocator on an accelerator, the host's available memory
  on the CPU);
- `auto`: on an accelerator 0.9 of that free memory, as vLLM's `gpu_memory_utilization`; on the
  CPU a modest share of the host (at most 2 GiB): its pages are only taken as blocks are written,
  so the pool's resident size grows with the traffic, not with the setting.
`auto` never exceeds what `max_num_seqs` sequences of the longest length can fill. A budget that
cannot hold one longest sequence is a startup error.
"""

from __future__ import annotations

import dataclasses

import jax

from kiln.engine.host_memory import free_bytes, meminfo
from kiln.errors import ConfigError

ACCELERATOR_AUTO_FRACTION = 0.9
CPU_AUTO_BYTES = 2 << 30  # ...or an eighth of the host's memory, whichever is less
BLOCK_ROUNDING = 64  # budget-sized pools round down to this many blocks, so that a start's step shapes repeat


@dataclasses.dataclass(frozen=True)
class KVPoolSize:
    blocks: int  # block 0 included (the padding target)
    block_size: int  # tokens per block
    block_bytes: int  # every layer's K and V of one block
    reason: str

    @property
    def tokens(self) -> int:
        return (self.blocks - 1) * self.block_size

    def to_json(self) -> dict:
        return {"blocks": self.blocks, "block_size": self.block_size, "tokens": self.tokens,
                "bytes": self.blocks * self.block_bytes, "block_bytes": self.block_bytes, "reason": self.reason}


def block_bytes(cfg, block_size: int, kv_dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * jax.numpy.dtype(kv_dtype).itemsize


def free_memory(on_host: bool) -> tuple[int, str]:
    """Bytes free for the pool now, and where the number comes from."""
    free, device_kind = free_bytes(on_host)
    return free, f"free {device_kind} memory" if device_kind else "available host memory"


def size_pool(cfg, config, kv_dtype, max_len: int, on_host: bool) -> KVPoolSize:
    """The pool for these settings. `max_len`: the longest sequence the engine must hold (the
    configured max_model_len, else the model's positions); `on_host`: the pool lives in host memory."""
    bs = config.block_size
    per_block = block_bytes(cfg, bs, kv_dtype)
    if config.num_kv_blocks > 0:
        return KVPoolSize(config.num_kv_blocks, bs, per_block, "[engine] num_kv_blocks")
    one_sequence = -(-max_len // bs) + 1
    setting = config.kv_cache_memory
    if setting == "auto":
        if on_host or jax.devices()[0].platform == "cpu":
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
        free, source = free_memory(on_host)
        budget = int(free * float(setting))
        blocks = _rounded(budget // per_block)
        why = f"[engine] kv_cache_memory = {setting} of {_size(free)} {source}"
    else:
        budget = int(setting)
        blocks = budget // per_block
        why = f"[engine] kv_cache_memory = {_size(budget)}"
    if blocks < one_sequence:
        raise ConfigError(
            f"[engine] kv_cache_memory: a KV pool of {_size(budget)} ({why}) holds {blocks} blocks of "
            f"{_size(per_block)}, but one {max_len}-token sequence needs {one_sequence} blocks "
            f"({_size(one_sequence * per_block)}); raise kv_cache_memory or lower [engine] max_model_len")
    return KVPoolSize(blocks, bs, per_block, why)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _rounded(blocks: int) -> int:
    return blocks - blocks % BLOCK_ROUNDING if blocks >= 2 * BLOCK_ROUNDING else blocks
