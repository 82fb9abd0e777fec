"""256 streaming clients against the real server, a tenth of them hanging up mid-stream:
every other stream completes, the block pool returns to all free, and nothing hangs
(every wait has a deadline)."""

import asyncio
import json
import random
import re

import httpx
import pytest
from server_process import ServerProcess

MODEL = "tiny-llama"
CLIENTS = 256
MAX_TOKENS = 24
HANG_UP_MAX_TOKENS = 200  # long enough that a client hangs up while its request is still generating
DEADLINE_S = 600


@pytest.fixture(scope="module")
def server(tiny_model, kiln_cache):
    srv = ServerProcess(tiny_model.source, str(kiln_cache), KILN_MODEL_SERVED_MODEL_NAME=MODEL,
                        KILN_SERVER_MAX_WAITING_REQUESTS="1024", KILN_ENGINE_MAX_NUM_SEQS="16",
                        KILN_ENGINE_DECODE_ROW_BUCKETS="1,2,4,8,16", KILN_ENGINE_NUM_KV_BLOCKS="256")
    yield srv
    srv.stop_cleanly()


async def stream_one(client: httpx.AsyncClient, i: int, hang_up_after: int | None) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"client {i}: tell me something"}],
            "max_tokens": MAX_TOKENS if hang_up_after is None else HANG_UP_MAX_TOKENS, "temperature": 0.8, "seed": i,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events, chunks, finish, usage = 0, 0, None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            events += 1
            for choice in event["choices"]:
                chunks += bool(choice["delta"].get("content"))
                finish = choice["finish_reason"] or finish
            usage = event.get("usage") or usage
            if hang_up_after is not None and events >= hang_up_after:
                return {"hung_up": True}
    return {"hung_up": False, "finish": finish, "usage": usage, "chunks": chunks}


def metric(text: str, name: str, **labels) -> float:
    label_text = ",".join(f'{k}="{v}"' for k, v in sorted({"model_name": MODEL, **labels}.items()))
    m = re.search(rf"^{re.escape(name)}{{{re.escape(label_text)}}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_256_streams_with_disconnects_leave_nothing_behind(server):
    rng = random.Random(0)
    # client i hangs up after hang_ups[i] events (the role chunk, then about one per token)
    hang_ups = {i: rng.randint(2, MAX_TOKENS // 2) for i in rng.sample(range(CLIENTS), CLIENTS // 10)}

    async def main():
        limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE_S, limits=limits) as client:
            tasks = [stream_one(client, i, hang_ups.get(i)) for i in range(CLIENTS)]
            return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)

    results = asyncio.run(main())
    completed = [r for r in results if not r["hung_up"]]
    assert len(completed) == CLIENTS - len(hang_ups)
    for r in completed:
        assert r["finish"] == "length" and r["usage"]["completion_tokens"] == MAX_TOKENS, r
        assert 0 < r["chunks"] <= MAX_TOKENS

    async def drained():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            for _ in range(300):
                text = (await client.get("/metrics")).text
                idle = all(metric(text, f"vllm:{name}") == 0.0
                           for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
                if idle:
                    return text
                await asyncio.sleep(0.1)
        raise AssertionError("the engine did not return to idle within 30 s:\n" + text)

    text = asyncio.run(drained())
    # the engine recorded every request once, when it ended: a hung-up one as aborted, or as
    # finished when the engine generated its 200 tokens before the server saw the disconnect (a
    # tiny model outruns 256 streams' delivery on two cores, so how many is down to timing; that
    # a hang-up aborts its request is test_server.py's test_client_disconnect_aborts_the_request)
    length = metric(text, "vllm:request_success_total", finished_reason="length")
    aborted = metric(text, "vllm:request_success_total", finished_reason="abort")
    assert length + aborted == CLIENTS and length >= len(completed)
