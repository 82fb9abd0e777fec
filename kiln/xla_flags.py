"""XLA flags Kiln sets for the process, before JAX starts its backends.

XLA:CPU schedules a program for concurrency by default: work that depends on nothing runs as early
as it can. A quantized weight's dequantization depends only on the weight, so that scheduler moves
every projection's dequantized float32 copy to the start of the step (of a scanned layer's body, or
of the whole step when layers are unrolled), and the multiplies then read them back from memory
instead of from the cache they were just written to. With the default model's int4 layers one
decode step ran 1.6x slower than float32 under scan and 6x slower unrolled, where the step's
temporaries (every layer in float32, mapped afresh at each run) also page-faulted 100,000 times a
step. XLA's memory-aware scheduler keeps each dequantization next to its multiply
(docs/performance.md). Only XLA_FLAGS reaches that scheduler (a per-compile option does not), so
the flag is added to the environment when `kiln` is imported, unless the user has set it; it has no
effect on other backends. A program that started JAX's backends before importing Kiln keeps XLA's
default.
"""

from __future__ import annotations

import importlib.util
import os

CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def add_process_flags(environ=os.environ) -> None:
    """Adds Kiln's XLA flags to XLA_FLAGS in `environ`, leaving any the user set alone."""
    flags = environ.get("XLA_FLAGS", "")
    if CPU_SCHEDULER_FLAG in flags or _metal_plugin_installed():
        return  # jax-metal's own XLA predates the flag, and XLA refuses flags it does not know
    environ["XLA_FLAGS"] = f"{flags} {CPU_SCHEDULER_FLAG}=false".strip()


def _metal_plugin_installed() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.metal_plugin") is not None
    except (ImportError, ValueError):
        return False
