"""Building the bounded step set: at server start (before ready), by `kiln warmup`, or listed.

`build_step_set` builds every executable of an engine's set, or loads it from disk (see
executables.py), with a progress bar; `kiln warmup` does the same in its own process so that
the next start only loads, and `kiln warmup --list` prints the set for the resolved settings
without loading a model.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

from kiln.config import Settings
from kiln.engine.buckets import BucketSet
from kiln.engine.config import EngineConfig


def build_step_set(runner, show_progress: bool = True, defer_lora: bool = False,
                   on_progress: Callable[[int, int], None] | None = None) -> dict:
    """Builds or loads the runner's whole step set, or all but its LoRA steps (`defer_lora`: the first
    adapter builds those), on the thread that owns the runner; returns what it did: executables,
    built, loaded, deferred, seconds, memory mappings after. `on_progress(done, total)` after each."""
    start = time.monotonic()
    store = runner.store
    loads, compiles = store.loads, store.compiles
    cache = runner.backend.cache
    iree_before = (cache.compiles, cache.hits) if cache is not None else (0, 0)
    todo = [k for k in runner.startup_set(defer_lora) if k not in runner.executables]
    with tqdm(total=len(todo), desc="building step executables", unit="executable", file=sys.stderr,
              disable=not show_progress or not todo) as bar:

        def progress(key) -> None:
            bar.update()
            if on_progress is not None:
                on_progress(bar.n, len(todo))

        if on_progress is not None:
            on_progress(0, len(todo))
        runner.warm(todo, workers=os.cpu_count() or 1, progress=progress)
    built, loaded = store.compiles - compiles, store.loads - loads
    if cache is not None:
        built += cache.compiles - iree_before[0]
        loaded += cache.hits - iree_before[1]
    return {"executables": len(runner.executables), "set": len(runner.executable_set()), "built": built,
            "loaded": loaded, "deferred": len(runner.deferred), "refused_by_gate": len(runner.gate_failed),
            "seconds": round(time.monotonic() - start, 1), "memory_mappings": runner.mapped_regions()}


def prime_first_contact(runner) -> dict:
    """Runs once, on the thread that owns the runner, the steps a short chat turn runs (see
    `Runner.prime`): a first chat request after ready runs at the speed of later ones. Returns how
    many and the seconds."""
    start = time.monotonic()
    steps = [b for b in runner.first_contact_steps() if b in runner.unprimed]
    for bucket in steps:
        runner.prime(bucket)
    return {"primed": len(steps), "prime_seconds": round(time.monotonic() - start, 1)}


def list_step_set(settings: Settings) -> int:
    config = EngineConfig.from_settings(settings)
    buckets = BucketSet(config.decode_row_buckets, config.prefill_token_buckets, config.max_num_seqs,
                        config.max_num_batched_tokens)
    for bucket in buckets.forwards:
        print(f"forward  {bucket.describe()}")
    for rows in buckets.sampler_rows:
        print(f"sampler  rows={rows}")
    print(f"{len(buckets)} executables (forward steps: {len(buckets.forwards)}, samplers: {len(buckets.sampler_rows)})"
          "; an IREE route adds a device sampler per row count")
    return 0

