"""KV-event publisher: vLLM wire format over real ZMQ sockets on 127.0.0.1."""

import queue
import threading
import time

import msgpack
import msgspec
import pytest
import zmq

from kiln.engine.kv_events import KVEventPublisher, offset_endpoint_port
from kiln.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch

ANY_PORT = "tcp://127.0.0.1:*"
TOKENS = list(range(100, 116))


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def publishers():
    made = []

    def make(**kw):
        kw.setdefault("endpoint", ANY_PORT)
        p = KVEventPublisher(**kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def wait_until(pred, timeout=3.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def recv(sock, timeout_ms=2000):
    assert sock.poll(timeout_ms), "no message within timeout"
    return sock.recv_multipart()


def seq_of(frame):
    assert len(frame) == 8
    return int.from_bytes(frame, "big", signed=True)


def subscribe(ctx, pub, topic=b""):
    """SUB connected to ``pub`` and known to be live (ZMQ drops messages to slow joiners).

    Sends probe batches until one arrives, drains the rest; returns (sub, next_seq).
    """
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(pub.endpoint)
    deadline = time.monotonic() + 5
    while not sub.poll(20):
        assert time.monotonic() < deadline, "subscription never became live"
        pub.publish([AllBlocksCleared()])
    wait_until(lambda: pub.drained() and pub.published_batches > 0)
    last = pub.published_batches - 1
    while seq_of(recv(sub)[1]) != last:
        pass
    return sub, last + 1


def test_pub_frames_seq_and_raw_layout(ctx, publishers):
    pub = publishers(topic="kv-events", data_parallel_rank=0)
    sub, seq0 = subscribe(ctx, pub, b"kv-events")
    pub.publish([BlockStored([1, 2], None, TOKENS, 16)])
    pub.publish([BlockRemoved([2**64 - 1]), AllBlocksCleared()])
    pub.publish([])  # no-op: no batch, no seq

    topic, seq, payload = recv(sub)
    assert topic == b"kv-events" and len(seq) == 8 and seq_of(seq) == seq0
    ts, events, rank = msgpack.unpackb(payload)
    assert abs(ts - time.time()) < 5 and rank == 0
    assert events == [["BlockStored", [1, 2], None, TOKENS, 16, None, "GPU", None]]

    topic, seq, payload = recv(sub)
    assert seq_of(seq) == seq0 + 1
    assert msgpack.unpackb(payload)[1] == [
        ["BlockRemoved", [2**64 - 1], "GPU"],
        ["AllBlocksCleared"],
    ]
    assert not sub.poll(100)
    assert pub.dropped_batches == 0


def test_default_topic_is_empty_like_vllm(ctx, publishers):
    pub = publishers()
    sub, seq0 = subscribe(ctx, pub)
    pub.publish([AllBlocksCleared()])
    topic, seq, _ = recv(sub)
    assert topic == b"" and seq_of(seq) == seq0


def test_publisher_connects_to_bound_subscriber(ctx, publishers):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(ANY_PORT)
    endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)  # no "*": the publisher connects
    pub = publishers(endpoint=endpoint)
    deadline = time.monotonic() + 5
    while not sub.poll(20):
        assert time.monotonic() < deadline
        pub.publish([AllBlocksCleared()])
    assert decode_batch(recv(sub)[2]).events == [AllBlocksCleared()]


def test_decode_batch_roundtrip_and_compat():
    stored = BlockStored([7], 3, TOKENS, 16, lora_id=5, medium="CPU", lora_name="a")
    batch = KVEventBatch(1.5, [stored, BlockRemoved([7], None), AllBlocksCleared()], 2)
    assert decode_batch(msgspec.msgpack.encode(batch)) == batch
    # positional structs keep default-valued fields: a None rank is still on the wire
    raw = msgpack.unpackb(msgspec.msgpack.encode(KVEventBatch(1.5, [AllBlocksCleared()])))
    assert raw == [1.5, [["AllBlocksCleared"]], None]
    assert decode_batch(msgpack.packb([1.5, []])).data_parallel_rank is None  # older vLLM
    # older vLLM (no lora_name) and newer positional payloads (extra trailing fields) decode
    old = msgpack.packb([2.0, [["BlockStored", [1], None, [1, 2], 2, None, "GPU"]]])
    assert decode_batch(old).events[0].lora_name is None
    new = msgpack.packb(
        [2.0, [["BlockStored", [1], None, [1, 2], 2, None, "GPU", None, [None], 0]]]
    )
    assert decode_batch(new).events[0].block_hashes == [1]


def test_offset_endpoint_port():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint_port(ANY_PORT, 3) == ANY_PORT
    assert offset_endpoint_port(None, 3) is None


def _replay(ctx, endpoint, start, delimiter=True):
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    prefix = [b""] if delimiter else []
    dealer.send_multipart([*prefix, start.to_bytes(8, "big", signed=True)])
    got = []
    while True:
        frames = recv(dealer)
        assert frames[: len(prefix)] == prefix and len(frames) == len(prefix) + 2
        seq, payload = frames[len(prefix) :]
        if seq_of(seq) == -1:
            assert payload == b""
            dealer.close(linger=0)
            return got
        got.append((seq_of(seq), decode_batch(payload)))


def test_replay_from_start_seq_with_bounded_buffer(ctx, publishers):
    pub = publishers(replay_endpoint=ANY_PORT, buffer_steps=4)
    assert "*" not in pub.replay_endpoint
    for i in range(6):
        pub.publish([BlockRemoved([i])])
    wait_until(lambda: pub.published_batches == 6)

    got = _replay(ctx, pub.replay_endpoint, 3)  # vLLM/REQ-style: empty delimiter frame
    assert [s for s, _ in got] == [3, 4, 5]
    assert [b.events[0].block_hashes for _, b in got] == [[3], [4], [5]]
    assert [s for s, _ in _replay(ctx, pub.replay_endpoint, 0, delimiter=False)] == [2, 3, 4, 5]
    assert _replay(ctx, pub.replay_endpoint, 99) == []


def test_close_is_quick_flushes_and_idempotent(ctx, publishers):
    pub = publishers(replay_endpoint=ANY_PORT)
    sub, seq0 = subscribe(ctx, pub)
    for i in range(50):
        pub.publish([BlockRemoved([i])])
    t0 = time.monotonic()
    pub.close()
    pub.close()
    assert time.monotonic() - t0 < 1.0
    assert not pub._thread.is_alive()
    seqs = [seq_of(recv(sub)[1]) for _ in range(50)]  # queued batches were flushed
    assert seqs == list(range(seq0, seq0 + 50))
    pub.publish([AllBlocksCleared()])  # after close: dropped, never raises or blocks
    assert pub.dropped_batches == 1


def test_full_queue_drops_and_counts(publishers):
    pub = publishers(max_queue_size=2)
    gate = threading.Event()

    class GatedQueue(queue.Queue):  # stalls the publisher thread until the gate opens
        def get(self, *args, **kwargs):
            gate.wait()
            return super().get(*args, **kwargs)

    pub._queue = GatedQueue(maxsize=2)
    t0 = time.monotonic()
    for i in range(5):
        pub.publish([BlockRemoved([i])])
    assert time.monotonic() - t0 < 0.5
    assert pub.dropped_batches == 3
    gate.set()
    wait_until(lambda: pub.published_batches == 2)


def test_slow_subscriber_never_blocks_publishing_thread(ctx, publishers):
    pub = publishers(hwm=10, max_queue_size=100_000)
    sub = ctx.socket(zmq.SUB)  # connected, but never reads
    sub.setsockopt(zmq.RCVHWM, 10)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    n, big = 3000, list(range(4096))
    elapsed = []

    def engine():
        t0 = time.monotonic()
        for i in range(n):
            pub.publish([BlockStored([i], None, big, 16)])
        elapsed.append(time.monotonic() - t0)

    t = threading.Thread(target=engine)
    t.start()
    t.join(5)
    assert not t.is_alive() and elapsed[0] < 2.0
    wait_until(lambda: pub.published_batches + pub.dropped_batches == n, timeout=10)
    t0 = time.monotonic()
    pub.close()
    assert time.monotonic() - t0 < 1.0


def test_map_encoding_publishes_field_names(ctx, publishers):
    pub = publishers(encoding="map")
    sub, seq0 = subscribe(ctx, pub)
    pub.publish([BlockStored([1], None, TOKENS, 16, lora_name="a"), BlockRemoved([1]), AllBlocksCleared()])
    _, seq, payload = recv(sub)
    assert seq_of(seq) == seq0
    batch = msgpack.unpackb(payload)
    assert batch["data_parallel_rank"] == 0 and abs(batch["ts"] - time.time()) < 5
    assert batch["events"] == [  # fields at their default (lora_id, medium) are left out
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": TOKENS,
         "block_size": 16, "lora_name": "a"},
        {"type": "BlockRemoved", "block_hashes": [1]},
        {"type": "AllBlocksCleared"},
    ]
    with pytest.raises(ValueError, match="encoding"):
        KVEventPublisher(ANY_PORT, encoding="json")
