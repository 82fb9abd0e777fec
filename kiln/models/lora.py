"""LoRA in stacked adapter slots, applied per row with a cost that follows the batch's adapters.

A LoRA state holds n loadable slots: {"scale": [n], "layers": {module: {"a": [L, n, in, r],
"b": [L, n, r, out]}}}. Rows name a slot 1..n; slot 0 means "no adapter" and has no storage.
A step may add "active": [G] (the distinct slots its rows use, 0-padded): only those G slots'
weights are gathered and applied, so the LoRA cost grows with the adapters in the batch, not
with n. Without "active", every slot is active. Each token projects through its batch's
active A's (cheap: r is small), keeps its own via a one-hot mask, and one matmul with the
stacked B's yields the delta.
"""

from __future__ import annotations

import functools

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


def active_lora(lora: dict, token_slots: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """The step's view of a LoRA state: per-token weights [T, G] (one-hot times the slot's scale)
    and the storage index [G] of the active slots (see `active_weights`).

    token_slots: [T] slot of each token (0 = none)."""
    n = lora["scale"].shape[0]
    active = lora.get("active")
    if active is None:
        active = jnp.arange(1, n + 1, dtype=jnp.int32)
    index = jnp.maximum(active - 1, 0)
    scale = jnp.where(active > 0, lora["scale"][index], 0.0)
    token_weight = ((token_slots[:, None] == active[None, :]) * scale[None, :]).astype(dtype)
    return token_weight, index


def active_weights(layers: dict, index: jax.Array, layer: int | None = None) -> dict:
    """The active slots' weights {module: {"a": [..., G, in, r], "b": [..., G, r, out]}}: of one
    layer, or of all layers (stacked) when `layer` is None. Only those G slots are read."""
    if layer is None:
        return {m: {k: jnp.take(w, index, axis=1) for k, w in parts.items()} for m, parts in layers.items()}
    return {m: {k: jnp.take(w[layer], index, axis=0) for k, w in parts.items()} for m, parts in layers.items()}


def lora_delta(x: jax.Array, weights: dict, token_weight: jax.Array) -> jax.Array:
    """x: [T, in]; weights a: [G, in, r], b: [G, r, out]; token_weight: [T, G] -> [T, out]."""
    xa = jnp.einsum("ti,gir->tgr", x, weights["a"].astype(x.dtype)) * token_weight[:, :, None]
    g, r, out = weights["b"].shape
    return xa.reshape(x.shape[0], g * r) @ weights["b"].reshape(g * r, out).astype(x.dtype)


def empty_lora_state(cfg: ModelConfig, n_slots: int, rank: int, modules=TARGET_MODULES, dtype=jnp.float32) -> dict:
    """All-zero state with n_slots loadable slots (rows address them as 1..n_slots)."""
    shapes = module_shapes(cfg)
    layers = {
        m: {
            "a": jnp.zeros((cfg.num_layers, n_slots, shapes[m][0], rank), dtype),
            "b": jnp.zeros((cfg.num_layers, n_slots, rank, shapes[m][1]), dtype),
        }
        for m in modules
    }
    return {"scale": jnp.zeros((n_slots,), jnp.float32), "layers": layers}


def num_slots(state: dict) -> int:
    return int(state["scale"].shape[0])


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_slot(state: dict, index, padded: dict, scale) -> dict:
    layers = {
        m: {"a": w["a"].at[:, index].set(padded[m]["a"].astype(w["a"].dtype)),
            "b": w["b"].at[:, index].set(padded[m]["b"].astype(w["b"].dtype))}
        for m, w in state["layers"].items()
    }
    return {"scale": state["scale"].at[index].set(scale), "layers": layers}


def set_slot(state: dict, slot: int, adapter: dict[str, dict[str, np.ndarray]], scale: float) -> dict:
    """Returns the state with `adapter` ({module: {"a": [L, in, r'], "b": [L, r', out]}}) in `slot`.

    Updates in place on the device (the old state is donated). Ranks below the slot rank
    are zero-padded, which leaves the product unchanged; absent modules get zeros."""
    n = num_slots(state)
    if not 1 <= slot <= n:
        raise ValueError(f"slot {slot} is outside 1..{n} (slot 0 is reserved for 'no adapter')")
    unknown = set(adapter) - set(state["layers"])
    if unknown:
        raise ValueError(f"adapter targets modules without slots: {sorted(unknown)}")
    padded = {}
    for module, slots in state["layers"].items():
        L, _, fan_in, rank = slots["a"].shape
        fan_out = slots["b"].shape[-1]
        a, b = np.zeros((L, fan_in, rank), np.float32), np.zeros((L, rank, fan_out), np.float32)
        if module in adapter:
            r = adapter[module]["a"].shape[-1]
            if r > rank:
                raise ValueError(f"adapter rank {r} exceeds slot rank {rank}")
            a_in, b_in = adapter[module]["a"], adapter[module]["b"]
            if a_in.shape != (L, fan_in, r) or b_in.shape != (L, r, fan_out):
                raise ValueError(f"{module}: adapter shapes {a_in.shape} / {b_in.shape} "
                                 f"do not fit the model ({L}, {fan_in}, r) / ({L}, r, {fan_out})")
            a[:, :, :r], b[:, :r, :] = a_in, b_in
        padded[module] = {"a": a, "b": b}
    return _write_slot(state, jnp.int32(slot - 1), padded, jnp.float32(scale))


def clear_slot(state: dict, slot: int) -> dict:
    """Zeroes a slot's scale so nothing it held can leak into a row (weights stay until overwritten)."""
    return {**state, "scale": state["scale"].at[slot - 1].set(0.0)}
