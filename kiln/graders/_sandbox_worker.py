"""The process that runs untrusted Python (graders' `grade(sample, item)`, agent runs' `kiln_python`
tools) ; started by `python_sandbox.SandboxPool` as `python -I _sandbox_worker.py CONFIG` (standard
library only, so it starts in milliseconds).

Before any grader code runs it:
1. sets hard resource limits: address space (RLIMIT_AS), a lifetime CPU budget (RLIMIT_CPU),
   file size (RLIMIT_FSIZE), no core dumps;
2. moves into new user + network namespaces when the kernel allows it: the only interface
   left is a loopback that is down, so no socket can reach anything, whatever the code does;
3. moves the request pipe off fds 0 and 1 (which then read and write /dev/null), so grader
   code that reads stdin or prints cannot corrupt the protocol;
4. installs an audit hook (`sys.addaudithook`) that refuses network sockets and name lookups,
   process creation, signals to other processes, and raw ctypes calls and memory access.
   Audit hooks are not a security boundary by themselves; they are the layer that still
   refuses the network where namespaces are not available, and they give grader code a
   clear PermissionError instead of a timeout.

Then it answers requests, one JSON line each, until its stdin closes. Each request gets a
CPU soft limit of its time limit plus a second (SIGXCPU ends a runaway); the parent's
wall-clock timeout, which kills the worker, is the limit that always holds.
"""

import json
import numbers
import os
import resource
import socket
import sys
import threading
import time
import traceback

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
_BLOCKED = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
            "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo", "subprocess.Popen", "os.system",
            "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.killpg", "ctypes.dlopen",
            "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata", "ctypes.string_at",
            "ctypes.wstring_at"}


_AF_UNIX = getattr(socket, "AF_UNIX", None)


def _isolate_network() -> str:
    """Unshares the network namespace (inside a new user namespace, which needs no
    privilege where unprivileged user namespaces are enabled). Returns what isolates."""
    unshare = getattr(os, "unshare", None)  # Python 3.12+
    if unshare is None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)

            def unshare(flags):
                if libc.unshare(flags) != 0:
                    raise OSError(ctypes.get_errno(), "unshare")
        except (OSError, AttributeError):
            return "audit-hook"
    for flags, label in ((CLONE_NEWUSER | CLONE_NEWNET, "user+network namespace"),
                         (CLONE_NEWNET, "network namespace")):
        try:
            unshare(flags)
            return label
        except OSError:
            continue
    return "audit-hook"


def _audit(event, args):
    if event in _BLOCKED:
        raise PermissionError(f"the python grader sandbox does not allow {event}")
    if event == "socket.__new__" and args[1] != _AF_UNIX:  # socketpair() (asyncio's wake-up pipe) stays
        raise PermissionError("the python grader sandbox does not allow network sockets")
    if event == "os.kill" and args[0] != os.getpid():
        raise PermissionError("the python grader sandbox does not allow signals to other processes")


def _watch_parent(parent: int) -> None:
    """Exits when the parent is gone (killed, even mid-call): no orphan keeps running."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


_dumps = json.dumps  # bound before any untrusted code runs: it may patch the json module


def _run(request, cache, cpu_hard):
    soft = min(int(_cpu_seconds() + request["cpu_s"]) + 1, cpu_hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_hard))
    source = request["source"]
    try:
        code = cache.get(source)
        if code is None:
            code = cache[source] = compile(source, "<grader>", "exec")
        namespace = {"__name__": "__grader__", "__builtins__": __builtins__}
        exec(code, namespace)
        name = request.get("function", "grade")
        function = namespace.get(name)
        if not callable(function):
            signature = "(sample, item)" if name == "grade" else "(...)"
            return {"ok": False, "error": "runtime", "details": f"the source defines no {name}{signature} function"}
        if "kwargs" in request:  # a tool: any JSON-able value, returned as text
            value = function(**request["kwargs"])
            return {"ok": True, "value": value if isinstance(value, str) else _dumps(value, default=str)}
        value = function(request["sample"], request["item"])
    except MemoryError:
        return {"ok": False, "error": "runtime", "recycle": True,
                "details": f"MemoryError: the grader went over its memory limit of {request['memory_bytes']} bytes"}
    except BaseException as exc:  # SystemExit too: the grader's failure, not the worker's
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # drop this frame
        details = "".join(traceback.format_exception(type(exc), exc, tb))[-4000:]
        return {"ok": False, "error": "runtime", "details": details}
    if isinstance(value, numbers.Real):  # numpy scalars too
        return {"ok": True, "value": float(value)}
    return {"ok": True, "value": None, "value_type": type(value).__name__}


def main():
    config = json.loads(sys.argv[1])
    cpu_hard = config["cpu_budget_s"]
    for limit, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_AS, config["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, config["file_bytes"]), (resource.RLIMIT_CPU, cpu_hard)):
        try:
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):  # not every OS enforces every limit (macOS: RLIMIT_AS)
            pass
    network = _isolate_network() if config["isolate_network"] else "audit-hook"
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    threading.stack_size(256 << 10)
    threading.Thread(target=_watch_parent, args=(config["parent_pid"],), daemon=True).start()
    threads = threading.active_count()
    sys.addaudithook(_audit)
    dumps, loads = json.dumps, json.loads  # bound now: grader code may patch the json module
    replies.write(dumps({"ready": True, "network": network, "pid": os.getpid()}) + "\n")
    replies.flush()
    cache = {}
    for line in requests:
        request = loads(line)
        reply = _run(request, cache, cpu_hard)
        reply["id"] = request["id"]
        reply["cpu_s"] = _cpu_seconds()
        if threading.active_count() > threads:  # grader code left threads running: start afresh
            reply["recycle"] = True
        replies.write(dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
