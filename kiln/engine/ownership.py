"""Writer-priority ownership of the accelerator.

Inference steps are readers; writers are operations that change accelerator state
(adapter slot transitions, training steps, KV resize, allocator reclaim). Writers are
exclusive and have priority: once a writer waits, no new inference step starts, so the
writer gets the accelerator at the next iteration boundary; inference resumes when no
writer is waiting or active. A step therefore never sees a half-applied write.

An inference step is held from its dispatch until its results are on the host, which with async
scheduling spans the planning of the next step. A write made by the thread that holds such a
step (the engine thread loading an adapter into a slot while planning) does not wait for it: the
step in flight reads the slot arrays it was dispatched with, and the write makes new ones.

Training steps run as a sequence of short writes, slices (kiln.train.slices), and take turns
with serving (`training_slice`): while serving has work, a slice waits until a serving step has
run since the previous slice and serving has had its share of the time since, so a stream waits
for at most one slice between two tokens and training keeps the rest of the accelerator.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np

TURN_WAIT_CAP_S = 1.0  # a slice waits at most this long for serving's turn (a step stuck compiling)


class Ownership:
    def __init__(self):
        self._cond = threading.Condition()
        self._steps = 0  # inference steps in progress
        self._held: dict[int, int] = {}  # of those, by the thread that holds them
        self._writer: str | None = None
        self._waiting: list[str] = []
        self.writes = 0
        self.write_wait_s = 0.0  # total time writers waited for a boundary
        self.write_hold_s = 0.0  # total time writers held the accelerator
        self.serving_busy: Callable[[], bool] = lambda: False  # whether requests are running or waiting
        self.inference_done = 0  # inference steps completed
        self._turn_mark = 0  # inference_done when the last training slice ended
        self._slice_end = 0.0
        self._slice_held = 0.0
        self.slices = 0
        self.slice_total_s = 0.0  # total time training slices held the accelerator
        self.slice_s: deque[float] = deque(maxlen=4096)  # the last slices' lengths
        self.serving_steps_between = 0  # serving steps run between training slices

    def begin_inference(self, wait: bool = True) -> bool:
        """One inference step starts (held until `end_inference`, while it is on the device); it waits
        while any writer is active or waiting, or with `wait=False` returns False instead."""
        with self._cond:
            while self._writer is not None or self._waiting:
                if not wait:
                    return False
                self._cond.wait()
            self._steps += 1
            me = threading.get_ident()
            self._held[me] = self._held.get(me, 0) + 1
            return True

    def end_inference(self) -> None:
        with self._cond:
            self._steps -= 1
            self.inference_done += 1
            me = threading.get_ident()
            self._held[me] -= 1
            if not self._held[me]:
                del self._held[me]
            self._cond.notify_all()

    @contextlib.contextmanager
    def inference(self) -> Iterator[None]:
        """Held around one inference step; waits while any writer is active or waiting."""
        self.begin_inference()
        try:
            yield
        finally:
            self.end_inference()

    @contextlib.contextmanager
    def write(self, what: str) -> Iterator[None]:
        """Exclusive accelerator access for a writer: it waits for the inference steps other threads hold."""
        t0 = time.monotonic()
        with self._cond:
            self._waiting.append(what)
            own = self._held.get(threading.get_ident(), 0)
            try:
                while self._writer is not None or self._steps > own:
                    self._cond.wait()
            finally:
                self._waiting.remove(what)
            self._writer = what
        t1 = time.monotonic()
        try:
            yield
        finally:
            with self._cond:
                self._writer = None
                self.writes += 1
                self.write_wait_s += t1 - t0
                self.write_hold_s += time.monotonic() - t1
                self._cond.notify_all()

    @contextlib.contextmanager
    def training_slice(self, what: str, share: float) -> Iterator[None]:
        """One slice of a training step, held as a write after its turn: while serving is busy it
        waits until a serving step has completed since the previous slice and `share` of the time
        since that slice started has gone to serving (capped at TURN_WAIT_CAP_S)."""
        with self._cond:
            if self.slices and self.serving_busy():
                ready_at = self._slice_end + self._slice_held * share / (1.0 - share)
                give_up = time.monotonic() + TURN_WAIT_CAP_S
                while ((self.inference_done == self._turn_mark or time.monotonic() < ready_at)
                       and time.monotonic() < give_up and self.serving_busy()):
                    self._cond.wait(timeout=0.005)  # a completed step notifies
            self.serving_steps_between += self.inference_done - self._turn_mark
        with self.write(what):
            started = time.monotonic()
            yield
            held = time.monotonic() - started
        with self._cond:
            self.slices += 1
            self.slice_total_s += held
            self.slice_s.append(held)
            self._slice_end, self._slice_held, self._turn_mark = time.monotonic(), held, self.inference_done

    def _slice_summary(self) -> dict:
        ms = np.asarray(self.slice_s) * 1e3
        stat = lambda f: round(float(f(ms)), 3) if len(ms) else None  # noqa: E731
        return {"count": self.slices, "p50_ms": stat(np.median), "p99_ms": stat(lambda x: np.percentile(x, 99)),
                "max_ms": stat(np.max), "serving_steps_between": self.serving_steps_between}

    def snapshot(self) -> dict:
        with self._cond:
            return {
                "active_writer": self._writer,
                "waiting_writers": list(self._waiting),
                "inference_steps_running": self._steps,
                "writes": self.writes,
                "write_wait_s": round(self.write_wait_s, 6),
                "write_hold_s": round(self.write_hold_s, 6),
                "training_slices": self._slice_summary(),
            }
