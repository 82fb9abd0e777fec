"""The `python` grader and the pool of sandboxed processes that runs its code.

A grader's `source` defines `grade(sample, item) -> float`. It is untrusted code, so it never
runs in this process: a `SandboxPool` keeps a few worker processes (`_sandbox_worker.py`,
which sets their limits and isolation; see its docstring), each reused across samples so a
training step does not pay an interpreter start per sample. A worker that times out, crashes,
runs out of memory, leaves threads behind or answers nonsense is killed (its whole process
group) and replaced on the next call. Every wait on a worker has a deadline, so the caller
never hangs.

How failures score (always 0):
- an exception in the grader, or a non-number / non-finite result: `python_grader_runtime_error`,
  with the traceback (or the reason) in `python_grader_runtime_error_details`; a MemoryError
  from the memory limit is one of these;
- over the time limit: `python_grader_server_error` with type "timeout", and
  `unresponsive_reward_error`;
- the worker died (a segfault, SIGKILL, the CPU limit): `python_grader_server_error`, type "crash";
- no worker could be started: `python_grader_server_error`, type "sandbox_unavailable".

`image_tag` (OpenAI's choice of container image) is accepted and ignored: graders run on
this machine's interpreter, with the packages installed next to Kiln.
"""

from __future__ import annotations

import ast
import atexit
import dataclasses
import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from kiln.graders.base import Fields, Grader, Judge, as_reward
from kiln.graders.result import GradeResult

log = logging.getLogger("kiln.graders")

WORKER = Path(__file__).with_name("_sandbox_worker.py")
MAX_SOURCE_BYTES = 256 * 1024
START_TIMEOUT_S = 30.0
MAX_REPLY_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per call: `timeout_s` of wall-clock time; per worker: address space, file size, and
    a CPU budget after which it is replaced. `isolate_network=False` skips the namespaces
    (the audit hook still refuses sockets)."""

    timeout_s: float = 60.0
    memory_bytes: int = 2 << 30
    file_bytes: int = 64 << 20
    cpu_budget_s: int = 3600
    max_tasks: int = 1000
    isolate_network: bool = True


@dataclasses.dataclass
class Outcome:
    """What one call in the sandbox gave: `value` (what grade() returned, as a float or None; what
    a tool function returned, as text) or an `error` kind: runtime | timeout | crash | sandbox_unavailable."""

    value: float | str | None = None
    error: str | None = None
    details: str | None = None


class SandboxError(Exception):
    pass


class _Worker:
    def __init__(self, limits: SandboxLimits):
        self.limits = limits
        self.tasks, self.cpu_s = 0, 0.0
        self.dir = tempfile.mkdtemp(prefix="kiln-grader-")
        env = {"PATH": os.defpath, "HOME": self.dir, "TMPDIR": self.dir, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        config = {"memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
                  "cpu_budget_s": limits.cpu_budget_s, "isolate_network": limits.isolate_network,
                  "parent_pid": os.getpid()}
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", str(WORKER), json.dumps(config)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         cwd=self.dir, env=env, start_new_session=True, close_fds=True)
        except OSError:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self._in, False)
        self._buffer = b""
        try:
            ready = self._read(time.monotonic() + START_TIMEOUT_S)
        except (SandboxError, TimeoutError) as exc:
            self.kill()
            raise SandboxError(f"a sandbox worker did not start: {exc or 'timed out'}") from None
        self.pid, self.network = ready.get("pid"), ready.get("network")

    def usable(self) -> bool:
        """Whether this worker may take another call (else it is retired)."""
        return (self.proc.poll() is None and self.tasks < self.limits.max_tasks
                and self.cpu_s + self.limits.timeout_s + 2 < self.limits.cpu_budget_s)

    def call(self, task: dict[str, Any], timeout_s: float) -> tuple[Outcome, bool]:
        """One call (`task`: source plus sample and item, or function and kwargs); returns its outcome
        and whether the worker can be kept."""
        self.tasks += 1
        nonce = secrets.token_hex(8)  # sandboxed code can write to the reply pipe, but cannot guess this
        request = {**task, "id": nonce, "cpu_s": timeout_s, "memory_bytes": self.limits.memory_bytes}
        deadline = time.monotonic() + timeout_s
        try:
            self._write((json.dumps(request, default=str) + "\n").encode(), deadline)
            reply = self._read(deadline)
        except TimeoutError:
            name = task.get("function", "grade")
            return Outcome(error="timeout", details=f"{name}() did not return within {timeout_s:g} s"), False
        except SandboxError as exc:
            return Outcome(error="crash", details=str(exc)), False
        if reply.get("id") != nonce or not isinstance(reply.get("cpu_s"), int | float):
            return Outcome(error="crash", details="the worker sent a malformed reply"), False
        self.cpu_s = float(reply["cpu_s"])
        keep = not reply.get("recycle") and not self._buffer  # more than the reply: something else wrote
        if not reply.get("ok"):
            return Outcome(error="runtime", details=reply.get("details")), keep
        if reply.get("value") is None:
            problem = f"grade() must return a number, got {reply.get('value_type')}"
            return Outcome(error="runtime", details=problem), keep
        return Outcome(value=reply["value"]), keep

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            select.select([], [self._in], [], remaining)
            try:
                view = view[os.write(self._in, view):]
            except BlockingIOError:
                continue
            except OSError as exc:  # broken pipe: the worker is gone
                raise SandboxError(self._death()) from exc

    def _read(self, deadline: float) -> dict:
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if not select.select([self._out], [], [], remaining)[0]:
                continue
            chunk = os.read(self._out, 1 << 16)
            if not chunk:
                raise SandboxError(self._death())
            self._buffer += chunk
            if len(self._buffer) > MAX_REPLY_BYTES:
                raise SandboxError("the worker sent an oversized reply")
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except ValueError as exc:
            raise SandboxError("the worker sent a malformed reply") from exc
        if not isinstance(reply, dict):
            raise SandboxError("the worker sent a malformed reply")
        return reply

    def _death(self) -> str:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return "the worker closed its pipe"
        if code < 0:
            return f"the worker was killed by {signal.Signals(-code).name}"
        return f"the worker exited with status {code}"

    def kill(self) -> None:
        if self.proc.returncode is None:  # not yet reaped, so its pid (= its group) is still its own
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


class SandboxPool:
    """Up to `size` worker processes, started on demand, each serving one call at a time.
    `run` blocks only while all are busy, and each call is bounded by `timeout_s`."""

    def __init__(self, size: int = 2, limits: SandboxLimits | None = None):
        self.size, self.limits = size, limits or SandboxLimits()
        self._slots = threading.BoundedSemaphore(size)
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.started = 0  # workers started, ever
        self.replaced = 0  # workers killed after a timeout, crash or limit
        self.network_isolation: str | None = None  # what the last worker started reported

    def run(self, source: str, sample: Any, item: Any) -> Outcome:
        """grade(sample, item) of `source`: its number, or why there is none."""
        return self._call({"source": source, "sample": sample, "item": item}, self.limits.timeout_s)

    def call_function(self, source: str, function: str, kwargs: dict[str, Any],
                      timeout_s: float | None = None) -> Outcome:
        """function(**kwargs) of `source` within `timeout_s` (default: the pool's limit): what it
        returned, as text (JSON unless a string), or why not."""
        return self._call({"source": source, "function": function, "kwargs": kwargs},
                          timeout_s or self.limits.timeout_s)

    def _call(self, task: dict[str, Any], timeout_s: float) -> Outcome:
        with self._slots:
            try:
                worker = self._take()
            except (SandboxError, OSError) as exc:
                log.warning("python grader sandbox unavailable: %s", exc)
                return Outcome(error="sandbox_unavailable", details=str(exc))
            keep = False
            try:
                outcome, keep = worker.call(task, timeout_s)
            finally:
                self._give(worker, keep)
            if outcome.error in ("timeout", "crash"):
                log.warning("python sandbox worker %s replaced: %s", worker.pid, outcome.details)
            return outcome

    def pids(self) -> list[int]:
        """The live workers' process ids, busy or idle."""
        with self._lock:
            return sorted(w.pid for w in self._live)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._live.difference_update(idle)
        for worker in idle:
            worker.kill()

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            while self._idle:
                worker = self._idle.pop()
                if worker.usable():
                    return worker
                self._live.discard(worker)
                worker.kill()
        worker = _Worker(self.limits)
        with self._lock:
            self._live.add(worker)
            self.started += 1
            self.network_isolation = worker.network
        return worker

    def _give(self, worker: _Worker, keep: bool) -> None:
        with self._lock:
            if keep and worker.usable() and not self._closed:
                self._idle.append(worker)
                return
            if not keep:
                self.replaced += 1
            self._live.discard(worker)
        worker.kill()


_default: SandboxPool | None = None
_default_lock = threading.Lock()


def default_pool() -> SandboxPool:
    """The process-wide pool (min(4, CPUs) workers, default limits), made on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = SandboxPool(size=max(1, min(4, os.cpu_count() or 1)))
            atexit.register(_default.close)
        return _default


@dataclasses.dataclass(kw_only=True)
class PythonGrader(Grader):
    """Runs `source`'s grade(sample, item) in the sandbox; its number is the reward."""

    type: ClassVar[str] = "python"
    source: str
    image_tag: str | None = None  # accepted for OpenAI compatibility, ignored
    pool: SandboxPool | None = dataclasses.field(default=None, metadata={"json": False}, repr=False,
                                                 compare=False)

    @classmethod
    def from_json(cls, f: Fields) -> PythonGrader:
        source = f.text("source")
        if (problem := source_problem(source, "grade", "(sample, item)")) is not None:
            raise f.bad("source", problem)
        image_tag = f.get("image_tag")
        if image_tag is not None and not isinstance(image_tag, str):
            raise f.bad("image_tag", "must be a string")
        return cls(name=f.text("name"), source=source, image_tag=image_tag)

    def _grade(self, sample: dict, item: Any, judge: Judge | None) -> GradeResult:
        outcome = (self.pool or default_pool()).run(self.source, sample, item)
        if outcome.error is None:
            reward, problem = as_reward(outcome.value)
            if problem is None:
                return GradeResult(reward)
            outcome = Outcome(error="runtime", details=problem)
        if outcome.error == "runtime":
            return GradeResult.failed({"python_grader_runtime_error_details": outcome.details},
                                      python_grader_runtime_error=True)
        return GradeResult.failed({"python_grader_server_error_type": outcome.error},
                                  python_grader_server_error=True,
                                  unresponsive_reward_error=outcome.error == "timeout")


def source_problem(source: str, name: str, signature: str = "(...)") -> str | None:
    """Why `source` cannot be run in the sandbox as `name`: too long, does not compile, or does not
    define it at top level; None if it can."""
    if len(source.encode()) > MAX_SOURCE_BYTES:
        return f"is longer than {MAX_SOURCE_BYTES} bytes"
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        where = f" (line {exc.lineno})" if exc.lineno else ""
        return f"does not compile: {exc.msg}{where}"
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, deep nesting
        return f"does not compile: {exc or type(exc).__name__}"
    if name not in _top_level_names(tree):
        return f"must define {name}{signature} at top level"
    return None


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names
