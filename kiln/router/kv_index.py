"""The prefix index of one worker set: which workers hold which KV blocks.

Blocks are keyed by the router's own chained hash of their content, never by the engine's block
hashes (engines hash differently, and the router must key a new prompt without asking one):

    key(block i) = hash((key(block i-1), tuple(tokens of block i), lora))    key(block -1) = None

with Python's ``hash()`` of a tuple, which is fast and stable within one process (the keys never
leave it). Keys are 64-bit, so two different prefixes collide with negligible probability; a
collision could only overstate one prefix hit. ``lora`` is the adapter name (None for the base
model), so the same tokens under different adapters are different blocks.

Each worker keeps a map from its engine's block hashes to router keys: a BlockStored event places
its blocks after the parent block's key (looked up through that map) and a BlockRemoved finds the
keys to drop. Each key maps to a bitmask of the workers holding it, so that a match walks the
prompt's keys once, dropping a worker at its first miss and stopping when none is left.

Thread-safe: one lock; ingest threads write, the picker reads.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

from kiln.router.kv_wire import BlockHash

Key = int


def block_keys(
    token_ids: Sequence[int], block_size: int, lora: Hashable = None, parent: Key | None = None
) -> list[Key]:
    """The chained keys of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    keys = []
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[i : i + block_size]), lora))
        keys.append(parent)
    return keys


class KVIndex:
    """Router keys -> workers, for one KV block size. Workers are named by ``worker_id_num``."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, not {block_size}")
        self.block_size = block_size
        self._lock = threading.Lock()
        self._holders: dict[Key, int] = {}  # key -> bitmask of worker slots
        self._slot: dict[int, int] = {}  # worker -> slot (its bit is 1 << slot)
        self._worker_at: dict[int, int] = {}  # slot -> worker
        self._all = 0  # bits of every registered worker
        self._engine: dict[int, dict[BlockHash, Key]] = {}  # worker -> its engine hashes -> keys
        # worker -> key -> how many of its engine hashes map to that key (an engine may hash the
        # same tokens apart, e.g. under a cache salt; the worker holds the key until the last goes)
        self._refs: dict[int, dict[Key, int]] = {}

    # ---- queries -------------------------------------------------------------------------------

    def prompt_keys(self, token_ids: Sequence[int], lora_name: str | None = None) -> list[Key]:
        return block_keys(token_ids, self.block_size, lora_name)

    def match(self, token_ids: Sequence[int], lora_name: str | None = None) -> dict[int, int]:
        """Every registered worker -> how many leading full blocks of the prompt it holds."""
        bs = self.block_size
        n = len(token_ids) // bs
        with self._lock:
            result = dict.fromkeys(self._slot, 0)
            alive, holders, worker_at = self._all, self._holders, self._worker_at
            key = None
            depth = 0
            while alive and depth < n:
                key = hash((key, tuple(token_ids[depth * bs : (depth + 1) * bs]), lora_name))
                held = holders.get(key, 0) & alive
                dropped = alive ^ held
                while dropped:  # workers whose run of hits ends here
                    low = dropped & -dropped
                    result[worker_at[low.bit_length() - 1]] = depth
                    dropped ^= low
                alive = held
                depth += 1
            while alive:  # held the whole prompt
                low = alive & -alive
                result[worker_at[low.bit_length() - 1]] = n
                alive ^= low
            return result

    def size(self) -> int:
        """Distinct blocks held by any worker."""
        with self._lock:
            return len(self._holders)

    def blocks_of(self, worker: int) -> int:
        """Distinct blocks ``worker`` holds."""
        with self._lock:
            return len(self._refs.get(worker, ()))

    def workers(self) -> list[int]:
        with self._lock:
            return list(self._slot)

    # ---- updates -------------------------------------------------------------------------------

    def add_worker(self, worker: int) -> None:
        """Register ``worker`` (match() then reports it, 0 while it holds nothing). Idempotent."""
        with self._lock:
            self._register(worker)

    def remove_worker(self, worker: int) -> None:
        """Forget ``worker`` and its blocks."""
        with self._lock:
            if worker not in self._slot:
                return
            self._clear(worker)
            slot = self._slot.pop(worker)
            del self._worker_at[slot], self._engine[worker], self._refs[worker]
            self._all &= ~(1 << slot)

    def store(
        self,
        worker: int,
        engine_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        lora: Hashable = None,
    ) -> bool:
        """Place blocks ``worker`` stored, chained after its block ``parent_hash`` (None: a prompt's
        first block). False, and nothing placed, when that parent is unknown to the index."""
        bs = self.block_size
        if len(token_ids) != len(engine_hashes) * bs:
            raise ValueError(f"{len(token_ids)} tokens for {len(engine_hashes)} block(s) of {bs}")
        with self._lock:
            bit = 1 << self._register(worker)
            emap, refs = self._engine[worker], self._refs[worker]
            if parent_hash is None:
                key = None
            else:
                key = emap.get(parent_hash)
                if key is None:
                    return False
            for i, h in enumerate(engine_hashes):
                key = hash((key, tuple(token_ids[i * bs : (i + 1) * bs]), lora))
                old = emap.get(h)
                if old == key:
                    continue
                if old is not None:  # the engine reused a hash for other content
                    self._unref(worker, bit, old)
                emap[h] = key
                count = refs.get(key, 0)
                refs[key] = count + 1
                if not count:
                    self._holders[key] = self._holders.get(key, 0) | bit
            return True

    def remove(self, worker: int, engine_hashes: Sequence[BlockHash]) -> int:
        """Drop blocks ``worker`` evicted; returns how many of the hashes were known."""
        with self._lock:
            emap = self._engine.get(worker)
            if emap is None:
                return 0
            bit = 1 << self._slot[worker]
            known = 0
            for h in engine_hashes:
                key = emap.pop(h, None)
                if key is not None:
                    self._unref(worker, bit, key)
                    known += 1
            return known

    def clear(self, worker: int) -> None:
        """``worker`` holds nothing (it stays registered)."""
        with self._lock:
            if worker in self._slot:
                self._clear(worker)

    # ---- under the lock ------------------------------------------------------------------------

    def _register(self, worker: int) -> int:
        slot = self._slot.get(worker)
        if slot is None:
            slot = next(s for s in range(len(self._slot) + 1) if s not in self._worker_at)  # lowest free bit
            self._slot[worker], self._worker_at[slot] = slot, worker
            self._engine[worker], self._refs[worker] = {}, {}
            self._all |= 1 << slot
        return slot

    def _unref(self, worker: int, bit: int, key: Key) -> None:
        refs = self._refs[worker]
        count = refs[key] - 1
        if count:
            refs[key] = count
            return
        del refs[key]
        self._drop_holder(key, bit)

    def _drop_holder(self, key: Key, bit: int) -> None:
        held = self._holders[key] & ~bit
        if held:
            self._holders[key] = held
        else:
            del self._holders[key]

    def _clear(self, worker: int) -> None:
        bit = 1 << self._slot[worker]
        for key in self._refs[worker]:
            self._drop_holder(key, bit)
        self._refs[worker].clear()
        self._engine[worker].clear()
