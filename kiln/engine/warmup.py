"""`kiln warmup`: compile the configured step buckets into JAX's persistent compilation cache,
so the next start (or the serving profile's prewarm) loads executables instead of compiling."""

from __future__ import annotations

import time

import jax
from tqdm import tqdm

from kiln.config import Settings
from kiln.engine.config import EngineConfig
from kiln.engine.core import EngineCore
from kiln.engine.runner import COUNTER
from kiln.engine.setup import configure_compilation_cache, load_model_from_settings, select_route_from_settings


def warmup(settings: Settings) -> int:
    start = time.monotonic()
    configure_compilation_cache(settings.compilation_dir())
    model = load_model_from_settings(settings)
    core = EngineCore(model, EngineConfig.from_settings(settings), route=select_route_from_settings(settings, model))
    try:
        runner = core.runner
        shapes = runner.warmup_shapes(settings.engine.warmup_context_tokens, lora=True)
        built, hits = COUNTER.builds, COUNTER.cache_hits
        for i, shape in enumerate(tqdm(shapes, desc="compiling step buckets", unit="bucket"), 1):
            runner.compile_bucket(shape)  # lands in the persistent cache; not kept here
            if i % 8 == 0:
                jax.clear_caches()  # JAX's own caches would keep every executable (and its memory mappings)
        compiled = (COUNTER.builds - built) - (COUNTER.cache_hits - hits)
        print(
            f"warmup: {len(shapes)} step buckets ready in {time.monotonic() - start:.1f}s "
            f"({compiled} executables compiled, {COUNTER.cache_hits - hits} loaded from cache) "
            f"-> {settings.compilation_dir()}"
        )
    finally:
        core.close()
    return 0
