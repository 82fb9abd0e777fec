"""Which accelerator errors are device loss, and the `[debug]` hook that injects one.

A step can fail in two ways. Most runtime errors fail only the step's requests: the next step
runs normally (the runner recovers the KV state if the failure took it). A few leave the
device itself unusable: a lost device, or a sticky CUDA error after which every later call on
the context fails too. Those are device loss: process-terminal, see `DeviceLost`. Only errors
whose message names such a condition count; a bare INTERNAL status is not enough, since XLA
uses it for many recoverable failures.
"""

from __future__ import annotations

import jax

from kiln.errors import DeviceLost

# Substrings (matched case-insensitively) of runtime errors that leave the device unusable:
# Vulkan/IREE/PJRT "device lost", and CUDA's sticky errors (the context is corrupted).
DEVICE_LOSS_MARKERS = (
    "device_lost",  # VK_ERROR_DEVICE_LOST, IREE and PJRT status text
    "device lost",
    "device is lost",
    "device was lost",
    "cuda_error_illegal_address",
    "an illegal memory access was encountered",
    "cuda_error_launch_failed",
    "unspecified launch failure",
    "cuda_error_ecc_uncorrectable",
    "uncorrectable ecc error",
    "cuda_error_hardware_stack_error",
    "cuda_error_illegal_instruction",
    "cuda_error_misaligned_address",
    "cuda_error_device_unavailable",
    "hiperrorillegaladdress",
)


def is_device_loss(exc: BaseException) -> bool:
    """True for DeviceLost and for runtime errors whose message names a lost or corrupted device."""
    if isinstance(exc, DeviceLost):
        return True
    if not isinstance(exc, RuntimeError):  # JAX's JaxRuntimeError (XlaRuntimeError) is one
        return False
    message = str(exc).lower()
    return any(marker in message for marker in DEVICE_LOSS_MARKERS)


def first_line(exc: BaseException) -> str:
    """A runtime error's first line (at most 300 characters): enough to name it in health and logs."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def as_device_lost(exc: BaseException) -> DeviceLost:
    """The DeviceLost for a recognised loss (see is_device_loss)."""
    if isinstance(exc, DeviceLost):
        return exc
    return DeviceLost(f"the accelerator was lost ({first_line(exc)}); restart the process")


class DeviceLossInjector:
    """`[debug] inject_device_loss_after_steps`: after `after` dispatched steps, the next step
    (and every one after it) raises the runtime error a lost device raises. 0 never does."""

    def __init__(self, after: int):
        self.after = after
        self.dispatched = 0

    def before_step(self) -> None:
        if self.after and self.dispatched >= self.after:
            raise jax.errors.JaxRuntimeError(
                f"INTERNAL: DEVICE_LOST: injected by [debug] inject_device_loss_after_steps after {self.dispatched} "
                "steps")
        self.dispatched += 1
