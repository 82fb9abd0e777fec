"""Streams served while a fine-tuning job trains in the same server, against the same streams on
the idle server, one run: idle, while an SFT job trains, while a GRPO job trains.

Starts `python -m kiln.server` (the default model), warms it up, then in each phase streams
--rounds rounds of --streams concurrent chat completions (greedy, --new-tokens each) and records
every stream's time to first token and the gaps between its chunks (ITL). For each job it also
measures its training throughput alone (--quiet seconds with no requests) and under that load,
from the job's own metrics events (tokens per second of wall time, waits included), and reads
the training slices from /v1/runtime. A training step is sliced so that it holds the
accelerator for at most `[train] max_slice_ms` at a time (see docs/training.md).

    python bench/serve_while_training.py [--streams 4] [--rounds 4] [--new-tokens 48] [--max-slice-ms 100]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai
from common import start_server

ROOT = Path(__file__).parent.parent
DATA = ROOT / "notebooks" / "data" / "contacts_train.jsonl"
HAS_NAME = {"type": "string_check", "name": "has_name", "input": "{{ sample.output_text }}", "reference": "name",
            "operation": "like"}


def stream(client: openai.OpenAI, model: str, new_tokens: int, i: int) -> tuple[float, list[float]]:
    """(time to first token, the gaps between chunks) of one streamed chat completion."""
    t0 = time.perf_counter()
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"({i}) Tell me about the sea."}], max_tokens=new_tokens,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    stamps = [time.perf_counter() for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def serve(client, model, args, base: int) -> tuple[list[float], list[float]]:
    """TTFTs and gaps of --rounds rounds of --streams concurrent streams."""
    ttfts, gaps = [], []
    with concurrent.futures.ThreadPoolExecutor(args.streams) as pool:
        for r in range(args.rounds):
            for ttft, g in pool.map(lambda i: stream(client, model, args.new_tokens, i),
                                    range(base + r * args.streams, base + (r + 1) * args.streams)):
                ttfts.append(ttft)
                gaps.extend(g)
    return ttfts, gaps


def rates(client, job_id: str, since: float, until: float) -> list[float]:
    """tokens_per_second of the job's steps that ended in [since, until] (epoch seconds)."""
    events = client.fine_tuning.jobs.list_events(job_id, limit=100).data
    return [e.data["tokens_per_second"] for e in events if e.type == "metrics" and since <= e.created_at <= until]


def slices(url: str) -> dict:
    return httpx.get(url + "/v1/runtime").json()["ownership"]["training_slices"]


def job_phase(client, url, model, args, name: str, create, base: int) -> dict:
    job = create()
    while len([e for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data if e.type == "metrics"]) < 2:
        status = client.fine_tuning.jobs.retrieve(job.id).status
        if status in ("failed", "cancelled", "succeeded"):
            raise SystemExit(f"the {name} job ended early: {status}")
        time.sleep(1)  # past its first steps: compiled, its slice costs measured
    t0 = time.time()
    time.sleep(args.quiet)
    alone = rates(client, job.id, t0, time.time())
    before, t1 = slices(url), time.time()
    ttfts, gaps = serve(client, model, args, base)
    loaded, after = rates(client, job.id, t1, time.time()), slices(url)
    client.fine_tuning.jobs.cancel(job.id)
    while client.fine_tuning.jobs.retrieve(job.id).status != "cancelled":
        time.sleep(0.5)
    time.sleep(2)
    return {"name": name, "ttfts": ttfts, "gaps": gaps, "alone": alone, "loaded": loaded,
            "slices": after["count"] - before["count"], "slice_p50": after["p50_ms"], "slice_p99": after["p99_ms"],
            "slice_max": after["max_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-slice-ms", type=float, default=100.0)
    ap.add_argument("--serving-share", type=float, default=0.5)
    ap.add_argument("--quiet", type=float, default=30.0, help="seconds a job trains alone before the streams")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        proc, url = start_server({"KILN_TRAIN_DATA_DIR": data_dir, "KILN_SERVER_LOG_LEVEL": "warning",
                                  "KILN_ADAPTERS_STORE": str(Path(data_dir) / "adapters"),
                                  "KILN_TRAIN_MAX_SLICE_MS": str(args.max_slice_ms),
                                  "KILN_TRAIN_SERVING_SHARE": str(args.serving_share)})
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            model = client.models.list().data[0].id
            serve(client, model, args, -100)  # warm-up: the buckets these streams use
            idle_ttfts, idle_gaps = serve(client, model, args, 0)
            sft_file = client.files.create(file=DATA.open("rb"), purpose="fine-tune")
            prompts = [{"messages": json.loads(line)["messages"][:1]} for line in DATA.read_text().splitlines()[:32]]
            grpo_file = client.files.create(file=("prompts.jsonl", "\n".join(map(json.dumps, prompts)).encode()),
                                            purpose="fine-tune")
            kiln = {"lora": {"rank": 8}, "max_seq_len": 128, "auto_load": False}
            phases = [
                job_phase(client, url, model, args, "SFT", lambda: client.fine_tuning.jobs.create(
                    model=model, training_file=sft_file.id, extra_body={"kiln": {**kiln, "learning_rate": 1e-4}},
                    method={"type": "supervised", "supervised": {"hyperparameters": {
                        "n_epochs": 50, "batch_size": args.batch_size}}}), 1000),
                job_phase(client, url, model, args, "GRPO", lambda: client.fine_tuning.jobs.create(
                    model=model, training_file=grpo_file.id, extra_body={"kiln": {
                        **kiln, "grpo": {"num_generations": 4, "max_completion_tokens": 32}}},
                    method={"type": "reinforcement", "reinforcement": {"grader": HAS_NAME, "hyperparameters": {
                        "n_epochs": 50, "batch_size": 2}}}), 2000),
            ]
        finally:
            proc.terminate()
            proc.wait(120)
    ms = lambda xs, q: float(np.percentile(xs, q)) * 1e3  # noqa: E731
    print(f"{args.rounds} rounds of {args.streams} concurrent streams x {args.new_tokens} tokens; "
          f"[train] max_slice_ms = {args.max_slice_ms:g}, serving_share = {args.serving_share:g}")
    print(f"{'':18}{'p50 ITL':>10}{'p99 ITL':>10}{'max ITL':>10}{'p50 TTFT':>10}{'max TTFT':>10}   ms")
    idle_p99 = ms(idle_gaps, 99)
    for name, ttfts, gaps in [("idle", idle_ttfts, idle_gaps)] + [(p["name"] + " job", p["ttfts"], p["gaps"])
                                                                    for p in phases]:
        print(f"{name:18}{ms(gaps, 50):10.1f}{ms(gaps, 99):10.1f}{max(gaps) * 1e3:10.1f}"
              f"{ms(ttfts, 50):10.1f}{max(ttfts) * 1e3:10.1f}")
    print(f"\ntargets: p99 ITL <= max(3 x idle p99, 150) = {max(3 * idle_p99, 150):.0f} ms; "
          f"max ITL <= 2 x max_slice_ms = {2 * args.max_slice_ms:.0f} ms")
    print(f"\n{'':18}{'slices':>8}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}{'tok/s alone':>13}{'under load':>12}"
          f"{'of ideal':>10}")
    for p in phases:
        alone = statistics.median(p["alone"]) if p["alone"] else float("nan")
        loaded = statistics.median(p["loaded"]) if p["loaded"] else float("nan")
        ideal = alone * (1 - args.serving_share)
        print(f"{p['name'] + ' job':18}{p['slices']:8d}{p['slice_p50']:8.1f}{p['slice_p99']:8.1f}"
              f"{p['slice_max']:8.1f}{alone:13.0f}{loaded:12.0f}{loaded / ideal:10.2f}")
    print("(slice p50/p99/max over the server's last 4096 training writes; 'of ideal': training tok/s under "
          "load over (1 - serving_share) x alone; steps that ended while streams ran)")


if __name__ == "__main__":
    main()
