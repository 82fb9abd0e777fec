"""The engine's settings: one frozen object, its defaults taken from the configuration schema."""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln.config import KEYS, Settings


def _default(dotted: str) -> Any:
    value = KEYS[dotted].default
    return tuple(value) if isinstance(value, list) else value


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_kv_blocks: int = _default("engine.num_kv_blocks")
    block_size: int = _default("engine.block_size")
    max_num_seqs: int = _default("engine.max_num_seqs")
    max_num_batched_tokens: int = _default("engine.max_num_batched_tokens")
    max_model_len: int = _default("engine.max_model_len")  # 0: min(model's positions, pool capacity)
    enable_prefix_caching: bool = _default("engine.enable_prefix_caching")
    async_scheduling: str = _default("engine.async_scheduling")  # auto | on | off
    decode_row_buckets: tuple[int, ...] = _default("engine.decode_row_buckets")
    prefill_token_buckets: tuple[int, ...] = _default("engine.prefill_token_buckets")
    kv_events_endpoint: str = _default("engine.kv_events_endpoint")
    kv_events_replay_endpoint: str = _default("engine.kv_events_replay_endpoint")
    kv_events_encoding: str = _default("engine.kv_events_encoding")
    seed: int = _default("engine.seed")
    max_loras: int = _default("adapters.max_loras")
    max_lora_rank: int = _default("adapters.max_lora_rank")
    allow_live_compile: bool = True  # the serving profile's live_graph_capture
    resident_prefill: bool = False  # the serving profile's vulkan_resident_prefill (experimental only)
    inject_device_loss_after_steps: int = _default("debug.inject_device_loss_after_steps")  # 0: never

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        e, a = settings.engine, settings.adapters
        return cls(
            num_kv_blocks=e.num_kv_blocks, block_size=e.block_size, max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens, max_model_len=e.max_model_len,
            enable_prefix_caching=e.enable_prefix_caching, async_scheduling=e.async_scheduling,
            decode_row_buckets=tuple(e.decode_row_buckets),
            prefill_token_buckets=tuple(e.prefill_token_buckets), kv_events_endpoint=e.kv_events_endpoint,
            kv_events_replay_endpoint=e.kv_events_replay_endpoint, kv_events_encoding=e.kv_events_encoding,
            seed=e.seed, max_loras=a.max_loras, max_lora_rank=a.max_lora_rank,
            allow_live_compile=settings.serving_profile.policy.live_graph_capture,
            resident_prefill=settings.serving_profile.policy.vulkan_resident_prefill,
            inject_device_loss_after_steps=settings.debug.inject_device_loss_after_steps,
        )
