"""A compiled step bucket on an IREE device, called like the XLA executable it stands in for.

Weights (and LoRA slot state) are uploaded once and stay resident: a JAX array argument is
uploaded the first time it is seen and its device copy reused until the array itself is gone.
The KV cache lives on the device from the first step on: the step's KV results stay device
arrays and come back as the next step's KV arguments, so no KV crosses to the host. Per step
only the batch's small input arrays go up and the sampled ids (and requested logprobs) come down.

IREE updates donated arguments in place, so a KV passed to a step is consumed by it.
"""

from __future__ import annotations

import threading
import weakref

import jax
import numpy as np

from kiln.iree.compile import ExportedStep
from kiln.iree.device import IreeDevice


class ResidentArrays:
    """Device copies of JAX arrays, each dropped when its array is collected."""

    def __init__(self, device: IreeDevice):
        self.device = device
        self._copies: dict[int, object] = {}
        self._lock = threading.Lock()

    def get(self, array: jax.Array):
        key = id(array)
        with self._lock:
            copy = self._copies.get(key)
        if copy is None:
            copy = self.device.upload(np.asarray(array))
            with self._lock:
                self._copies[key] = copy
            # through a weak reference: the model's weights outlive a route, and a finalizer holding
            # this object would keep the route's device (and its driver threads) open with them
            weakref.finalize(array, ResidentArrays._drop, weakref.ref(self), key)
        return copy

    @staticmethod
    def _drop(ref: weakref.ref, key: int) -> None:
        self = ref()
        if self is not None:
            with self._lock:
                self._copies.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._copies.clear()

    def __len__(self) -> int:
        return len(self._copies)


class IreeStep:
    """`step(*args) -> results` for one exported function; the results whose top-level positions
    are in `device_outputs` stay on the device, the others come to the host as numpy arrays."""

    def __init__(self, device: IreeDevice, resident: ResidentArrays, function, exported: ExportedStep,
                 device_outputs: tuple[int, ...], module_key: str = ""):
        self.device, self.resident, self.function, self.exported = device, resident, function, exported
        self.module_key = module_key  # names the compiled module in the route's cache
        n_out = exported.out_tree.num_leaves
        marks = jax.tree.unflatten(exported.out_tree, range(n_out))
        on_device = set()
        for i in device_outputs:
            on_device.update(jax.tree.leaves(marks[i]))
        self._on_device = on_device

    def _argument(self, x):
        if isinstance(x, self.device.rt.DeviceArray):
            return x
        if isinstance(x, jax.Array):
            return self.resident.get(x)
        return self.device.upload(np.asarray(x))

    def __call__(self, *args):
        leaves, tree = jax.tree.flatten((args, {}))
        if tree != self.exported.in_tree:
            raise TypeError(f"step arguments {tree} do not match the compiled step's {self.exported.in_tree}")
        results = self.function(*(self._argument(leaves[i]) for i in self.exported.kept))
        if not isinstance(results, tuple):
            results = (results,)
        out = [r if i in self._on_device else self.device.to_host(r) for i, r in enumerate(results)]
        return jax.tree.unflatten(self.exported.out_tree, out)


class HostSampling:
    """Sampling in an XLA executable on the host after an IREE forward pass: for steps whose
    sampling the device cannot run correctly (grammar masks, or sorts the route's gates refused)."""

    def __init__(self, device: IreeDevice, sampler):
        self.device, self.sampler = device, sampler

    def __call__(self, row_logits, rs):
        return self.sampler(self.device.to_host(row_logits), rs)
