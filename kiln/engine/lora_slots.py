"""Device-resident LoRA slots: which adapter version each slot holds, who uses it, LRU.

Engine-thread only. A request on an adapter acquires a slot when the engine picks it up
and releases it when it finishes, so a slot's weights never change under a request that
uses it: loading, unloading and replacing an adapter take effect for new requests, and a
replaced or unloaded version stays resident until its last request finishes. Each write
to the device state is a writer operation under `Ownership`.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np

from kiln.engine.ownership import Ownership
from kiln.models.config import ModelConfig
from kiln.models.lora import EXPERT_MODULES, TARGET_MODULES, clear_slot, empty_lora_state, set_slot


@dataclasses.dataclass(eq=False)
class AdapterWeights:
    """One immutable version of an adapter, as the engine needs it (host arrays)."""

    name: str
    version: str  # identifies the weights (the manifest digest)
    weights: dict[str, dict[str, np.ndarray]]  # {module: {"a": [L, (E,) in, r], "b": [L, (E,) r, out]}}
    scale: float
    rank: int
    retired: bool = False  # unloaded or replaced: no new request may select it

    @property
    def key(self) -> str:
        """Prefix-cache identity: KV computed under one version is never reused by another."""
        return f"{self.name}@{self.version}"


@dataclasses.dataclass(eq=False)
class _Slot:
    adapter: AdapterWeights
    refs: int = 0
    last_used: int = 0


def slot_modules(experts: bool) -> tuple[str, ...]:
    """The modules slots hold: a mixture's experts only where `[adapters] lora_experts` says."""
    return TARGET_MODULES if experts else tuple(m for m in TARGET_MODULES if m not in EXPERT_MODULES)


class LoraSlots:
    def __init__(self, cfg: ModelConfig, n_slots: int, max_rank: int, ownership: Ownership, dtype="float32",
                 experts: bool = False, sharding=None):
        self.cfg, self.n_slots, self.max_rank, self.dtype = cfg, n_slots, max_rank, dtype
        # where the slot arrays live: state -> its shardings (on a tensor-parallel mesh, split like the
        # weights, see models.sharding.lora_slot_shardings); None: as made
        self.sharding = sharding
        self.modules = slot_modules(experts)
        self.ownership = ownership
        self.state: dict | None = None  # allocated on the first load
        self.slots: list[_Slot | None] = [None] * n_slots  # index i is slot i + 1
        self._clock = itertools.count(1)
        self.loads = 0
        self.evictions = 0
        self.mirror = None  # a server over several processes: process 0's StepMirror (see step_mirror.py)

    def ensure_state(self) -> dict:
        """The stacked slot arrays, allocated (all zero) on first need."""
        if self.state is None:
            self.state = self._placed(empty_lora_state(self.cfg, self.n_slots, self.max_rank, self.modules,
                                                       self.dtype))
        return self.state

    def _placed(self, state: dict) -> dict:
        return state if self.sharding is None else jax.device_put(state, self.sharding(state))

    def abstract_state(self):
        """The slot arrays' shapes and dtypes, without allocating them (what a compile needs)."""
        if self.state is not None:
            return self.state
        shapes = jax.eval_shape(lambda: empty_lora_state(self.cfg, self.n_slots, self.max_rank, self.modules,
                                                         self.dtype))
        if self.sharding is None:
            return shapes
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                            self.sharding(shapes))

    def _find(self, adapter: AdapterWeights) -> int | None:
        for i, s in enumerate(self.slots):
            if s is not None and s.adapter is adapter:
                return i
        return None

    def _victim(self) -> int | None:
        """A free slot, else the least recently used slot no live request holds."""
        for i, s in enumerate(self.slots):
            if s is None:
                return i
        idle = [(s.last_used, i) for i, s in enumerate(self.slots) if s.refs == 0]
        return min(idle)[1] if idle else None

    def place(self, adapter: AdapterWeights) -> int | None:
        """Makes `adapter` resident (no reference taken); returns its slot or None if all are busy."""
        i = self._find(adapter)
        if i is None:
            i = self._victim()
            if i is None:
                return None
            if self.slots[i] is not None:
                self.evictions += 1
            with self.ownership.write(f"load adapter {adapter.name} into slot {i + 1}"):
                self.slots[i] = None  # a failed write leaves the slot empty, never half-labelled
                self.write(i + 1, adapter.weights, adapter.scale)
            self.slots[i] = _Slot(adapter)
            self.loads += 1
        self.slots[i].last_used = next(self._clock)
        return i + 1

    def acquire(self, adapter: AdapterWeights) -> int | None:
        """Slot for a request on `adapter` (loading it if needed), or None while all slots are busy."""
        slot = self.place(adapter)
        if slot is not None:
            self.slots[slot - 1].refs += 1
        return slot

    def release(self, slot: int) -> None:
        s = self.slots[slot - 1]
        if s is None:
            return
        s.refs -= 1
        if s.refs == 0 and s.adapter.retired:
            self._free(slot - 1)

    def retire(self, adapter: AdapterWeights) -> None:
        """Unload/replace: new requests can no longer get this version; idle slots free now."""
        adapter.retired = True
        i = self._find(adapter)
        if i is not None and self.slots[i].refs == 0:
            self._free(i)

    def _free(self, i: int) -> None:
        with self.ownership.write(f"unload slot {i + 1}"):
            self.slots[i] = None
            self.clear(i + 1)

    def write(self, slot: int, weights: dict, scale: float) -> None:
        """Writes an adapter's weights into slot `slot` of the device state (under writer ownership)."""
        if self.mirror is not None:
            self.mirror.send("slot", slot, weights, scale)
        self.state = self._placed(set_slot(self.ensure_state(), slot, weights, scale))

    def clear(self, slot: int) -> None:
        if self.mirror is not None:
            self.mirror.send("clear", slot)
        self.state = self._placed(clear_slot(self.state, slot))

    def resident(self) -> list[dict]:
        return [
            {"slot": i + 1, "adapter": s.adapter.name, "version": s.adapter.version, "requests": s.refs,
             "retired": s.adapter.retired}
            for i, s in enumerate(self.slots) if s is not None
        ]
