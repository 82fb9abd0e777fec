"""Builds the model and engine from resolved settings (shared by serve, warmup and bench)."""

from __future__ import annotations

import logging
from pathlib import Path

import jax

from kiln.config import Settings
from kiln.engine.engine import Engine, EngineConfig
from kiln.models.loader import LoadedModel, load_model

log = logging.getLogger("kiln.engine")


def configure_compilation_cache(directory: Path) -> None:
    """Every executable goes to JAX's persistent cache, so a later start loads instead of compiling."""
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def load_model_from_settings(settings: Settings, show_progress: bool = True) -> LoadedModel:
    m = settings.model
    return load_model(m.path or None, dtype=m.dtype, show_progress=show_progress,
                      model_id=m.served_model_name or None, cache_root=settings.cache_dir())


def engine_config(settings: Settings) -> EngineConfig:
    e = settings.engine
    return EngineConfig(
        num_kv_blocks=e.num_kv_blocks,
        block_size=e.block_size,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        max_model_len=e.max_model_len,
        enable_prefix_caching=e.enable_prefix_caching,
        row_buckets=tuple(e.decode_row_buckets),
        token_buckets=tuple(e.prefill_token_buckets),
        allow_live_capture=settings.serving_profile.policy.live_graph_capture,
        kv_events_endpoint=e.kv_events_endpoint,
        kv_events_replay_endpoint=e.kv_events_replay_endpoint,
        max_loras=settings.adapters.max_loras,
        max_lora_rank=settings.adapters.max_lora_rank,
    )


def build_engine(settings: Settings, show_progress: bool = True) -> Engine:
    configure_compilation_cache(settings.compilation_dir())
    model = load_model_from_settings(settings, show_progress)
    return Engine(model, engine_config(settings))
