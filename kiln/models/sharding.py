"""Tensor-parallel layouts: params and KV cache over a device mesh axis "tp" (and, for training, a
data-parallel axis "dp" that splits a batch's rows).

Attention is split over heads (Q/K/V columns, O rows) and the MLP over its intermediate
dimension (gate/up columns, down rows); the KV pool over KV heads. A dimension that the
mesh does not divide (e.g. 3 KV heads on 4 devices) stays replicated, so every model
runs on every mesh; XLA inserts the collectives. Of a quantized model's layers, the
column-parallel projections are split by output columns; the others are replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kiln.errors import ConfigError
from kiln.models import quant
from kiln.models.config import ModelConfig

AXIS = "tp"
DATA = "dp"


def make_mesh(devices=None) -> Mesh:
    devices = np.asarray(devices if devices is not None else jax.devices())
    return Mesh(devices, (AXIS,))


def training_mesh(data_parallel: int | str, tensor_parallel: int | str) -> Mesh | None:
    """The (dp, tp) mesh an in-process training run asks for with `[train] data_parallel` and
    `[engine] tensor_parallel`, over every process's devices (a run that spans hosts: each host's
    devices in a row, so that tp stays within a host when it is a host's count). "auto" tensor
    parallelism is a process's devices; "auto" data parallelism every device the tp axis leaves.
    None for one device."""
    devices = jax.devices()
    tp = jax.local_device_count() if tensor_parallel == "auto" else int(tensor_parallel)
    dp = max(1, len(devices) // tp) if data_parallel == "auto" else int(data_parallel)
    if dp * tp > len(devices):
        raise ConfigError(f"train.data_parallel = {dp} times engine.tensor_parallel = {tp} needs {dp * tp} devices, "
                          f"but {len(devices)} {devices[0].platform} device(s) were found")
    if len(devices) % (dp * tp):
        raise ConfigError(f"train.data_parallel = {dp} times engine.tensor_parallel = {tp} ({dp * tp} devices) does "
                          f"not divide the {len(devices)} {devices[0].platform} devices found")
    if dp * tp == 1:
        return None
    return Mesh(np.asarray(devices[:dp * tp]).reshape(dp, tp), (DATA, AXIS))


def serving_mesh(tensor_parallel: int | str, one_device_route: str | None = None) -> Mesh | None:
    """The mesh `[engine] tensor_parallel` asks for: a count of devices, or "auto" for all of them; None
    for one device (no mesh). A server over several processes (`[distributed]`) spans every process's
    devices. `one_device_route` names a route that runs on one device."""
    devices = jax.devices()
    n = len(devices) if tensor_parallel == "auto" else int(tensor_parallel)
    processes = jax.process_count()
    where = "this process has" if processes == 1 else f"the server's {processes} processes have"
    found = f"{len(devices)} {'local ' if processes == 1 else ''}{devices[0].platform}"
    if n > len(devices):
        raise ConfigError(f"engine.tensor_parallel = {n}, but {where} {found} device(s)")
    if len(devices) % n:
        raise ConfigError(f"engine.tensor_parallel = {n} does not divide the {found} devices found")
    if n == 1:
        return None
    if one_device_route:
        raise ConfigError(f"engine.tensor_parallel = {n}: the {one_device_route} route runs on one device; set "
                          "backend.route = xla or engine.tensor_parallel = 1")
    return make_mesh(devices[:n])


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


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


# quantized projections split by output columns (a fused group's members side by side: XLA moves what
# the split of the product needs), and the row-parallel ones, o and down, by input rows
_QUANTIZED_COLUMNS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", *quant.FUSED)
_QUANTIZED_ROWS = ("o_proj", "down_proj")


def param_shardings(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Each param's sharding (a pytree of them for a quantized weight). A quantized q/k/v or gate/up
    (or their fused groups) is split by output columns, each of its levels, scales and offsets along
    its last axis, where the mesh divides every one; a quantized o or down by input rows, each along
    its second-to-last axis (levels, packed pairs of them, and the groups' scales and offsets: equal
    parts of each hold the same rows) where the mesh divides every one and the float layout splits
    it; other quantized weights are replicated."""
    tp = mesh.shape[AXIS]

    def spec(value, split: P, name: str = ""):
        if isinstance(value, (jax.Array, np.ndarray)):
            return NamedSharding(mesh, split)
        leaves = jax.tree.leaves(value)
        if quant.is_quantized(value) and name in _QUANTIZED_COLUMNS and all(x.shape[-1] % tp == 0 for x in leaves):
            return jax.tree.map(lambda x: NamedSharding(mesh, P(*([None] * (x.ndim - 1)), AXIS)), value)
        if (quant.is_quantized(value) and name in _QUANTIZED_ROWS and AXIS in split
                and all(x.shape[-2] % tp == 0 for x in leaves)):
            return jax.tree.map(lambda x: NamedSharding(mesh, P(*([None] * (x.ndim - 2)), AXIS, None)), value)
        return NamedSharding(mesh, P())

    out = {k: replicated(mesh) for k in params if k != "layers"}
    if params.get("lm_head") is not None and cfg.vocab_size % tp == 0:
        out["lm_head"] = spec(params["lm_head"], P(None, AXIS))
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):  # unrolled: one dict per layer, no layer axis
        out["layers"] = [{k: spec(v, P(*_layer_spec(k, cfg, tp)[1:]), k) for k, v in layer.items()}
                         for layer in layers]
    else:
        out["layers"] = {k: spec(v, _layer_spec(k, cfg, tp), k) for k, v in layers.items()}
    return out


def lora_shardings(lora: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """A LoRA pytree's shardings ({module: {"a": [..., in, r], "b": [..., r, out]}}, a run's [L, ...] or
    the serving slots' [L, n, ...]), each split like its base matrix: B by output columns where the
    base is split by columns (q/k/v, gate/up), A by input rows where it is split by rows (o, down);
    the other factor, a mixture's experts' and what the mesh does not divide are held whole.
    Replicated over any data-parallel axis."""
    tp = mesh.shape[AXIS]

    def split(module: str, factor: str, x) -> NamedSharding:
        base, lead = _layer_spec(module, cfg, tp), [None] * (len(x.shape) - 2)
        if factor == "b" and base == P(None, None, AXIS):
            return NamedSharding(mesh, P(*lead, None, AXIS))
        if factor == "a" and base == P(None, AXIS, None):
            return NamedSharding(mesh, P(*lead, AXIS, None))
        return replicated(mesh)

    return {module: {k: split(module, k, x) for k, x in parts.items()} for module, parts in lora.items()}


def lora_slot_shardings(state: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """The serving adapter slots' shardings (kiln.models.lora's slot state), split as `lora_shardings`
    splits a run's LoRA; the scales whole on every device."""
    return {"scale": replicated(mesh), "layers": lora_shardings(state["layers"], cfg, mesh)}


def rows_sharding(mesh: Mesh, rows: int) -> NamedSharding:
    """An array whose first axis is a batch's rows: split over the data-parallel axis where the mesh
    has one that divides them, else replicated."""
    dp = mesh.shape.get(DATA, 1)
    return NamedSharding(mesh, P(DATA) if dp > 1 and rows % dp == 0 else P())


def describe(mesh: Mesh | None, params: dict, slots: dict | None = None) -> dict:
    """The serving mesh for /v1/config: its axis, size and devices (size 1 and no axis without one),
    and the bytes of weights and of adapter slots (`slots`, None before the first load) each device
    holds."""
    def held(tree) -> int:
        leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
        if mesh is None:
            return sum(x.nbytes for x in leaves)
        first = mesh.devices.flat[0]
        return sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == first)

    held_bytes = {"weight_bytes_per_device": held(params), "adapter_slot_bytes_per_device": held(slots)}
    if mesh is None:
        return {"axis": None, "size": 1, "devices": [], **held_bytes}
    return {"axis": AXIS, "size": mesh.shape[AXIS], "devices": [str(d) for d in mesh.devices.flat], **held_bytes}


def kv_sharding(cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    tp = mesh.shape[AXIS]
    spec = P(None, AXIS, None, None, None) if cfg.num_kv_heads % tp == 0 else P()
    return NamedSharding(mesh, spec)


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    return jax.device_put(params, param_shardings(params, cfg, mesh))


def shard_kv(kv, cfg: ModelConfig, mesh: Mesh):
    """A decoder.KVCache with its pools placed as `kv_sharding` says (this module imports no decoder: the
    decoder's attention kernel reads the mesh axis from here)."""
    s = kv_sharding(cfg, mesh)
    return kv._replace(k=jax.device_put(kv.k, s), v=jax.device_put(kv.v, s))
