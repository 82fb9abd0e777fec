"""A run that spans processes (hosts): `[distributed]` settings -> `jax.distributed.initialize`.

Every process runs the same program on the same data; JAX joins their devices into one global
device list, so a mesh (kiln.models.sharding) spans hosts and XLA's collectives cross them (on
CPUs through Gloo). Process 0 hosts the coordinator; only it writes results (the adapter store,
TensorBoard). JAX aborts the process when the coordinator cannot be reached, so a process other
than 0 first waits for the coordinator's port itself, up to `timeout_s`, and fails with an error
naming the address.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import time

from kiln.errors import ConfigError

log = logging.getLogger("kiln.distributed")


def process_id(setting: int | str, environ=os.environ, hostname: str | None = None) -> int:
    """`[distributed] process_id` resolved: "auto" is a Kubernetes Indexed Job's completion index
    (JOB_COMPLETION_INDEX), else the ordinal a StatefulSet pod's host name ends in (`kiln-train-1`: 1)."""
    if setting != "auto":
        return int(setting)
    if (index := environ.get("JOB_COMPLETION_INDEX", "")).isdigit():
        return int(index)
    name = hostname if hostname is not None else socket.gethostname()
    if match := re.search(r"-(\d+)$", name):
        return int(match.group(1))
    raise ConfigError(f"distributed.process_id = auto: the host name {name!r} ends in no pod ordinal (-N) and "
                      "JOB_COMPLETION_INDEX is not set; set KILN_DISTRIBUTED_PROCESS_ID")


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"distributed.coordinator = {address!r}: expected host:port")
    return host.strip("[]"), int(port)


def connect_within(host: str, port: int, timeout_s: float, what: str) -> socket.socket:
    """A TCP connection to `what` at host:port, tried again until `timeout_s` has passed; then a
    ConfigError naming it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=1.0)
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ConfigError(f"cannot reach {what} within {timeout_s:g} s (distributed.timeout_s): "
                                  f"{exc.strerror or exc}") from None
            time.sleep(0.2)


def _wait_for(address: str, timeout_s: float) -> None:
    host, port = _split_address(address)
    connect_within(host, port, timeout_s, f"the coordinator at distributed.coordinator = {address}").close()


def _native_output_to_stderr() -> None:
    """Points file descriptor 1 at stderr and Python's stdout at a copy of the old descriptor 1: Gloo
    prints a line to the C++ stdout each time processes connect, which would land in the middle of a
    command's output (`kiln train sft --json`)."""
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = open(stdout, "w", buffering=1, encoding=sys.stdout.encoding, closefd=True)  # noqa: SIM115


def initialize(settings) -> int:
    """Joins this process to the run `settings.distributed` describes, before JAX starts its
    backends; returns the process's index (0 for a run of one process, which needs nothing)."""
    d = settings.distributed
    if d.num_processes == 1:
        return 0
    if not d.coordinator:
        raise ConfigError(f"distributed.num_processes = {d.num_processes} needs distributed.coordinator "
                          "(host:port of process 0)")
    index = process_id(d.process_id)
    if not 0 <= index < d.num_processes:
        raise ConfigError(f"distributed.process_id = {index}: expected 0 to {d.num_processes - 1} "
                          f"(distributed.num_processes = {d.num_processes})")
    _split_address(d.coordinator)
    import jax

    log.info("process %d of %d: joining the run at %s (waiting up to %d s)", index, d.num_processes, d.coordinator,
             d.timeout_s)
    started = time.monotonic()
    if index:
        _wait_for(d.coordinator, d.timeout_s)
    _native_output_to_stderr()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices' collectives across processes
    remaining = max(1, int(d.timeout_s - (time.monotonic() - started)))
    jax.distributed.initialize(d.coordinator, d.num_processes, index, initialization_timeout=remaining)
    log.info("process %d of %d: %d local and %d global devices", index, d.num_processes, jax.local_device_count(),
             jax.device_count())
    return index
