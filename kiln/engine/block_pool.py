"""KV block pool with reference counts and a hash-chained prefix cache (vLLM v1's design).

A full block's hash chains its parent's hash, its tokens and the request's extra keys
(adapter, cache salt), so equal hashes mean equal KV for the whole prefix. Freed blocks
stay cached (and findable by hash) until the allocator reuses them, oldest first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence

NONE_HASH = 0


def hash_block(parent: int | None, tokens: Sequence[int], extra: tuple = ()) -> int:
    """64-bit chained block hash (the form vLLM's KV events carry)."""
    h = hashlib.sha256()
    h.update(struct.pack(">Q", parent or NONE_HASH))
    h.update(struct.pack(f">{len(tokens)}i", *tokens))
    for key in extra:
        h.update(b"\x00" + repr(key).encode())
    return int.from_bytes(h.digest()[:8], "big")


def block_hashes(tokens: Sequence[int], block_size: int, extra: tuple = (), start: int = 0,
                 parent: int | None = None) -> list[int]:
    """Hashes of the full blocks of `tokens` from block index `start` on, chained from `parent`."""
    out = []
    for b in range(start, len(tokens) // block_size):
        parent = hash_block(parent, tokens[b * block_size : (b + 1) * block_size], extra)
        out.append(parent)
    return out


@dataclasses.dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


@dataclasses.dataclass
class PoolStats:
    prefix_queries: int = 0  # tokens looked up in the prefix cache
    prefix_hits: int = 0  # tokens found


class BlockPool:
    """Fixed pool of KV blocks. Block 0 is reserved as the padding target of block tables."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 on_stored: Callable | None = None, on_removed: Callable | None = None):
        if num_blocks < 2:
            raise ValueError("need at least 2 KV blocks")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in eviction order (least recently freed first); block 0 never enters
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.stats = PoolStats()
        self.on_stored = on_stored  # (hashes, parent_hash, tokens) -> None, for KV events
        self.on_removed = on_removed  # (hashes) -> None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) - 1  # usable

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of `hashes` (not yet referenced)."""
        found = []
        if self.enable_caching:
            for h in hashes:
                bid = self.cached.get(h)
                if bid is None:
                    break
                found.append(bid)
        return found

    def record_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.stats.prefix_queries += queried_tokens
        self.stats.prefix_hits += hit_tokens

    def touch(self, block_ids: Sequence[int]) -> None:
        """References cached blocks (prefix hits), taking them off the free list."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                self.free.pop(bid, None)
            block.ref_count += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise MemoryError(f"need {n} KV blocks, {len(self.free)} free")
        out = []
        evicted = []
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            block = self.blocks[bid]
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) == bid:
                    del self.cached[block.block_hash]
                    evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_count = 1
            out.append(bid)
        if evicted and self.on_removed:
            self.on_removed(evicted)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drops one reference from each block; unreferenced blocks become free (tail last)."""
        for bid in reversed(block_ids):  # the tail of a sequence is evicted first
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} released twice"
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free[bid] = None
                    self.free.move_to_end(bid, last=False)  # uncached: reuse first
                else:
                    self.free[bid] = None

    def cache_blocks(self, block_ids: Sequence[int], hashes: Sequence[int], tokens: Sequence[int],
                     parent: int | None, lora_name: str | None = None) -> None:
        """Registers newly filled full blocks (in sequence order) under their chained hashes.

        tokens are the blocks' tokens (len(block_ids) * block_size); parent is the hash of
        the block before the first one. Emits one BlockStored per run of newly cached blocks.
        """
        if not self.enable_caching:
            return
        run: list[int] = []
        run_start = 0
        B = self.block_size
        for i, (bid, h) in enumerate(zip(block_ids, hashes, strict=True)):
            block = self.blocks[bid]
            fresh = block.block_hash is None and h not in self.cached
            if fresh:
                block.block_hash = h
                self.cached[h] = bid
                if not run:
                    run_start = i
                run.append(h)
            if run and (not fresh or i == len(block_ids) - 1):
                if self.on_stored:
                    run_parent = parent if run_start == 0 else hashes[run_start - 1]
                    run_tokens = list(tokens[run_start * B : (run_start + len(run)) * B])
                    self.on_stored(list(run), run_parent, run_tokens, lora_name)
                run = []

    def shrink(self, num_blocks: int) -> dict[int, int] | None:
        """Drops the blocks from id `num_blocks` on (dynamic KV resize). Cached blocks go first
        (their hashes are evicted); blocks that requests hold move to free blocks below the cut,
        cached ones among those evicted last. Returns the moves {old id: new id}, whose KV the
        caller must copy and whose holders it must remap; None when the blocks in use would not
        fit below the cut (nothing changes)."""
        held = [b for b in range(num_blocks, len(self.blocks)) if self.blocks[b].ref_count > 0]
        targets = [b for b in self.free if b < num_blocks][: len(held)]  # in eviction order
        if num_blocks < 2 or len(targets) < len(held):
            return None
        evicted = [self._forget(b) for b in range(num_blocks, len(self.blocks)) if b in self.free]
        moves = {}
        for src, dst in zip(held, targets, strict=True):
            evicted.append(self._forget(dst))
            old, new = self.blocks[src], self.blocks[dst]
            new.ref_count, new.block_hash = old.ref_count, old.block_hash
            if old.block_hash is not None and self.cached.get(old.block_hash) == src:
                self.cached[old.block_hash] = dst
            moves[src] = dst
        del self.blocks[num_blocks:]
        evicted = [h for h in evicted if h is not None]
        if evicted and self.on_removed:
            self.on_removed(evicted)
        return moves

    def grow(self, num_blocks: int) -> None:
        """Adds empty blocks up to `num_blocks` (the pool growing back after a shrink)."""
        for bid in range(len(self.blocks), num_blocks):
            self.blocks.append(Block(bid))
            self.free[bid] = None
            self.free.move_to_end(bid, last=False)  # empty: reuse before cached blocks

    def _forget(self, bid: int) -> int | None:
        """Takes a free block off the free list and out of the prefix cache; its evicted hash."""
        del self.free[bid]
        block, evicted = self.blocks[bid], None
        if block.block_hash is not None and self.cached.get(block.block_hash) == bid:
            del self.cached[block.block_hash]
            evicted = block.block_hash
        block.block_hash = None
        return evicted

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached hashes; only possible when no block is referenced."""
        if len(self.free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
