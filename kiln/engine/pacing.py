"""When async scheduling pays, measured.

Planning a step while the previous one runs hides the host's work per step (scheduling, input
layout, detokenizing) behind the device's step; the price is that a request arriving during a
step joins one step later, because the next step was planned when that one started. So it pays
when the host's work is a real share of the device's step: on an accelerator, where a small
model's step takes a few milliseconds, it is most of the gain; on a CPU, where a step takes a
hundred milliseconds or more and the host's work a few, it gains a few percent and costs every
arriving request a whole step of time to first token. `auto` plans ahead of a step when the
host's work per step is at least HOST_SHARE of that step bucket's time on the device (then a new
request waits at most about 1 / HOST_SHARE times the host's work, tens of milliseconds).
"""

from __future__ import annotations

from kiln.engine.buckets import StepBucket

HOST_SHARE = 0.1
SMOOTHING = 0.2  # weight of a new sample in the moving averages


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


class StepClock:
    """Moving averages of the host's work per engine step and of each bucket's device time."""

    def __init__(self, mode: str = "auto"):
        self.mode = mode  # auto | on | off
        self.host_s: float | None = None
        self.device_s: dict[StepBucket, float] = {}
        self._device_free_at = 0.0  # when the device finished the last step fetched

    def host(self, seconds: float) -> None:
        """One engine step's host work: its wall time less its waits for the device."""
        self.host_s = _average(self.host_s, seconds)

    def fetched(self, bucket: StepBucket, dispatched_at: float, waited_from: float, done: float,
                was_ready: bool) -> None:
        """A step's results were fetched: waiting from `waited_from` until `done`. A step that was
        ready before its fetch finished at an unknown time, so it gives no sample."""
        if not was_ready:
            start = max(dispatched_at, self._device_free_at)  # it queued behind the step before it
            self.device_s[bucket] = _average(self.device_s.get(bucket), done - start)
        self._device_free_at = waited_from if was_ready else done

    def runs_ahead(self, bucket: StepBucket) -> bool:
        """Whether the next step should be planned while a step of this bucket runs."""
        if self.mode != "auto":
            return self.mode == "on"
        device = self.device_s.get(bucket)
        return device is not None and self.host_s is not None and self.host_s >= HOST_SHARE * device

    def snapshot(self) -> dict:
        return {"mode": self.mode, "host_ms": None if self.host_s is None else round(self.host_s * 1e3, 3),
                "device_ms": {b.describe(): round(s * 1e3, 3) for b, s in sorted(self.device_s.items())}}
