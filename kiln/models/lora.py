"""LoRA in stacked adapter slots, applied per row with a cost that follows the batch's adapters.

A LoRA state holds n loadable slots: {"scale": [n], "layers": {module: {"a": [L, n, in, r],
"b": [L, n, r, out]}}}. Rows name a slot 1..n; slot 0 means "no adapter" and has no storage.
Each token projects through all n A's at once (cheap: r is small), keeps its own via a
one-hot mask, and one matmul with the stacked B's yields the delta. The slot count is part of
the state's shape, never of a step's: which adapters a batch uses is data. A batch without
adapter rows runs a step that has no LoRA work at all. (XLA:CPU's grouped matmul,
`lax.ragged_dot`, measured 4x slower than this dense product for these shapes.)

A mixture of experts' experts take LoRA too, one adapter per expert as PEFT's `target_parameters`
holds it: `experts_gate_up` (the gate and up projections' shared A, and B over both widths, gate's
then up's) and `experts_down`, with the experts' axis after the slot's: a [L, n, E, in, r],
b [L, n, E, r, out] (see `decoder.experts_mlp`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.config import ModelConfig

EXPERT_MODULES = ("experts_gate_up", "experts_down")
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", *EXPERT_MODULES)


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA-targetable projection (of each expert, for the experts')."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    if cfg.num_experts:  # a mixture of experts has no dense MLP projections
        e = cfg.expert_intermediate_size
        return {**attention, "experts_gate_up": (h, 2 * e), "experts_down": (e, h)}
    return {**attention, "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def experts_axis(cfg: ModelConfig, module: str) -> tuple[int, ...]:
    """The experts' axis a module's LoRA weights carry: (experts,) for a mixture's experts, else ()."""
    return (cfg.num_experts,) if module in EXPERT_MODULES else ()


def module_params(cfg: ModelConfig, module: str, rank: int) -> int:
    """LoRA parameters of one layer's module at this rank."""
    fan_in, fan_out = module_shapes(cfg)[module]
    return rank * (fan_in + fan_out) * math.prod(experts_axis(cfg, module))


def slot_weights(lora: dict, token_slots: jax.Array, dtype) -> jax.Array:
    """Per-token weights [T, n] of a LoRA state's n slots: one-hot of the token's slot times the
    slot's scale (slot 0, no adapter, weighs nothing).

    token_slots: [T] slot of each token (0 = none)."""
    n = lora["scale"].shape[0]
    slots = jnp.arange(1, n + 1, dtype=jnp.int32)
    return ((token_slots[:, None] == slots[None, :]) * lora["scale"][None, :]).astype(dtype)


def layer_weights(layers: dict, layer: int) -> dict:
    """One layer's slot weights {module: {"a": [n, in, r], "b": [n, r, out]}}."""
    return {m: {k: w[layer] for k, w in parts.items()} for m, parts in layers.items()}


def lora_delta(x: jax.Array, weights: dict, token_weight: jax.Array) -> jax.Array:
    """x: [T, in]; weights a: [G, in, r], b: [G, r, out]; token_weight: [T, G] (G slots) -> [T, out]."""
    xa = jnp.einsum("ti,gir->tgr", x, weights["a"].astype(x.dtype)) * token_weight[:, :, None]
    g, r, out = weights["b"].shape
    return xa.reshape(x.shape[0], g * r) @ weights["b"].reshape(g * r, out).astype(x.dtype)


def empty_lora_state(cfg: ModelConfig, n_slots: int, rank: int, modules=TARGET_MODULES, dtype=jnp.float32) -> dict:
    """All-zero state with n_slots loadable slots (rows address them as 1..n_slots)."""
    shapes = module_shapes(cfg)
    layers = {
        m: {
            "a": jnp.zeros((cfg.num_layers, n_slots, *experts_axis(cfg, m), shapes[m][0], rank), dtype),
            "b": jnp.zeros((cfg.num_layers, n_slots, *experts_axis(cfg, m), rank, shapes[m][1]), dtype),
        }
        for m in modules if m in shapes  # a mixture of experts has no dense MLP projections, a dense model no experts
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
    """Returns the state with `adapter` ({module: {"a": [L, in, r'], "b": [L, r', out]}}, experts'
    modules [L, E, in, r'] and [L, E, r', out]) in `slot`.

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
        L, _, *experts, fan_in, rank = slots["a"].shape
        fan_out = slots["b"].shape[-1]
        a, b = np.zeros((L, *experts, fan_in, rank), np.float32), np.zeros((L, *experts, rank, fan_out), np.float32)
        if module in adapter:
            r = adapter[module]["a"].shape[-1]
            if r > rank:
                raise ValueError(f"adapter rank {r} exceeds slot rank {rank}")
            a_in, b_in = adapter[module]["a"], adapter[module]["b"]
            if a_in.shape != (L, *experts, fan_in, r) or b_in.shape != (L, *experts, r, fan_out):
                raise ValueError(f"{module}: adapter shapes {a_in.shape} / {b_in.shape} do not fit the model "
                                 f"{(L, *experts, fan_in, 'r')} / {(L, *experts, 'r', fan_out)}")
            a[..., :r], b[..., :r, :] = a_in, b_in
        padded[module] = {"a": a, "b": b}
    return _write_slot(state, jnp.int32(slot - 1), padded, jnp.float32(scale))


def clear_slot(state: dict, slot: int) -> dict:
    """Zeroes a slot's scale so nothing it held can leak into a row (weights stay until overwritten)."""
    return {**state, "scale": state["scale"].at[slot - 1].set(0.0)}
