"""Tensor-parallel layouts: params and KV cache over a 1-D device mesh axis "tp".

Attention is split over heads (Q/K/V columns, O rows) and the MLP over its intermediate
dimension (gate/up columns, down rows); the KV pool over KV heads. A dimension that the
mesh does not divide (e.g. 3 KV heads on 4 devices) stays replicated, so every model
runs on every mesh; XLA inserts the collectives.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kiln.models.config import ModelConfig
from kiln.models.decoder import KVCache

AXIS = "tp"


def make_mesh(devices=None) -> Mesh:
    devices = np.asarray(devices if devices is not None else jax.devices())
    return Mesh(devices, (AXIS,))


def _layer_spec(name: str, cfg: ModelConfig, tp: int) -> P:
    q_ok = cfg.num_heads % tp == 0
    kv_ok = cfg.num_kv_heads % tp == 0
    mlp_ok = cfg.intermediate_size % tp == 0
    expert_ok = bool(cfg.num_experts) and cfg.expert_intermediate_size % tp == 0
    column = {"q_proj": q_ok, "k_proj": kv_ok, "v_proj": kv_ok, "gate_proj": mlp_ok, "up_proj": mlp_ok}
    row = {"o_proj": q_ok, "down_proj": mlp_ok}
    bias = {"q_bias": q_ok, "k_bias": kv_ok, "v_bias": kv_ok, "sinks": q_ok}
    # a mixture's experts: every device holds a slice of every expert's hidden width (no expert parallelism)
    experts = {"experts_gate": P(None, None, None, AXIS), "experts_up": P(None, None, None, AXIS),
               "experts_down": P(None, None, AXIS, None), "experts_gate_bias": P(None, None, AXIS),
               "experts_up_bias": P(None, None, AXIS)}
    if column.get(name):
        return P(None, None, AXIS)
    if row.get(name):
        return P(None, AXIS, None)
    if bias.get(name):
        return P(None, AXIS)
    if expert_ok and name in experts:
        return experts[name]
    return P()


def param_shardings(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    tp = mesh.shape[AXIS]
    out = {k: NamedSharding(mesh, P()) for k in params if k != "layers"}
    if params.get("lm_head") is not None and cfg.vocab_size % tp == 0:
        out["lm_head"] = NamedSharding(mesh, P(None, AXIS))
    out["layers"] = {k: NamedSharding(mesh, _layer_spec(k, cfg, tp)) for k in params["layers"]}
    return out


def kv_sharding(cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    tp = mesh.shape[AXIS]
    spec = P(None, AXIS, None, None, None) if cfg.num_kv_heads % tp == 0 else P()
    return NamedSharding(mesh, spec)


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    return jax.device_put(params, param_shardings(params, cfg, mesh))


def shard_kv(kv: KVCache, cfg: ModelConfig, mesh: Mesh) -> KVCache:
    s = kv_sharding(cfg, mesh)
    return KVCache(jax.device_put(kv.k, s), jax.device_put(kv.v, s))
