"""The router's KV-event ingest and prefix index, against Kiln's real publisher over ZMQ on 127.0.0.1."""

import random
import threading
import time

import msgpack
import msgspec
import pytest
import zmq

from kiln.engine.kv_events import KVEventPublisher
from kiln.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, as_map_form
from kiln.router.config import RouterConfig, Worker, WorkerSet
from kiln.router.ingest import KVIngest, fetch_replay, ingest_for
from kiln.router.kv_index import KVIndex, block_keys
from kiln.router.kv_wire import Batch, Cleared, Malformed, Removed, Stored, Unknown, decode_payload

ANY = "tcp://127.0.0.1:*"
BS = 4


def toks(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def encode(events, encoding="array", ts=1.0, rank=0) -> bytes:
    batch = KVEventBatch(ts, list(events), rank)
    return msgspec.msgpack.encode(as_map_form(batch) if encoding == "map" else batch)


def wait_until(pred, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# ---- decoding --------------------------------------------------------------------------------------

EVENTS = [
    BlockStored([11, 12], None, toks(2), BS),
    BlockStored([13], 12, toks(1, 50), BS, lora_id=3, medium="CPU", lora_name="ad"),
    BlockRemoved([11]),
    AllBlocksCleared(),
]
DECODED = [
    Stored((11, 12), None, toks(2), BS),
    Stored((13,), 12, toks(1, 50), BS, 3, "CPU", "ad"),
    Removed((11,)),
    Cleared(),
]


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_both_encodings_decode_alike(encoding):
    raw = msgpack.unpackb(encode(EVENTS, encoding))
    assert isinstance(raw, list if encoding == "array" else dict)
    if encoding == "map":
        assert raw["events"][0]["type"] == "BlockStored" and "medium" not in raw["events"][0]  # a default: left out
    assert decode_payload(encode(EVENTS, encoding)) == Batch(1.0, DECODED, 0)


def test_decoding_is_tolerant():
    # bytes hashes, extra trailing elements, unknown keys and types, a batch without a rank
    array = [2.0, [["BlockStored", [b"\x01" * 16], None, toks(1), BS, None, "GPU", None, [None], 0]]]
    assert decode_payload(msgpack.packb(array)).events == [Stored((b"\x01" * 16,), None, toks(1), BS)]
    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": b"p", "token_ids": toks(1)}
    doc = {"ts": 2, "events": [{**stored, "block_size": BS, "extra_keys": [1]}, {"type": "Future"}], "x": 1}
    batch = decode_payload(msgpack.packb(doc))
    assert batch == Batch(2.0, [Stored((1,), b"p", toks(1), BS), Unknown("Future")], None)
    assert decode_payload(msgpack.packb([1.0, [["BlockRemoved", [7]]]])).events == [Removed((7,))]  # older vLLM


@pytest.mark.parametrize(
    "payload",
    [b"\xc1garbage", msgpack.packb(7), msgpack.packb([1.0]), msgpack.packb({"ts": 1.0}), msgpack.packb([1.0, 5])],
)
def test_unreadable_batches(payload):
    assert isinstance(decode_payload(payload), Malformed)


@pytest.mark.parametrize(
    "event",
    [
        ["BlockStored", [1, 2], None, toks(1), BS],  # 4 tokens for 2 blocks of 4
        ["BlockStored", [1], None, toks(1), 0],
        ["BlockStored", [1], None, toks(1), True],
        ["BlockStored", ["h"], None, toks(1), BS],
        ["BlockStored", [1], 1.5, toks(1), BS],
        ["BlockStored", [1], None, [0, 1, 2, "3"], BS],
        ["BlockStored", [1], None, toks(1)],
        ["BlockStored", [1], None, toks(1), BS, "lora", "GPU"],
        ["BlockRemoved"],
        ["BlockRemoved", 5],
        [3, [1]],
        [],
        "BlockRemoved",
        {"block_hashes": [1]},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": toks(1)},
    ],
)
def test_malformed_events_are_skipped_alone(event):
    batch = decode_payload(msgpack.packb([1.0, [event, ["AllBlocksCleared"]]]))
    assert isinstance(batch.events[0], Malformed) and batch.events[1] == Cleared()


# ---- the index ----------------------------------------------------------------------------------------


def test_match_counts_leading_blocks_per_worker():
    index = KVIndex(BS)
    prompt = toks(4)
    index.store(0, ["a0", "a1", "a2"], None, prompt[: 3 * BS])
    index.store(0, ["a3"], "a2", prompt[3 * BS :])
    index.store(1, [10], None, prompt[:BS])
    index.add_worker(2)
    assert index.match(prompt + [99]) == {0: 4, 1: 1, 2: 0}  # a partial last block never counts
    assert index.match(prompt[:7]) == {0: 1, 1: 1, 2: 0}
    assert index.match(toks(4, 1)) == {0: 0, 1: 0, 2: 0}
    assert index.match(prompt, lora_name="ad") == {0: 0, 1: 0, 2: 0}  # another adapter, other blocks
    assert index.size() == 4 and index.blocks_of(0) == 4 and index.blocks_of(1) == 1
    assert index.prompt_keys(prompt) == block_keys(prompt, BS)

    assert index.remove(0, ["a1", "unknown"]) == 1  # a hole: worker 0 now matches one block
    assert index.match(prompt)[0] == 1 and index.blocks_of(0) == 3
    assert not index.store(0, ["a9"], "a1", toks(1))  # its parent is gone: cannot be placed
    index.clear(1)
    assert index.match(prompt) == {0: 1, 1: 0, 2: 0}
    index.remove_worker(0)
    assert index.match(prompt) == {1: 0, 2: 0} and index.size() == 0 and index.workers() == [1, 2]
    index.store(3, ["b"], None, toks(1, 1), lora="ad")  # reuses worker 0's slot
    assert index.match(toks(1, 1), "ad") == {1: 0, 2: 0, 3: 1}


def test_a_worker_keeps_a_block_until_its_last_engine_hash_goes():
    index = KVIndex(BS)
    index.store(0, ["x"], None, toks(1))
    index.store(0, ["y"], None, toks(1))  # same tokens under another engine hash (a cache salt)
    index.store(0, ["x"], None, toks(1))  # stored again: no double count
    index.remove(0, ["x"])
    assert index.match(toks(1)) == {0: 1}
    index.remove(0, ["y"])
    assert index.match(toks(1)) == {0: 0} and index.size() == 0
    index.store(0, ["x"], None, toks(1))
    index.store(0, ["x"], None, toks(1, 7))  # the engine reused the hash for other content
    assert index.match(toks(1)) == {0: 0} and index.match(toks(1, 7)) == {0: 1} and index.size() == 1
    with pytest.raises(ValueError):
        index.store(0, ["z"], None, toks(1)[:-1])


def test_match_equals_a_brute_force_reference():
    """Random stores, removals and clears on 5 workers; every match checked against a plain model.

    Engine hashes are few (content hashed mod 61), so a worker's engine reuses them for other
    content, and a stored block's parent may be unknown, or another block than the engine meant.
    """
    rng = random.Random(1234)
    roots = [[rng.randrange(5) for _ in range(6 * BS)] for _ in range(4)]
    loras = [None, "ad"]
    workers = range(5)
    index = KVIndex(BS)
    # the model: per worker, engine hash -> the block's content, ((lora, block tokens), ...) from the first
    ref: dict[int, dict] = {w: {} for w in workers}

    def engine_hash(w, salt, lora, prefix):
        return hash(("engine", w, salt, lora, tuple(prefix))) % 61

    def prompt():
        root = rng.choice(roots)
        cut = rng.randrange(len(root) + 1)
        return root[:cut] + [rng.randrange(5) for _ in range(rng.randrange(3) * BS)]

    def blocks(tokens):
        return [tuple(tokens[i : i + BS]) for i in range(0, len(tokens) - BS + 1, BS)]

    for _ in range(3000):
        w, op = rng.choice(workers), rng.random()
        if op < 0.6:  # store blocks [a, b) of a prompt, chained after block a - 1
            p, lora, salt = prompt(), rng.choice(loras), rng.randrange(2)
            n = len(p) // BS
            if n == 0:
                continue
            a = rng.randrange(n)
            b = rng.randrange(a, n) + 1
            hashes = [engine_hash(w, salt, lora, p[: (i + 1) * BS]) for i in range(a, b)]
            parent = engine_hash(w, salt, lora, p[: a * BS]) if a else None
            placed = index.store(w, hashes, parent, p[a * BS : b * BS], lora)
            assert placed == (parent is None or parent in ref[w])
            if placed:
                content = () if parent is None else ref[w][parent]
                for h, block in zip(hashes, blocks(p[a * BS : b * BS]), strict=True):
                    content = (*content, (lora, block))
                    ref[w][h] = content
        elif op < 0.9 and ref[w]:
            gone = rng.sample(sorted(ref[w]), rng.randrange(1, min(4, len(ref[w])) + 1))
            assert index.remove(w, [*gone, 1000]) == len(gone)
            for h in gone:
                del ref[w][h]
        elif op < 0.93:
            index.clear(w)
            ref[w].clear()
        for _ in range(2):
            p, lora = prompt(), rng.choice(loras)
            wanted = [(lora, block) for block in blocks(p)]
            expected = {}
            for v in workers:
                held = set(ref[v].values())
                k = 0
                while k < len(wanted) and tuple(wanted[: k + 1]) in held:
                    k += 1
                expected[v] = k
            got = index.match(p, lora)
            assert {v: got.get(v, 0) for v in workers} == expected
        assert index.size() == len({c for held in ref.values() for c in held.values()})
        assert index.blocks_of(w) == len(set(ref[w].values()))


# ---- ingest ---------------------------------------------------------------------------------------------


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def cleanup():
    things = []
    yield things.append
    for thing in reversed(things):
        thing() if callable(thing) else thing.close()


def worker(num: int, endpoint: str, replay: str | None = None) -> Worker:
    return Worker(
        worker_id_str=f"w{num}", worker_id_num=num, model_name="m", zmq_endpoint=endpoint, replay_endpoint=replay
    )


def start_ingest(cleanup, *workers, block_size=BS, replay_timeout_ms=2000) -> KVIngest:
    ws = WorkerSet(name="a", profile="p", kv_block_size=block_size).model_copy(update={"workers": workers})
    ingest = KVIngest(ws, replay_timeout_ms=replay_timeout_ms)
    ingest.start()
    cleanup(ingest.stop)
    return ingest


def synced(ingest: KVIngest, pub: KVEventPublisher, wid: int) -> None:
    """Wait until ingest has applied all that ``pub`` published."""
    wait_until(lambda: pub.drained() and pub.published_batches > 0, what="publishing")
    last = pub.published_batches - 1
    wait_until(lambda: ingest.stats(wid).last_seq == last, what=f"seq {last} applied")


def live(ingest: KVIngest, pub: KVEventPublisher, wid: int) -> None:
    """Publish probes until the subscription carries them (ZMQ drops what a SUB joining late misses)."""
    deadline = time.monotonic() + 5
    while ingest.stats(wid).last_seq is None:
        assert time.monotonic() < deadline, "subscription never became live"
        pub.publish([AllBlocksCleared()])
        time.sleep(0.02)
    synced(ingest, pub, wid)


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_events_from_kiln_publishers_reach_the_index(cleanup, encoding):
    pubs = [KVEventPublisher(ANY, encoding=encoding) for _ in range(2)]
    for pub in pubs:
        cleanup(pub)
    ingest = start_ingest(cleanup, worker(0, pubs[0].endpoint), worker(7, pubs[1].endpoint))
    live(ingest, pubs[0], 0)
    live(ingest, pubs[1], 7)
    prompt = toks(3)

    pubs[0].publish([BlockStored([1, 2], None, prompt[: 2 * BS], BS), BlockStored([3], 2, prompt[2 * BS :], BS)])
    pubs[1].publish([BlockStored([b"\xaa"], None, prompt[:BS], BS, lora_name="ad")])
    synced(ingest, pubs[0], 0)
    synced(ingest, pubs[1], 7)
    assert ingest.index.match(prompt) == {0: 3, 7: 0}
    assert ingest.index.match(prompt, "ad") == {0: 0, 7: 1}

    pubs[0].publish([BlockRemoved([2])])
    pubs[1].publish([AllBlocksCleared()])
    synced(ingest, pubs[0], 0)
    synced(ingest, pubs[1], 7)
    assert ingest.index.match(prompt) == {0: 1, 7: 0} and ingest.index.blocks_of(7) == 0
    stats = ingest.stats(0)
    assert stats.events >= 3 and stats.malformed == stats.gaps == stats.replays_failed == 0
    assert stats.evicted is None and time.time() - stats.last_event_at < 5
    assert set(ingest.status()) == {0, 7} and not ingest.is_evicted(0)


def test_the_index_agrees_with_a_kiln_block_pool(cleanup):
    """Kiln's block pool caches and evicts under random traffic; after each step the router's match
    for a prompt equals the prefix the pool itself would find for it."""
    from kiln.engine.block_pool import BlockPool, block_hashes

    pub = KVEventPublisher(ANY)
    cleanup(pub)
    ingest = start_ingest(cleanup, worker(0, pub.endpoint))
    live(ingest, pub, 0)
    events = []
    pool = BlockPool(
        24,
        BS,
        on_stored=lambda hashes, parent, tokens, lora: events.append(
            BlockStored(hashes, parent, tokens, BS, None, "GPU", lora)
        ),
        on_removed=lambda hashes: events.append(BlockRemoved(hashes)),
    )
    rng = random.Random(7)
    roots = [[rng.randrange(50) for _ in range(8 * BS)] for _ in range(5)]

    def prompt():
        lora = rng.choice([None, "ad"])
        root = rng.choice(roots)[: rng.randrange(1, 8) * BS]
        return root + [rng.randrange(50) for _ in range(rng.randrange(3 * BS))], lora

    for _ in range(60):  # one request per step, as the scheduler does it
        tokens, lora = prompt()
        hashes = block_hashes(tokens, BS, (lora,))
        hits = pool.lookup(hashes)
        pool.touch(hits)
        ids = hits + pool.allocate(-(-len(tokens) // BS) - len(hits))
        full = len(tokens) // BS
        parent = hashes[len(hits) - 1] if hits else None
        pool.cache_blocks(
            ids[len(hits) : full], hashes[len(hits) : full], tokens[len(hits) * BS : full * BS], parent, lora
        )
        pool.release(ids)
        pub.publish(events)
        events.clear()
        synced(ingest, pub, 0)
        for _ in range(3):
            tokens, lora = prompt()
            assert ingest.index.match(tokens, lora)[0] == len(pool.lookup(block_hashes(tokens, BS, (lora,))))
    stats = ingest.stats(0)
    assert stats.orphans == stats.malformed == stats.gaps == 0 and ingest.index.size() > 0


def test_first_message_catches_up_from_the_replay_buffer(cleanup):
    pub = KVEventPublisher(ANY, replay_endpoint=ANY)
    cleanup(pub)
    prompt = toks(2)
    pub.publish([BlockStored([1], None, prompt[:BS], BS)])
    pub.publish([BlockStored([2], 1, prompt[BS:], BS)])
    wait_until(lambda: pub.published_batches == 2)
    ingest = start_ingest(cleanup, worker(0, pub.endpoint, pub.replay_endpoint))
    # live probes: the first one that arrives (seq >= 2) triggers the catch-up from seq 0
    deadline = time.monotonic() + 5
    while ingest.stats(0).last_seq is None:
        assert time.monotonic() < deadline
        pub.publish([BlockRemoved([99])])
        time.sleep(0.02)
    synced(ingest, pub, 0)
    assert ingest.index.match(prompt) == {0: 2}
    stats = ingest.stats(0)
    assert stats.replays_ok == 1 and stats.gaps == 0 and stats.batches == pub.published_batches


class FakeWorker:
    """A raw PUB socket and a replay ROUTER, to send what a Kiln publisher never would (gaps, garbage)."""

    def __init__(self, ctx, replay=True):
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(ANY)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0
        self.buffer: dict[int, bytes] = {}
        self.answer = True  # False: take replay requests and never answer
        self.requests: list[int] = []
        self.replay_endpoint = None
        self._stop = threading.Event()
        if replay:
            router = ctx.socket(zmq.ROUTER)
            router.bind(ANY)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self._thread.start()

    def _serve(self, router):
        while not self._stop.is_set():
            if not router.poll(20):
                continue
            ident, empty, start = router.recv_multipart()
            start = int.from_bytes(start, "big", signed=True)
            self.requests.append(start)
            if self.answer:
                for seq in sorted(s for s in list(self.buffer) if s >= start):
                    router.send_multipart([ident, b"", seq.to_bytes(8, "big", signed=True), self.buffer[seq]])
                router.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])
        router.close(linger=0)

    def send(self, events=(), deliver=True, payload=None, encoding="array") -> int:
        seq, self.seq = self.seq, self.seq + 1
        payload = encode(events, encoding) if payload is None else payload
        self.buffer[seq] = payload
        if deliver:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big", signed=True), payload])
        return seq

    def live(self, ingest, wid):
        deadline = time.monotonic() + 5
        while ingest.stats(wid).last_seq is None:
            assert time.monotonic() < deadline, "subscription never became live"
            self.send()
            time.sleep(0.02)
        self.synced(ingest, wid)

    def synced(self, ingest, wid):
        wait_until(lambda: ingest.stats(wid).last_seq == self.seq - 1, what=f"seq {self.seq - 1} applied")

    def close(self):
        self._stop.set()
        if self.replay_endpoint:
            self._thread.join()
        self.pub.close(linger=0)


def fake(ctx, cleanup, **kw) -> FakeWorker:
    w = FakeWorker(ctx, **kw)
    cleanup(w)
    return w


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_a_gap_is_filled_by_a_replay(ctx, cleanup, encoding):
    w = fake(ctx, cleanup)
    ingest = start_ingest(cleanup, worker(0, w.endpoint, w.replay_endpoint))
    w.live(ingest, 0)
    before = ingest.stats(0)
    prompt = toks(3)
    w.send([BlockStored([1], None, prompt[:BS], BS)], encoding=encoding)
    gap = w.send([BlockStored([2], 1, prompt[BS : 2 * BS], BS)], deliver=False, encoding=encoding)
    w.send([BlockStored([3], 2, prompt[2 * BS :], BS)], deliver=False, encoding=encoding)
    w.send([BlockRemoved([99])], encoding=encoding)
    w.synced(ingest, 0)
    assert ingest.index.match(prompt) == {0: 3}
    stats = ingest.stats(0)
    assert stats.gaps == before.gaps + 1 and stats.replays_ok == before.replays_ok + 1
    assert w.requests[-1] == gap and stats.orphans == 0 and stats.batches == w.seq


@pytest.mark.parametrize("how", ["timeout", "no endpoint", "buffer too short"])
def test_an_unrepaired_gap_clears_the_worker(ctx, cleanup, how):
    w = fake(ctx, cleanup, replay=how != "no endpoint")
    ingest = start_ingest(cleanup, worker(0, w.endpoint, w.replay_endpoint), replay_timeout_ms=300)
    w.live(ingest, 0)
    w.send([BlockStored([1], None, toks(1), BS)])
    w.synced(ingest, 0)
    assert ingest.index.match(toks(1)) == {0: 1}
    failed = ingest.stats(0).replays_failed
    if how == "timeout":
        w.answer = False
    lost = w.send([BlockRemoved([1])], deliver=False)
    if how == "buffer too short":
        del w.buffer[lost]
    w.send([BlockStored([5], None, toks(1, 40), BS)])
    w.synced(ingest, 0)
    assert ingest.index.match(toks(1)) == {0: 0}  # cleared: the removal might have been missed
    assert ingest.index.match(toks(1, 40)) == {0: 1}  # the live batch after the gap still applies
    stats = ingest.stats(0)
    assert stats.gaps == 1 and stats.replays_failed == failed + 1


def test_fetch_replay_times_out(ctx):
    router = ctx.socket(zmq.ROUTER)
    router.bind(ANY)
    t0 = time.monotonic()
    reason = fetch_replay(ctx, router.getsockopt_string(zmq.LAST_ENDPOINT), 0, 150)
    assert isinstance(reason, str) and "150 ms" in reason and time.monotonic() - t0 < 1
    assert len(router.recv_multipart(zmq.NOBLOCK)) == 3  # identity, the REQ-style delimiter, the seq


def test_a_restarted_worker_starts_over(ctx, cleanup):
    w = fake(ctx, cleanup, replay=False)
    ingest = start_ingest(cleanup, worker(0, w.endpoint))
    w.live(ingest, 0)
    w.send([BlockStored([1], None, toks(1), BS)])
    w.synced(ingest, 0)
    w.seq = 0  # a new publisher counts from 0 again
    w.send([BlockStored([1], None, toks(1, 40), BS)])
    w.synced(ingest, 0)
    assert ingest.index.match(toks(1)) == {0: 0} and ingest.index.match(toks(1, 40)) == {0: 1}
    assert ingest.stats(0).restarts == 1 and ingest.stats(0).gaps == 0


def test_a_worker_with_another_block_size_is_evicted(cleanup):
    pub = KVEventPublisher(ANY)
    cleanup(pub)
    good = KVEventPublisher(ANY)
    cleanup(good)
    ingest = start_ingest(cleanup, worker(0, pub.endpoint), worker(1, good.endpoint))
    live(ingest, pub, 0)
    live(ingest, good, 1)
    pub.publish([BlockStored([1], None, toks(1), BS)])
    synced(ingest, pub, 0)
    pub.publish([BlockStored([2], None, toks(2), 2 * BS, medium="CPU")])  # an offload tier: not checked
    pub.publish([BlockStored([3], None, toks(2), 2 * BS)])
    wait_until(lambda: ingest.is_evicted(0), what="eviction")
    pub.publish([BlockStored([4], None, toks(1, 40), BS)])  # ignored from now on
    good.publish([BlockStored([1], None, toks(1), BS)])
    synced(ingest, good, 1)
    time.sleep(0.1)
    assert ingest.index.match(toks(1)) == {1: 1} and ingest.index.match(toks(1, 40)) == {1: 0}
    stats = ingest.stats(0)
    assert "block_size 8" in stats.evicted and "is 4" in stats.evicted and stats.ignored == 1
    assert not ingest.is_evicted(1) and ingest.index.workers() == [1]


def test_malformed_input_is_counted_and_skipped(ctx, cleanup):
    w = fake(ctx, cleanup, replay=False)
    ingest = start_ingest(cleanup, worker(0, w.endpoint))
    w.live(ingest, 0)
    w.send(payload=b"\xc1 not msgpack")
    w.pub.send_multipart([b"", b"\x00" * 8])  # two frames
    w.pub.send_multipart([b"", b"\x00" * 9, encode([])])  # a 9-byte seq
    bad = ["BlockStored", [1, 2], None, toks(1), BS]  # 4 tokens for 2 blocks
    good = ["BlockStored", [1], None, toks(1), BS]
    orphan = ["BlockStored", [2], 777, toks(1, 40), BS]
    w.send(payload=msgpack.packb([1.0, [bad, good, orphan, ["Future", 1], ["BlockRemoved", [3], "DISK"]]]))
    w.send([BlockStored([5], None, toks(1, 80), BS)])
    w.synced(ingest, 0)
    assert ingest.index.match(toks(1)) == {0: 1} and ingest.index.match(toks(1, 80)) == {0: 1}
    assert ingest.index.match(toks(1, 40)) == {0: 0}
    stats = ingest.stats(0)
    assert stats.malformed == 4 and stats.orphans == 1 and stats.ignored == 2 and stats.gaps == 0


def test_workers_come_and_go(cleanup):
    pub = KVEventPublisher(ANY)
    cleanup(pub)
    ingest = start_ingest(cleanup)
    assert ingest.index.match(toks(1)) == {}
    ingest.add_worker(worker(3, pub.endpoint))
    live(ingest, pub, 3)
    pub.publish([BlockStored([1], None, toks(1), BS)])
    synced(ingest, pub, 3)
    assert ingest.index.match(toks(1)) == {3: 1} and ingest.last_event_at(3) is not None
    ingest.remove_worker(3)
    assert ingest.index.match(toks(1)) == {} and ingest.status() == {}
    with pytest.raises(ValueError, match="zmq_endpoint"):
        ingest.add_worker(worker(4, ""))
    t0 = time.monotonic()
    ingest.stop()
    ingest.stop()
    assert time.monotonic() - t0 < 1


def test_ingest_for_a_config():
    ws = {"name": "a", "profile": "p", "kv_block_size": 16}
    config = RouterConfig.model_validate({"listen": "x", "profile": [{"name": "p"}], "workerset": [ws]})
    ingests = ingest_for(config)
    assert list(ingests) == ["a"] and ingests["a"].index.block_size == 16
    assert ingests["a"].replay_timeout_ms == 60000
    ingests["a"].stop()
    assert ingest_for(config.model_copy(update={"mock_mode": True})) == {}
