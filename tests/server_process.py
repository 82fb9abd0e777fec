"""Starts a real `python -m kiln.server` on loopback for tests, and stops it with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the engine settings of the suite's servers: a small step set (10 executables), built once per
# model shape and then loaded by every later server of the session
SUITE_ENGINE = {"KILN_ENGINE_DECODE_ROW_BUCKETS": "1,8", "KILN_ENGINE_PREFILL_TOKEN_BUCKETS": "16,64",
                "KILN_ENGINE_MAX_NUM_SEQS": "8", "KILN_ENGINE_MAX_NUM_BATCHED_TOKENS": "64",
                "KILN_ENGINE_NUM_KV_BLOCKS": "128"}
# for servers sent at most four prompts at once, whose starts build slowly (on a mesh, or Pallas in
# interpret mode): one decode and one prefill bucket, which every step of theirs pads into
FEW_PROMPT_BUCKETS = {"KILN_ENGINE_DECODE_ROW_BUCKETS": "4", "KILN_ENGINE_PREFILL_TOKEN_BUCKETS": "64"}

# the suite's processes compile without LLVM's optimizations, about a quarter less time over the model
# and engine tests (measured): their programs are small and run a few times each, so building them
# is most of their cost. conftest adds the flag to this process, and its children inherit it, except
# a default-model server, which runs compiled as users get it. `SUITE_XLA_FLAGS` is XLA_FLAGS as the
# suite was started, before conftest added the flag.
FAST_COMPILE_XLA_FLAG = "--xla_backend_optimization_level=0"
SUITE_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
# XLA_FLAGS of the processes that run on a mesh of four forced CPU devices (replace "=4" for another count)
FOUR_DEVICES = f"--xla_force_host_platform_device_count=4 {FAST_COMPILE_XLA_FLAG}"


def compile_fast(environ=os.environ) -> None:
    """Adds the fast-compile flag to `environ`'s XLA_FLAGS unless they set that level already."""
    flags = environ.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" not in flags:
        environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE_XLA_FLAG}".strip()


def suite_env(model_path: str, cache_dir: str, **overrides: str) -> dict[str, str]:
    """The environment of a Kiln process the suite starts: this one's without its KILN_ settings, and
    the suite's engine settings; a default-model server (no `model_path`) gets XLA_FLAGS as the suite
    was started (Kiln adds its own flags on import, kiln.xla_flags)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(JAX_PLATFORMS="cpu", KILN_MODEL_PATH=model_path, KILN_CACHE_DIR=cache_dir, **SUITE_ENGINE)
    if model_path:
        compile_fast(env)
    elif SUITE_XLA_FLAGS:
        env["XLA_FLAGS"] = SUITE_XLA_FLAGS
    else:
        env.pop("XLA_FLAGS", None)
    env.update(overrides)
    return env


class ServerProcess:
    """`health`: each /health poll of the start, from the moment the process was spawned: (seconds,
    status code or "refused", body); `while_starting(server, body)` runs at each poll that says starting."""

    def __init__(self, model_path: str, cache_dir: str, while_starting=None, **env_overrides: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = suite_env(model_path, cache_dir, PYTHONFAULTHANDLER="1",  # a hung server dumps its stacks on SIGABRT
                        KILN_SERVER_PORT=str(self.port), **env_overrides)
        self.proc = subprocess.Popen([sys.executable, "-m", "kiln.server"], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self._output: list[str] = []
        # drain the pipe all along: a full pipe would block the server's logging
        self._reader = threading.Thread(target=lambda: self._output.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        self.health: list[tuple[float, int | str, dict | None]] = []
        spawned = time.monotonic()
        deadline = spawned + 600  # a first start builds its step set
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._reader.join(5)
                # without nanobind's leak report, which IREE's bindings print at exit and would fill the tail
                said = "".join(line for line in self._output
                               if not line.lstrip(" -").startswith(("leaked", "nanobind")))
                raise RuntimeError(f"server exited early:\n{said[-4000:]}")
            try:  # up once its start is over: ready, or another state it stays in (maintenance answers 503)
                r = httpx.get(self.url + "/health", timeout=30)
                self.health.append((time.monotonic() - spawned, r.status_code, r.json()))
                if r.json()["status"] != "starting":
                    return
                if while_starting is not None:
                    while_starting(self, r.json())
            except httpx.ConnectError:
                self.health.append((time.monotonic() - spawned, "refused", None))
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not start in time")

    def stop(self, timeout: float = 60) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGABRT)  # stacks to the output, then exit
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._reader.join(10)
        return self.proc.returncode, "".join(self._output)

    def stop_cleanly(self) -> str:
        """Stops the server and asserts a clean exit (code 0, no traceback in its output)."""
        code, out = self.stop()
        assert code == 0, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        return out
