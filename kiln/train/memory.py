"""A training job's memory plan: the bytes it will add, against what the device has free.

What serving holds (weights, the KV pool, adapter slots) is already allocated, so a job fits
when its own state (LoRA params, gradients, optimizer state) and one micro-batch's activations
fit in what is free now. Activations are estimated per layer from the tensors the backward
pass keeps; with remat (per-layer `jax.checkpoint`) only each layer's input is kept, plus one
layer's activations while it is recomputed.
"""

from __future__ import annotations

import jax

from kiln.engine.host_memory import free_bytes
from kiln.errors import InsufficientMemory
from kiln.models.config import ModelConfig
from kiln.models.lora import module_params, module_shapes

F32 = 4


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def available_bytes(budget_setting: int = 0) -> tuple[int, str]:
    """Free bytes for training and where the number comes from: the device's allocator stats
    on an accelerator; on the CPU `[train] memory_budget_bytes`, or the host's available memory."""
    free, device_kind = free_bytes()
    if device_kind:
        return free, f"{device_kind} memory stats"
    if budget_setting > 0:
        return budget_setting, "[train] memory_budget_bytes"
    return free, "host MemAvailable"


def lora_bytes(cfg: ModelConfig, rank: int, modules) -> int:
    """float32 LoRA params of one adapter of this rank on these modules."""
    shapes = module_shapes(cfg)
    return F32 * cfg.num_layers * sum(module_params(cfg, m, rank) for m in modules if m in shapes)


def activation_bytes(cfg: ModelConfig, rows: int, seq_len: int, remat: bool) -> int:
    T = rows * seq_len
    q, kv, i, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.hidden_size
    if cfg.num_experts:  # a token's experts' activations
        i = cfg.experts_per_token * cfg.expert_intermediate_size
    # kept per layer: norms' inputs and outputs, q/k/v (and roped), attention output, the MLP's
    # gate, up, activation and product, and the attention scores and probabilities
    per_layer = F32 * (T * (4 * h + 2 * q + 4 * kv + q + 4 * i) + 2 * rows * cfg.num_heads * seq_len * seq_len)
    logits = F32 * 3 * T * cfg.vocab_size  # logits, log-softmax and their gradient
    layers = cfg.num_layers * F32 * T * h + per_layer if remat else cfg.num_layers * per_layer
    return layers + logits


def plan(cfg: ModelConfig, rank: int, modules, rows: int, seq_len: int, accumulation: int, serving: dict,
         budget_setting: int = 0) -> dict:
    """The job's bytes with and without remat, what serving holds, and the free budget."""
    lora = lora_bytes(cfg, rank, modules)
    state = {"lora_params": lora, "gradients": lora, "optimizer_state": 2 * lora + (lora if accumulation > 1 else 0)}
    free, source = available_bytes(budget_setting)
    full = sum(state.values()) + activation_bytes(cfg, rows, seq_len, remat=False)
    remat = sum(state.values()) + activation_bytes(cfg, rows, seq_len, remat=True)
    return {**state, "activations": full - sum(state.values()), "activations_remat": remat - sum(state.values()),
            "required_bytes": full, "required_bytes_remat": remat, "available_bytes": free, "budget_source": source,
            "serving": serving, "micro_batch": {"rows": rows, "seq_len": seq_len}}


def admit(memory_plan: dict, remat_setting: str, kv_pool: dict | None = None) -> dict:
    """How the job fits: remat as configured, or with "auto" only when the job needs it; then,
    when `kv_pool` allows it (the profile's dynamic KV resize), a smaller KV pool for the job's
    duration. `kv_pool`: {"blocks", "bytes_per_block", "min_blocks"}. Returns {"remat",
    "kv_resize": None | {"from_blocks", "to_blocks", "freed_bytes"}}; raises InsufficientMemory,
    with the numbers, when nothing makes the job fit."""
    free = memory_plan["available_bytes"]
    need, need_remat = memory_plan["required_bytes"], memory_plan["required_bytes_remat"]
    remat = remat_setting == "on" or (remat_setting == "auto" and need > free)
    required = need_remat if remat else need
    if required <= free:
        return {"remat": remat, "kv_resize": None}
    spare = 0
    if kv_pool is not None:
        per_block = kv_pool["bytes_per_block"]
        spare = (kv_pool["blocks"] - kv_pool["min_blocks"]) * per_block
        blocks = -(-(required - free) // per_block)
        if kv_pool["blocks"] - blocks >= kv_pool["min_blocks"]:
            return {"remat": remat, "kv_resize": {"from_blocks": kv_pool["blocks"],
                                                  "to_blocks": kv_pool["blocks"] - blocks,
                                                  "freed_bytes": blocks * per_block}}
    mib = 1 << 20
    shrink = f" plus {spare / mib:.0f} MiB a smaller KV pool would free" if kv_pool is not None else ""
    raise InsufficientMemory(
        f"the training job needs {need / mib:.0f} MiB ({need_remat / mib:.0f} MiB with remat) but "
        f"{free / mib:.0f} MiB are free ({memory_plan['budget_source']}){shrink}; lower batch_size or max_seq_len")
