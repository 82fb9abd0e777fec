"""Where a training run's arrays live: on one device, or over a mesh with a tensor-parallel axis
"tp" and, for in-process runs, a data-parallel axis "dp" (kiln.models.sharding).

On a mesh the LoRA params are split like their base matrices and the optimizer state like the params
it tracks; a batch's rows are split over "dp" (padded with empty rows to a multiple of it). The
model code is unchanged: XLA's SPMD partitioner splits each step and reduces the gradients of the
rows each device ran. The jitted updates name their outputs' shardings, so a step's LoRA params and
optimizer state come back placed the way the next step takes them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from kiln.models.config import ModelConfig
from kiln.models.sharding import DATA, lora_shardings, replicated, rows_sharding


class Placement:
    """A run's placement on `mesh` (None: one device, where every method leaves its input as it is)."""

    def __init__(self, mesh: Mesh | None, cfg: ModelConfig):
        self.mesh, self.cfg = mesh, cfg
        self._lora_shardings = self._opt_shardings = None

    @property
    def data_parallel(self) -> int:
        return self.mesh.shape.get(DATA, 1) if self.mesh is not None else 1

    def state(self, tx: optax.GradientTransformation, lora: dict) -> tuple[dict, Any]:
        """The LoRA params placed, and a fresh optimizer state for them placed alike."""
        opt_state = tx.init(lora)
        if self.mesh is None:
            return lora, opt_state
        self._lora_shardings = lora_shardings(lora, self.cfg, self.mesh)
        whole = replicated(self.mesh)
        self._opt_shardings = optax.tree_utils.tree_map_params(
            tx, lambda _, sharding: sharding, opt_state, self._lora_shardings, transform_non_params=lambda _: whole)
        return self.restored(lora, opt_state)

    def restored(self, lora: dict, opt_state: Any) -> tuple[dict, Any]:
        """LoRA params and optimizer state (from a checkpoint) placed as `state` placed them."""
        if self.mesh is None:
            return lora, opt_state
        return jax.device_put(lora, self._lora_shardings), jax.device_put(opt_state, self._opt_shardings)

    def jit_update(self, fn, **jit_options):
        """`fn(lora, opt_state, ...) -> (lora, opt_state, metrics)` jitted, its new params and state
        placed like the old ones (its metrics replicated)."""
        if self.mesh is None:
            return jax.jit(fn, **jit_options)
        return jax.jit(fn, out_shardings=(self._lora_shardings, self._opt_shardings, replicated(self.mesh)),
                       **jit_options)

    def batch(self, batch: NamedTuple) -> NamedTuple:
        """A host batch on the mesh: its [rows, ...] arrays split over "dp", padded with empty rows
        (token 0, not valid) to a multiple of it, so no position or trained index moves; the rest
        replicated."""
        if self.mesh is None:
            return batch
        dp, fields = self.data_parallel, {}
        for name, value in batch._asdict().items():
            value = np.asarray(value)
            if value.ndim >= 2:
                pad = -value.shape[0] % dp
                value = np.pad(value, [(0, pad)] + [(0, 0)] * (value.ndim - 1))
                fields[name] = jax.device_put(value, rows_sharding(self.mesh, value.shape[0]))
            else:
                fields[name] = jax.device_put(value, replicated(self.mesh))
        return type(batch)(**fields)
