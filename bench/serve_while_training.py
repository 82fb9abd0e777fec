"""Inter-token latency of streaming requests while an SFT job trains in the same server, against
the same requests on an idle server, one run.

Starts `python -m kiln.server` (the default model), warms it up, then streams --requests chat
completions one after another (greedy, --new-tokens each) and records the gaps between
chunks: first idle, then while a fine-tuning job (the notebook's contacts data) runs. A
training micro-step is a writer under accelerator ownership, so a stream waits at most one
training step between two tokens; the p99 shows that wait.

    python bench/serve_while_training.py [--requests 8] [--new-tokens 48] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import openai
from common import start_server

ROOT = Path(__file__).parent.parent
DATA = ROOT / "notebooks" / "data" / "contacts_train.jsonl"


def stream_gaps(client: openai.OpenAI, model: str, new_tokens: int, i: int) -> list[float]:
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"({i}) Tell me about the sea."}], max_tokens=new_tokens,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    stamps = [time.perf_counter() for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def percentiles(gaps: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(gaps, n=100)
    return statistics.median(gaps) * 1000, q[98] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        proc, url = start_server({"KILN_TRAIN_DATA_DIR": data_dir, "KILN_SERVER_LOG_LEVEL": "warning",
                                  "KILN_ADAPTERS_STORE": str(Path(data_dir) / "adapters")})
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            model = client.models.list().data[0].id
            for i in range(2):  # warm-up: compile the buckets these requests use
                stream_gaps(client, model, args.new_tokens, -1 - i)
            idle = [g for i in range(args.requests) for g in stream_gaps(client, model, args.new_tokens, i)]
            memory = {"before the job": rss_mib(proc.pid)}
            train = client.files.create(file=DATA.open("rb"), purpose="fine-tune")
            job = client.fine_tuning.jobs.create(
                model=model, training_file=train.id,
                method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 50,
                                                                                  "batch_size": args.batch_size}}},
                extra_body={"kiln": {"lora": {"rank": 8}, "learning_rate": 1e-4, "max_seq_len": 128,
                                     "auto_load": False}})
            while client.fine_tuning.jobs.retrieve(job.id).status != "running" or not [
                    e for e in client.fine_tuning.jobs.list_events(job.id).data if e.type == "metrics"]:
                time.sleep(1)  # until the first step has run (its compile is behind us)
            busy = [g for i in range(args.requests) for g in stream_gaps(client, model, args.new_tokens, 100 + i)]
            events = [e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data
                      if e.type == "metrics"]
            memory["during the job"] = rss_mib(proc.pid)
            client.fine_tuning.jobs.cancel(job.id)
            while client.fine_tuning.jobs.retrieve(job.id).status != "cancelled":
                time.sleep(0.5)
            time.sleep(2)
            memory["after the job"] = rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(120)
    (p50_idle, p99_idle), (p50_busy, p99_busy) = percentiles(idle), percentiles(busy)
    print(f"{args.requests} streams x {args.new_tokens} tokens, one at a time; SFT batch {args.batch_size} x <=128")
    print(f"{'':24}{'p50 ITL ms':>12}{'p99 ITL ms':>12}{'max ITL ms':>12}")
    print(f"{'idle':24}{p50_idle:12.1f}{p99_idle:12.1f}{max(idle) * 1000:12.1f}")
    print(f"{'while an SFT job runs':24}{p50_busy:12.1f}{p99_busy:12.1f}{max(busy) * 1000:12.1f}")
    rate = statistics.median(e["tokens_per_second"] for e in events) if events else 0.0
    print(f"the job took {len(events)} training steps meanwhile, at a median {rate:.0f} training tok/s")
    print("server resident memory: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in memory.items()))


if __name__ == "__main__":
    main()
