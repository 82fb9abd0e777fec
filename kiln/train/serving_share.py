"""How a fine-tuning job shares the accelerator's memory with serving: the bytes serving holds, and
the KV pool a job shrinks before it trains and grows back after. (Its time is shared slice by
slice: see Ownership.training_slice.)"""

from __future__ import annotations

from collections.abc import Callable

from kiln.engine.lora_slots import slot_modules
from kiln.errors import InsufficientMemory
from kiln.train import memory

KV_SHRINK_ATTEMPTS = 1200  # every 0.5 s: ten minutes for running requests to release KV blocks


class ServingShare:
    def __init__(self, settings, engine):
        self.settings, self.engine = settings, engine
        self.kv_blocks = engine.config.num_kv_blocks  # the configured pool, restored after a shrink
        self.kv_block_bytes = engine.kv_block_bytes
        self._fixed_bytes = {"weights": memory.tree_bytes(engine.model.params),
                             "adapter_slots": engine.config.max_loras * memory.lora_bytes(
                                 engine.model.config, engine.config.max_lora_rank,
                                 slot_modules(engine.config.lora_experts))}

    @property
    def serving_bytes(self) -> dict:
        """What serving holds now: weights, the KV pool (at its current size), adapter slots."""
        kv_blocks = self.engine.snapshot["kv_blocks_total"] + 1
        return {"weights": self._fixed_bytes["weights"], "kv_pool": kv_blocks * self.kv_block_bytes,
                "adapter_slots": self._fixed_bytes["adapter_slots"]}

    def shrink_kv(self, blocks: int, give_up: Callable[[], bool], event: Callable[[str], None]) -> bool:
        """A job's planned KV shrink. Raises InsufficientMemory if running requests hold too many
        blocks for ten minutes; False if `give_up()` (a cancel, pause or shutdown) ended the wait."""
        event(f"Shrinking the KV pool from {self.kv_blocks} to {blocks} blocks to make room for training")
        if self.engine.resize_kv(blocks, KV_SHRINK_ATTEMPTS, give_up):
            return True
        if give_up():
            return False
        raise InsufficientMemory(
            f"running requests kept holding more than {blocks - 1} KV blocks; the pool could not shrink")

    def grow_kv(self, event: Callable[[str], None]) -> None:
        self.engine.resize_kv(self.kv_blocks)
        event(f"KV pool grown back to {self.kv_blocks} blocks")
