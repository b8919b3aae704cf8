"""Load and cancellation against a live `dspark serve` on SmolLM2.

64 concurrent streaming chat requests, a random third of them closed mid-stream: every other one
completes with the offline greedy text, the cancelled ones received a prefix of it, and afterwards
nothing runs and the KV-cache integrity check holds with no block in use. A disconnect (streaming or
not) aborts its request and frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import pytest

from dspark import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
NUM_REQUESTS = 64
MAX_TOKENS = 10
TOPICS = ["the moon", "coffee", "rivers", "volcanoes", "chess", "bees", "trains", "the ocean", "winter",
          "libraries", "bicycles", "clouds", "pianos", "deserts", "owls", "bread"]


def conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me one fact about {TOPICS[i % len(TOPICS)]}."}]


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_64_concurrent_streams_with_random_cancellations(smollm_server, smollm_llm):
    refs = [o.text for o in smollm_llm.chat([conversation(i) for i in range(len(TOPICS))],
                                             SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    rng = random.Random(20240601)
    cancel = set(rng.sample(range(NUM_REQUESTS), NUM_REQUESTS // 3))
    cut_after = {i: rng.randint(1, MAX_TOKENS // 2) for i in cancel}  # content chunks read before closing
    with httpx.Client(base_url=smollm_server.base_url) as h:
        aborts_before = metric(h.get("/metrics").text, "dspark:request_success_total", finished_reason="abort")

    async def one(client, i: int) -> tuple[str, str]:
        stream = await client.chat.completions.create(model=MODEL, messages=conversation(i), max_tokens=MAX_TOKENS,
                                                      temperature=0, stream=True)
        text, n = "", 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                n += 1
                if i in cancel and n >= cut_after[i]:
                    await stream.close()  # drops the connection mid-stream
                    return "cancelled", text
        return "done", text

    async def run_all():
        async with smollm_server.async_openai(timeout=600) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_REQUESTS)))

    t0 = time.perf_counter()
    results = asyncio.run(run_all())
    elapsed = time.perf_counter() - t0
    for i, (status, text) in enumerate(results):
        ref = refs[i % len(TOPICS)]
        if i in cancel:
            assert status == "cancelled" and ref.startswith(text), (i, text, ref)
        else:
            assert status == "done" and text == ref, (i, text, ref)

    state = smollm_server.wait_idle(timeout=30)
    assert state["integrity_ok"], state
    assert state["integrity"]["in_use"] == 0, state
    with httpx.Client(base_url=smollm_server.base_url) as h:
        aborts = metric(h.get("/metrics").text, "dspark:request_success_total", finished_reason="abort") - aborts_before
    # A request closed after its last token may have finished first; most were cut well before.
    assert 0 < aborts <= len(cancel)
    print(f"\n64 streams ({len(cancel)} cancelled, {int(aborts)} aborted in the engine) in {elapsed:.1f}s")


def _wait_running(srv, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while srv.debug_kv()["running"] == 0:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.05)


def test_stream_disconnect_frees_kv_at_once(smollm_server):
    body = {"model": MODEL, "messages": conversation(0), "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=smollm_server.base_url, timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any("content" in ln for ln in got)
            assert smollm_server.debug_kv()["integrity"]["in_use"] > 0
        t = time.perf_counter()  # the response is closed: the connection is gone
    state = smollm_server.wait_idle(timeout=10)
    freed_after = time.perf_counter() - t
    assert state["integrity_ok"] and state["integrity"]["in_use"] == 0, state
    assert freed_after < 5, freed_after


def test_non_streaming_disconnect_frees_kv_at_once(smollm_server):
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}

    async def go():
        async with httpx.AsyncClient(base_url=smollm_server.base_url, timeout=60) as h:
            task = asyncio.create_task(h.post("/v1/completions", json=body))
            await asyncio.to_thread(_wait_running, smollm_server)
            task.cancel()  # closes the connection with the request in flight
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    t = time.perf_counter()
    state = smollm_server.wait_idle(timeout=10)
    assert time.perf_counter() - t < 5
    assert state["integrity_ok"] and state["integrity"]["in_use"] == 0, state


def test_abort_does_not_disturb_neighbours(smollm_server, smollm_llm):
    """A request cancelled while others decode in the same batch leaves their text unchanged."""
    ref = smollm_llm.chat(conversation(3), SamplingParams(temperature=0, max_tokens=24))[0].text

    async def go():
        async with smollm_server.async_openai(timeout=300) as client:
            async def victim():
                s = await client.chat.completions.create(model=MODEL, messages=conversation(5), max_tokens=500,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
                n = 0
                async for c in s:
                    n += 1
                    if n == 5:
                        await s.close()
                        return

            async def keeper():
                r = await client.chat.completions.create(model=MODEL, messages=conversation(3), max_tokens=24,
                                                         temperature=0)
                return r.choices[0].message.content

            _, text = await asyncio.gather(victim(), keeper())
            return text

    assert asyncio.run(go()) == ref
    state = smollm_server.wait_idle(timeout=10)
    assert state["integrity_ok"] and state["integrity"]["in_use"] == 0


def test_metric_names_are_valid_prometheus(smollm_server):
    with httpx.Client(base_url=smollm_server.base_url) as h:
        text = h.get("/metrics").text
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert re.match(r"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})? \S+$", line), line
