"""Backend routes: how the engine's step functions run, and choosing one from capabilities.

* `xla`: JAX's own backend (CPU, CUDA, ROCm, Metal).
* `vulkan`, `iree-cpu`: the same step functions exported as StableHLO and compiled by IREE for
  `vulkan-spirv` or `llvm-cpu`, with weights and the paged KV resident on the IREE device.

`select_backend` decides from what the devices report (device type, dtypes, memory) and from
correctness gates it runs on the device itself; never from a device's name, vendor, driver string
or any receipt. `auto` takes XLA when it has an accelerator, a Vulkan GPU when XLA only has the
host CPU, else XLA on the CPU.

Correctness gates are small programs whose answers are known: a full sort and a top-k over a
vocabulary-sized row. A route whose sort fails (Mesa's lavapipe sorts 512+ elements wrongly) runs
the forward pass on the device and samples those steps with XLA on the host; a step whose forward
pass itself needs the failing operation (prompt logprobs) is refused with a 503, never answered
wrongly.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("kiln.engine")

GATE_SIZE = 1024  # a row this long exercises the sorts sampling does over a vocabulary


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    route: str
    reason: str
    capabilities: dict  # the chosen route's device report (display names included, never read)
    gates: dict[str, bool]

    def to_json(self) -> dict:
        return {"route": self.route, "reason": self.reason, "capabilities": self.capabilities, "gates": self.gates}


class Backend:
    """An opened route: for IREE routes the device, its module cache and resident arrays."""

    def __init__(self, choice: BackendChoice, device=None, cache=None):
        self.choice = choice
        self.name = choice.route
        self.device = device
        self.cache = cache
        self.resident = None
        if device is not None:
            from kiln.iree.step import ResidentArrays

            self.resident = ResidentArrays(device)

    @property
    def is_iree(self) -> bool:
        return self.device is not None

    @property
    def reuses_prefixes(self) -> bool:
        """Cross-request prefix reuse is under a correctness quarantine on Vulkan: fresh prefill."""
        return self.name != "vulkan"

    def gate(self, name: str) -> bool:
        return self.choice.gates.get(name, True)

    def compile(self, fn, args, static: dict, device_outputs: tuple[int, ...]):
        """An IREE executable of `fn` (a jitted function) for these abstract arguments."""
        from kiln.iree.compile import export_step
        from kiln.iree.device import ROUTE_TARGETS
        from kiln.iree.step import IreeStep

        exported = export_step(fn, *args, **static)
        key, vmfb = self.cache.get_or_compile_keyed(exported.mlir, ROUTE_TARGETS[self.name])
        return IreeStep(self.device, self.resident, self.device.load(vmfb), exported, device_outputs, key)

    @property
    def device_id(self) -> str:
        """Names this device's capabilities, for verdicts recorded per module and device."""
        import hashlib
        import json

        return hashlib.sha256(json.dumps(self.choice.capabilities, sort_keys=True).encode()).hexdigest()[:16]

    def bytes_moved(self) -> tuple[int, int]:
        """(host to device, device to host) bytes so far."""
        if self.device is None:
            return 0, 0
        return self.device.uploaded_bytes, self.device.downloaded_bytes


XLA = Backend(BackendChoice("xla", "requested", {}, {}))


def xla_capabilities() -> dict:
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    return {"route": "xla", "device_type": "cpu" if device.platform == "cpu" else "gpu", "platform": device.platform,
            "dtypes": ["f32", "f16", "bf16", "i8"], "memory_bytes": int(stats.get("bytes_limit", 0)),
            "name": getattr(device, "device_kind", "")}


def run_gates(route: Backend) -> dict[str, bool]:
    """Each gate's verdict on this route's device: known answers, computed there."""
    rng = np.random.default_rng(0)
    row = rng.standard_normal((2, GATE_SIZE)).astype(np.float32)
    abstract = (jax.ShapeDtypeStruct(row.shape, row.dtype),)
    programs = {"sort": (jax.jit(lambda x: jnp.sort(x, axis=-1)), np.sort(row, axis=-1)),
                "top_k": (jax.jit(lambda x: jax.lax.top_k(x, 20)[0]), -np.sort(-row, axis=-1)[:, :20])}
    gates = {}
    for name, (fn, expected) in programs.items():
        try:
            got = route.compile(fn, abstract, {}, ())(row)
            gates[name] = bool(np.allclose(np.asarray(got), expected, atol=1e-6))
        except Exception as exc:  # a program the route cannot compile or run fails its gate
            log.warning("route %s: gate %s could not run: %s", route.name, name, exc)
            gates[name] = False
    return gates


def open_iree(route: str, cache_dir: Path) -> Backend:
    """Opens an IREE route's device and runs its gates; BackendUnavailable if it cannot run here."""
    from kiln.iree.compile import ModuleCache, compiler_version
    from kiln.iree.device import open_device

    compiler_version()  # the compiler is part of the route: fail now, not at the first step
    device = open_device(route)
    opened = Backend(BackendChoice(route, "", device.capabilities.to_json(), {}), device, ModuleCache(cache_dir))
    opened.choice = dataclasses.replace(opened.choice, gates=run_gates(opened))
    return opened


def select_backend(requested: str, cache_dir: Path, model_dtype: str = "float32",
                   capabilities: dict | None = None) -> Backend:
    """The route to serve with. `requested` is xla, vulkan or iree-cpu (fatal BackendUnavailable when it cannot
    run here) or `auto`. `capabilities` stands in for probing the Vulkan device (tests)."""
    from kiln.errors import BackendUnavailable

    need = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(model_dtype, "f32")
    if requested == "xla":
        return Backend(BackendChoice("xla", "requested", xla_capabilities(), {}))
    if requested in ("vulkan", "iree-cpu"):
        route = open_iree(requested, cache_dir)
        if need not in route.choice.capabilities["dtypes"]:
            raise BackendUnavailable(f"route {requested}: the device does not support {model_dtype} weights "
                                     f"(it offers {', '.join(route.choice.capabilities['dtypes'])}); "
                                     "load the model as float32 (model.dtype)")
        route.choice = dataclasses.replace(route.choice, reason="requested")
        return route
    xla = xla_capabilities()
    if xla["device_type"] == "gpu":
        return Backend(BackendChoice("xla", f"auto: XLA has an accelerator ({xla['platform']})", xla, {}))
    vulkan = capabilities
    if vulkan is None:
        try:
            from kiln.iree.device import probe

            vulkan = probe("vulkan").to_json()
        except BackendUnavailable as exc:
            return Backend(BackendChoice("xla", f"auto: XLA on the CPU; no Vulkan route ({exc})", xla, {}))
    if vulkan["device_type"] != "gpu":
        return Backend(BackendChoice(
            "xla", f"auto: XLA on the CPU; the Vulkan device is of type {vulkan['device_type']}, no faster than "
            "the host", xla, {}))
    if need not in vulkan["dtypes"]:
        return Backend(BackendChoice("xla", f"auto: XLA on the CPU; the Vulkan GPU lacks {model_dtype}", xla, {}))
    route = open_iree("vulkan", cache_dir)
    route.choice = dataclasses.replace(route.choice, reason="auto: a Vulkan GPU, and XLA only has the CPU")
    return route
