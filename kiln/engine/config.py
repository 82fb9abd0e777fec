"""The engine's settings: one frozen object, its defaults taken from the configuration schema."""

from __future__ import annotations

import dataclasses

from kiln.config import Settings, setting_default


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_kv_blocks: int = setting_default("engine.num_kv_blocks")  # 0: sized from kv_cache_memory
    kv_cache_memory: str = setting_default("engine.kv_cache_memory")  # auto | a fraction | bytes
    kv_cache_dtype: str = setting_default("engine.kv_cache_dtype")  # auto (the model's) | bfloat16
    block_size: int = setting_default("engine.block_size")
    max_num_seqs: int = setting_default("engine.max_num_seqs")
    max_num_batched_tokens: int = setting_default("engine.max_num_batched_tokens")
    max_model_len: int = setting_default("engine.max_model_len")  # 0: min(model's positions, pool capacity)
    enable_prefix_caching: bool = setting_default("engine.enable_prefix_caching")
    async_scheduling: str = setting_default("engine.async_scheduling")  # auto | on | off
    decode_row_buckets: tuple[int, ...] = setting_default("engine.decode_row_buckets")
    prefill_token_buckets: tuple[int, ...] = setting_default("engine.prefill_token_buckets")
    kv_events_endpoint: str = setting_default("engine.kv_events_endpoint")
    kv_events_replay_endpoint: str = setting_default("engine.kv_events_replay_endpoint")
    kv_events_encoding: str = setting_default("engine.kv_events_encoding")
    seed: int = setting_default("engine.seed")
    tensor_parallel: int | str = setting_default("engine.tensor_parallel")  # devices of the tp mesh, or "auto"
    attention: str = setting_default("engine.attention")  # auto | xla | pallas (kiln.models.paged_attention)
    cpu_kernels: str = setting_default("engine.cpu_kernels")  # auto | off (kiln.kernels.cpu)
    max_loras: int = setting_default("adapters.max_loras")
    max_lora_rank: int = setting_default("adapters.max_lora_rank")
    lora_experts: bool = setting_default("adapters.lora_experts")  # slots hold a mixture's experts' LoRA too
    allow_live_compile: bool = True  # the serving profile's live_graph_capture
    resident_prefill: bool = False  # the serving profile's vulkan_resident_prefill (experimental only)
    inject_device_loss_after_steps: int = setting_default("debug.inject_device_loss_after_steps")  # 0: never

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        e, a = settings.engine, settings.adapters
        return cls(
            num_kv_blocks=e.num_kv_blocks, kv_cache_memory=e.kv_cache_memory, kv_cache_dtype=e.kv_cache_dtype,
            block_size=e.block_size,
            max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens, max_model_len=e.max_model_len,
            enable_prefix_caching=e.enable_prefix_caching, async_scheduling=e.async_scheduling,
            decode_row_buckets=tuple(e.decode_row_buckets),
            prefill_token_buckets=tuple(e.prefill_token_buckets), kv_events_endpoint=e.kv_events_endpoint,
            kv_events_replay_endpoint=e.kv_events_replay_endpoint, kv_events_encoding=e.kv_events_encoding,
            seed=e.seed, tensor_parallel=e.tensor_parallel, attention=e.attention, cpu_kernels=e.cpu_kernels,
            max_loras=a.max_loras,
            max_lora_rank=a.max_lora_rank,
            lora_experts=a.lora_experts,
            allow_live_compile=settings.serving_profile.policy.live_graph_capture,
            resident_prefill=settings.serving_profile.policy.vulkan_resident_prefill,
            inject_device_loss_after_steps=settings.debug.inject_device_loss_after_steps,
        )
