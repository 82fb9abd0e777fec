"""How a fine-tuning job shares the accelerator with serving: the bytes serving holds, the KV
pool a job shrinks before it trains and grows back after, and the time it leaves to serving
after each training step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kiln.errors import InsufficientMemory
from kiln.models.lora import TARGET_MODULES
from kiln.train import memory

KV_SHRINK_ATTEMPTS = 1200  # every 0.5 s: ten minutes for running requests to release KV blocks


class ServingShare:
    def __init__(self, settings, engine):
        self.settings, self.engine = settings, engine
        self.kv_blocks = engine.config.num_kv_blocks  # the configured pool, restored after a shrink
        self.kv_block_bytes = engine.kv_block_bytes
        self._fixed_bytes = {"weights": memory.tree_bytes(engine.model.params),
                             "adapter_slots": engine.config.max_loras * memory.lora_bytes(
                                 engine.model.config, engine.config.max_lora_rank, TARGET_MODULES)}

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

    def serving_busy(self) -> bool:
        snapshot = self.engine.snapshot
        return snapshot["running"] + snapshot["waiting"] > 0 or self.engine.num_waiting() > 0

    def leave_time(self, held: float, cv: threading.Condition, interrupted: Callable[[], bool]) -> None:
        """While requests are being served, waits after a training step that held the
        accelerator `held` seconds so that serving gets `[train] serving_share` of its time: a
        stream then waits at most one training step between two tokens, and most of its tokens
        not at all. `interrupted()` (checked under `cv`, whose notifications wake the wait) ends
        it early."""
        share = self.settings.train.serving_share
        deadline = time.monotonic() + held * share / (1.0 - share)
        while time.monotonic() < deadline and self.serving_busy():
            with cv:
                if interrupted():
                    return
                cv.wait(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
