"""Latency of the router's prefix match: KVIndex.match on 64 workers holding 10,000 blocks each.

Workers cache prefixes of a shared pool of documents (each 128 blocks of 16 tokens), each to a
random depth, until it holds 10,000 blocks: many workers share most prefixes, so a match walks far
with many workers still alive (close to the worst case). Picks are a document prefix of random
length plus up to 64 blocks of new tokens; "hot prefix" picks share a 4,096-token prefix that
every worker holds. Prints p50/p99 per pick, in wall-clock time and in the thread's CPU time
(the second leaves out preemption, which makes the wall-clock tail on a busy machine). CPU only;
runs in a few seconds.

    python bench/router_index.py [--workers 64] [--blocks 10000] [--picks 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kiln.router.kv_index import KVIndex

BLOCK = 16
DOC_BLOCKS = 128


def build(workers: int, blocks: int, docs: list[list[int]], rng: random.Random) -> KVIndex:
    index = KVIndex(BLOCK)
    for w in range(workers):
        held: dict[int, int] = {}  # doc -> depth stored
        total = 0
        while total < blocks:
            d = rng.randrange(len(docs))
            depth = min(rng.randrange(16, DOC_BLOCKS + 1), held.get(d, 0) + blocks - total)
            start = held.get(d, 0)
            if depth <= start:
                continue
            # the engine's hashes: any per-worker values chaining the same way
            hashes = [(d, i) for i in range(start, depth)]
            parent = (d, start - 1) if start else None
            index.store(w, hashes, parent, docs[d][start * BLOCK : depth * BLOCK])
            held[d] = depth
            total += depth - start
    return index


def timed(index: KVIndex, prompts: list[list[int]]) -> tuple[list[float], list[float]]:
    """Milliseconds per match: wall clock, and this thread's CPU time."""
    wall, cpu = [], []
    for p in prompts:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        index.match(p)
        cpu.append((time.thread_time_ns() - c0) / 1e6)
        wall.append((time.perf_counter_ns() - t0) / 1e6)
    return wall, cpu


def quantiles(ms: list[float]) -> str:
    ms = sorted(ms)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"p50 {statistics.median(ms):.3f} p99 {p99:.3f} max {ms[-1]:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=10_000, help="blocks each worker holds")
    ap.add_argument("--picks", type=int, default=2000)
    args = ap.parse_args()
    rng = random.Random(0)
    docs = [[rng.randrange(150_000) for _ in range(DOC_BLOCKS * BLOCK)] for _ in range(200)]

    t0 = time.perf_counter()
    index = build(args.workers, args.blocks, docs, rng)
    print(
        f"index: {args.workers} workers x {args.blocks} blocks, {index.size()} distinct, "
        f"built in {time.perf_counter() - t0:.2f} s"
    )

    mixed = []
    for _ in range(args.picks):
        doc = rng.choice(docs)
        cut = rng.randrange(1, DOC_BLOCKS + 1) * BLOCK
        mixed.append(doc[:cut] + [rng.randrange(150_000) for _ in range(rng.randrange(65) * BLOCK)])
    hot_prefix = [rng.randrange(150_000) for _ in range(4096)]
    for w in range(args.workers):
        index.store(w, [("hot", i) for i in range(4096 // BLOCK)], None, hot_prefix)
    hot = [hot_prefix + [rng.randrange(150_000) for _ in range(512)] for _ in range(args.picks)]

    for name, prompts in (("mixed", mixed), ("hot prefix", hot)):
        timed(index, prompts[:100])  # warm up
        depth = statistics.mean(max(index.match(p).values()) for p in prompts[:200])
        wall, cpu = timed(index, prompts)
        print(f"{name:<10} wall ms {quantiles(wall)} | cpu ms {quantiles(cpu)} | mean depth {depth:.0f} blocks")


if __name__ == "__main__":
    main()
