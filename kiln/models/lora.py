"""LoRA in stacked adapter slots, applied per row (BGMV without a gather of weights).

A LoRA state is {"scale": [n_slots], "layers": {module: {"a": [L, n_slots, in, r],
"b": [L, n_slots, r, out]}}}. Slot 0 holds zeros, so rows without an adapter add nothing.
Each token projects through every slot's A (cheap: r is small), keeps only its own slot's
result via a one-hot mask, and one matmul with all B's stacked yields the delta.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.config import ModelConfig

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA-targetable projection."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }


def lora_delta(x: jax.Array, weights: dict, token_slot_onehot: jax.Array, slot_scale: jax.Array) -> jax.Array:
    """x: [T, in]; weights a: [n, in, r], b: [n, r, out]; one-hot: [T, n]; scale: [n] -> [T, out]."""
    xa = jnp.einsum("ti,nir->tnr", x, weights["a"].astype(x.dtype))
    xa = xa * (token_slot_onehot * slot_scale)[:, :, None]
    n, r, out = weights["b"].shape
    return xa.reshape(x.shape[0], n * r) @ weights["b"].reshape(n * r, out).astype(x.dtype)


def empty_lora_state(cfg: ModelConfig, n_slots: int, rank: int, modules=TARGET_MODULES, dtype=jnp.float32) -> dict:
    """All-zero slots (slot 0 plus n_slots - 1 loadable ones)."""
    shapes = module_shapes(cfg)
    layers = {
        m: {
            "a": jnp.zeros((cfg.num_layers, n_slots, shapes[m][0], rank), dtype),
            "b": jnp.zeros((cfg.num_layers, n_slots, rank, shapes[m][1]), dtype),
        }
        for m in modules
    }
    return {"scale": jnp.zeros((n_slots,), jnp.float32), "layers": layers}


def set_slot(state: dict, slot: int, adapter: dict[str, dict[str, np.ndarray]], scale: float) -> dict:
    """Returns a state with `adapter` ({module: {"a": [L, in, r'], "b": [L, r', out]}}) in `slot`.

    Ranks below the slot rank are zero-padded, which leaves the product unchanged.
    """
    if slot == 0:
        raise ValueError("slot 0 is reserved for 'no adapter'")
    layers = dict(state["layers"])
    for module, slots in state["layers"].items():
        a = jnp.zeros(slots["a"].shape[:1] + slots["a"].shape[2:], slots["a"].dtype)
        b = jnp.zeros(slots["b"].shape[:1] + slots["b"].shape[2:], slots["b"].dtype)
        if module in adapter:
            r = adapter[module]["a"].shape[-1]
            if r > a.shape[-1]:
                raise ValueError(f"adapter rank {r} exceeds slot rank {a.shape[-1]}")
            a = a.at[:, :, :r].set(adapter[module]["a"])
            b = b.at[:, :r, :].set(adapter[module]["b"])
        layers[module] = {"a": slots["a"].at[:, slot].set(a), "b": slots["b"].at[:, slot].set(b)}
    unknown = set(adapter) - set(state["layers"])
    if unknown:
        raise ValueError(f"adapter targets modules without slots: {sorted(unknown)}")
    return {"scale": state["scale"].at[slot].set(scale), "layers": layers}
