"""Resident memory and one-stream decode of the served default model, per weight format, beside
llama.cpp on the same GGUF file, one run.

For each `--quantization` format a freshly started `python -m kiln.server` (default settings, the
executable cache as it is) answers `--requests` short chats one after another, then one
`--new-tokens` stream whose decode rate is timed from its first token to its last. Reported: the
server's resident memory (VmRSS) after start and after the requests, the KV pool's own resident
bytes (`/v1/config` kv_pool.resident_bytes: the blocks requests wrote) and its budget, against the
GGUF file's size plus that KV. The peer: llama-cpp-python (`--peer-python`, an interpreter that
has it; 2 threads, the same chats through its chat completion, then the same timed stream), in
its own process, measured the same way. Then each server's memory in parts: the runtime before
any model, the weights as loaded, the KV written, the step executables (what loading the step
set adds), and the rest.

    python bench/serve_memory.py [--quantization none,int8] [--requests 4] [--new-tokens 128]
                                 [--peer-python /path/to/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import httpx
from common import QUESTIONS, start_server

from kiln.models.loader import default_model_path

MiB = 1 << 20

PEER = r"""
import json, sys, time
from llama_cpp import Llama
path, questions, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
llm = Llama(model_path=path, n_threads=2, n_ctx=2048, verbose=False)
ready = rss()
for q in questions:
    llm.create_chat_completion([{"role": "user", "content": q}], max_tokens=32, temperature=0)
stamps = []
for _ in llm.create_completion("Once upon a time", max_tokens=new_tokens, temperature=0, stream=True):
    stamps.append(time.perf_counter())
print(json.dumps({"rss_ready": ready, "rss_after": rss(), "tokens": len(stamps),
                  "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0])}))
"""


# the parts of a server's memory that a process can name: the runtime (Python, JAX's CPU backend and
# the server's modules, before any model), the weights as loaded (their arrays' bytes), and the step
# executables (what loading the server's step set adds, with the freed heap handed back before each
# reading: XLA:CPU keeps every kernel of a loaded executable as an object of its own)
PARTS = r"""
import json, os, sys
os.environ["KILN_MODEL_QUANTIZATION"] = sys.argv[1]
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
import jax, uvicorn, kiln.cli, kiln.server.app, kiln.engine.core
from kiln.config import resolve_settings
from kiln.engine.host_memory import trim_heap
from kiln.engine.setup import build_engine
from kiln.engine.warmup import build_step_set
jax.devices()
runtime = rss()
engine = build_engine(resolve_settings(), show_progress=False)
runner = engine._core.runner
trim_heap()
before = rss()
done = engine.at_boundary(lambda: build_step_set(runner, show_progress=False, defer_lora=True)).result()
trim_heap()
print(json.dumps({"runtime": runtime, "weights": sum(x.nbytes for x in jax.tree.leaves(runner.params)),
                  "executables": rss() - before, "count": done["executables"]}))
engine.shutdown()
"""


def parts_of(quantization: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PARTS, quantization], capture_output=True, text=True, timeout=600,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def timed_stream(url: str, model: str, new_tokens: int) -> tuple[int, float]:
    """(tokens, decode tok/s) of one greedy completion stream, first token to last."""
    stamps = []
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": new_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                stamps.append(time.perf_counter())
    return len(stamps), (len(stamps) - 1) / (stamps[-1] - stamps[0])


def kiln_run(quantization: str, requests: int, new_tokens: int) -> dict:
    proc, url = start_server({"KILN_MODEL_QUANTIZATION": quantization, "KILN_SERVER_LOG_LEVEL": "warning"})
    try:
        ready = vm_rss(proc.pid)
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        for q in QUESTIONS[:requests]:
            r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
                "model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 32, "temperature": 0})
            r.raise_for_status()
        tokens, tps = timed_stream(url, model, new_tokens)
        pool = httpx.get(url + "/v1/config", timeout=30).json()["kv_pool"]
        return {"rss_ready": ready, "rss_after": vm_rss(proc.pid), "kv_resident": pool["resident_bytes"],
                "kv_budget": pool["bytes"], "kv_reason": pool["reason"], "tokens": tokens, "decode_tps": tps}
    finally:
        proc.terminate()
        proc.wait(60)


def peer_run(python: str, path: str, requests: int, new_tokens: int) -> dict | None:
    proc = subprocess.run([python, "-c", PEER, path, json.dumps(QUESTIONS[:requests]), str(new_tokens)],
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        print(f"llama.cpp peer not run: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else '?'}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="none,int8")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--peer-python", default=sys.executable)
    args = ap.parse_args()
    path = str(default_model_path())
    file_bytes = os.path.getsize(path)
    rows = {f"kiln {q}": kiln_run(q, args.requests, args.new_tokens) for q in args.quantization.split(",")}
    peer = peer_run(args.peer_python, path, args.requests, args.new_tokens)
    if peer:
        rows["llama.cpp (2 threads)"] = peer
    print(f"\n{os.path.basename(path)}: {file_bytes / MiB:.0f} MiB on disk; {args.requests} chats of 32 tokens, "
          f"then one {args.new_tokens}-token stream")
    print(f"{'server':<22} | {'RSS ready':>9} | {'RSS after':>9} | {'KV written':>10} | {'file + KV':>9} | "
          f"{'RSS / (file + KV)':>17} | {'decode tok/s':>12} | {'vs llama.cpp':>12}")
    for name, r in rows.items():
        kv = r.get("kv_resident") or 0
        vs = f"{r['decode_tps'] / peer['decode_tps']:.2f}x" if peer else "-"
        print(f"{name:<22} | {r['rss_ready'] / MiB:>7.0f}Mi | {r['rss_after'] / MiB:>7.0f}Mi | "
              f"{kv / MiB if 'kv_resident' in r else float('nan'):>8.1f}Mi | {(file_bytes + kv) / MiB:>7.0f}Mi | "
              f"{r['rss_after'] / (file_bytes + kv):>16.2f}x | {r['decode_tps']:>12.1f} | {vs:>12}")
    for name, r in rows.items():
        if "kv_budget" in r:
            print(f"{name}: KV pool {r['kv_budget'] / MiB:.0f} MiB budgeted ({r['kv_reason']}), "
                  f"{r['kv_resident'] / MiB:.1f} MiB of it resident")
    print("\nwhere a server's memory goes (RSS after the requests): the runtime is a process with Python, JAX's CPU "
          "backend and the server's modules imported, no model; the weights, their arrays' bytes as loaded; the step "
          "executables, what loading the step set adds; the rest: the server's own state, step buffers, the heap")
    print(f"{'server':<22} | {'runtime':>8} | {'weights':>8} | {'KV written':>10} | {'executables':>15} | "
          f"{'the rest':>8} | {'RSS after':>9} | {'(RSS - runtime) / (file + KV)':>29}")
    for q in args.quantization.split(","):
        r, p = rows[f"kiln {q}"], parts_of(q)
        kv = r["kv_resident"] or 0
        rest = r["rss_after"] - p["runtime"] - p["weights"] - kv - p["executables"]
        steps = f"{p['executables'] / MiB:.0f}Mi ({p['count']})"
        print(f"{'kiln ' + q:<22} | {p['runtime'] / MiB:>6.0f}Mi | {p['weights'] / MiB:>6.0f}Mi | {kv / MiB:>8.1f}Mi | "
              f"{steps:>15} | {rest / MiB:>6.0f}Mi | {r['rss_after'] / MiB:>7.0f}Mi | "
              f"{(r['rss_after'] - p['runtime']) / (file_bytes + kv):>28.2f}x")


if __name__ == "__main__":
    main()
