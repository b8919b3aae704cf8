"""In-process tests of the server with a fake engine (no model): speculative-decoding metrics, an engine
failure (503, never a crash), the serve CLI flags, and the bench's metric parsing."""

from __future__ import annotations

import argparse
import asyncio
import logging
from types import SimpleNamespace

import httpx
import pytest

from dspark.engine.llm_engine import RequestOutput
from dspark.sampling_params import InvalidRequestError
from dspark.server.app import build_app
from dspark.server.engine_client import EngineClient

# What the engine puts in a finished request's stats (dspark/spec/metrics.py): 4 steps of 3 drafts.
SPEC_STATS = {"spec_tau": 2.5, "spec_num_steps": 4, "spec_num_drafts": 12, "spec_num_accepted": 6,
              "spec_accepted_per_position": [3, 2, 1], "spec_conditional_acceptance": [0.75, 2 / 3, 0.5]}


class FakeTokenizer:
    chat_template = "fake"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 100 + 1 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


class FakeEngine:
    """Emits token i % 26 per step; finishes at max_tokens with the given stats; can fail on demand."""

    def __init__(self, fail_on_step: int | None = None, extra_stats: dict | None = None) -> None:
        self.model_name = "fake"
        self.config = SimpleNamespace(max_model_len=128)
        self.tokenizer = FakeTokenizer()
        self.requests: dict[str, dict] = {}
        self.fail_on_step = fail_on_step
        self.extra_stats = extra_stats or {}
        self.steps = 0
        self.kv = SimpleNamespace(usage=0.0, prefix_hit_rate=0.0, num_usable_blocks=10, block_size=16, reqs={},
                                  check_integrity=lambda: {"free": 10, "cached_free": 0, "in_use": 0, "total": 10})
        self.scheduler = SimpleNamespace(running=[], waiting=[])

    def tokenize_chat(self, messages):
        return [1, 2, 3]

    def add_request(self, prompt, params, request_id):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        self.requests[request_id] = {"prompt": list(prompt), "params": params, "out": [], "aborted": False}
        return request_id

    def abort(self, request_id):
        if request_id in self.requests:
            self.requests[request_id]["aborted"] = True

    def has_unfinished(self):
        return any(not r["aborted"] for r in self.requests.values())

    def step(self):
        self.steps += 1
        if self.fail_on_step is not None and self.steps >= self.fail_on_step:
            raise RuntimeError("simulated engine bug")
        outs = []
        for rid, r in list(self.requests.items()):
            delta = [] if r["aborted"] else [len(r["out"]) % 26]
            r["out"] += delta
            done = r["aborted"] or len(r["out"]) >= r["params"].max_tokens
            text = self.tokenizer.decode(r["out"])
            o = RequestOutput(rid, None, r["prompt"], text, list(r["out"]), self.tokenizer.decode(delta), delta, done,
                              ("abort" if r["aborted"] else "length") if done else None)
            if done:
                o.stats = {"num_prompt_tokens": len(r["prompt"]), "num_output_tokens": len(r["out"]),
                           **self.extra_stats}
                del self.requests[rid]
            outs.append(o)
        return outs


async def _with_app(engine, fn):
    client = EngineClient(engine)
    app = build_app(client, "fake")
    await client.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
            return await fn(h)
    finally:
        await client.shutdown()


def test_fake_engine_round_trip_and_spec_metrics():
    async def fn(h):
        r = await h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 10, "n": 2})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == ["abcdefghij"] * 2
        r = await h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 10,
                                                      "stream": True})
        assert r.text.rstrip().endswith("data: [DONE]")
        return (await h.get("/metrics")).text

    text = asyncio.run(_with_app(FakeEngine(extra_stats=SPEC_STATS), fn))
    lines = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
    assert lines['dspark:spec_decode_mean_acceptance_length{model_name="fake"}'] == pytest.approx(2.5)
    assert lines['dspark:spec_decode_num_drafts_total{model_name="fake"}'] == 12  # 3 requests x 4 steps
    assert lines['dspark:spec_decode_num_draft_tokens_total{model_name="fake"}'] == 36
    assert lines['dspark:spec_decode_num_accepted_tokens_total{model_name="fake"}'] == 18
    assert lines['dspark:spec_decode_acceptance_rate{model_name="fake"}'] == pytest.approx(0.5)
    assert lines['dspark:spec_decode_acceptance_rate_per_pos{model_name="fake",position="0"}'] == pytest.approx(0.75)
    assert lines['dspark:spec_decode_acceptance_rate_per_pos{model_name="fake",position="2"}'] == pytest.approx(0.25)
    assert lines['dspark:generation_tokens_total{model_name="fake"}'] == 30
    assert lines['dspark:request_success_total{finished_reason="length",model_name="fake"}'] == 3

    from dspark.bench.serve import _scrape, _spec_summary

    spec = _spec_summary({}, _scrape(text))
    assert spec["tau"] == pytest.approx(2.5)
    assert spec["acceptance_rate_per_position"] == pytest.approx([0.75, 0.5, 0.25])


def test_spec_metrics_from_engine_aggregate():
    """An engine with spec_stats (the real one) is read directly, conditional acceptance included."""
    from dspark.spec.metrics import SpecStats

    engine = FakeEngine()
    engine.spec_config = object()
    engine.spec_stats = SpecStats()
    for n, a in ((3, 3), (3, 1), (3, 0), (3, 2)):
        engine.spec_stats.record(n, a)

    async def fn(h):
        return (await h.get("/metrics")).text

    text = asyncio.run(_with_app(engine, fn))
    lines = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
    assert lines['dspark:spec_decode_mean_acceptance_length{model_name="fake"}'] == pytest.approx(engine.spec_stats.tau)
    cond = engine.spec_stats.conditional_acceptance
    for k, c in enumerate(cond):
        assert lines[f'dspark:spec_decode_conditional_acceptance_per_pos{{model_name="fake",position="{k}"}}'] == \
            pytest.approx(c)
    from dspark.bench.serve import _scrape, _spec_summary

    spec = _spec_summary({}, _scrape(text))
    assert spec["tau"] == pytest.approx(engine.spec_stats.tau)
    assert spec["conditional_acceptance_per_position"] == pytest.approx(cond)


def test_confidence_scheduling_counters_on_metrics():
    """An engine whose eager steps are confidence-scheduled exports the scheduler's counts."""
    from dspark.spec.adaptive import ConfidenceScheduler
    from dspark.spec.metrics import SpecStats

    engine = FakeEngine()
    engine.spec_config = object()
    engine.spec_stats = SpecStats()
    cs = ConfidenceScheduler(lambda r: 1e-3 * (10 + r))
    cs.schedule([[0.9, 0.5, 0.1], [0.2]], [False, False])
    cs.stats["paused_steps"] = 7
    engine.runner = type("Runner", (), {"conf_sched": cs})()

    async def fn(h):
        return (await h.get("/metrics")).text

    text = asyncio.run(_with_app(engine, fn))
    lines = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
    assert lines['dspark:spec_decode_scheduled_made_tokens_total{model_name="fake"}'] == 4
    assert lines['dspark:spec_decode_scheduled_kept_tokens_total{model_name="fake"}'] == cs.stats["drafts_kept"] > 0
    assert lines['dspark:spec_decode_paused_steps_total{model_name="fake"}'] == 7


def test_no_spec_metrics_without_spec_stats():
    async def fn(h):
        await h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        return (await h.get("/metrics")).text

    text = asyncio.run(_with_app(FakeEngine(), fn))
    assert "dspark:spec_decode_mean_acceptance_length{" not in text
    assert "dspark:spec_decode_acceptance_rate_per_pos{" not in text


def test_engine_failure_gives_503_not_a_crash(caplog):
    caplog.set_level(logging.CRITICAL, logger="dspark.server")

    async def fn(h):
        r1 = await h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 10})
        r2 = await h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 10, "stream": True})
        health = await h.get("/health")
        metrics = await h.get("/metrics")
        return r1, r2, health, metrics

    r1, r2, health, metrics = asyncio.run(_with_app(FakeEngine(fail_on_step=3), fn))
    assert r1.status_code == 503 and "simulated engine bug" in r1.json()["error"]["message"]
    assert r2.status_code == 503
    assert health.status_code == 503 and set(health.json()["error"]) == {"message", "type", "param", "code"}
    assert 'dspark:engine_alive{model_name="fake"} 0.0' in metrics.text
    assert 'dspark:triton_compiles_while_serving_total{model_name="fake"} 0.0' in metrics.text  # no CUDA engine


def test_serve_parser_flags():
    from dspark.server.cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["serve"])
    assert (a.host, a.port, a.enable_prefix_caching, a.speculative_config, a.api_key) == ("127.0.0.1", 8000, True,
                                                                                           None, None)
    a = parser.parse_args([
        "serve", "some/model", "--host", "127.0.0.1", "--port", "9000", "--served-model-name", "a", "b",
        "--max-model-len", "4096", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--gpu-memory-utilization", "0.8", "--no-enable-prefix-caching", "--speculative-config", '{"k": 4}',
        "--enforce-eager", "--seed", "3", "--dtype", "bfloat16", "--api-key", "k",
    ])
    assert a.model_tag == "some/model" and a.served_model_name == ["a", "b"] and a.max_model_len == 4096
    assert a.enable_prefix_caching is False and a.gpu_memory_utilization == 0.8 and a.enforce_eager
    assert a.func.__name__ == "run_serve"


def test_gpu_memory_utilization_ignored_on_cpu(caplog):
    from dspark.server.cli import kv_cache_gb

    log = logging.getLogger("dspark.server.test")
    ns = argparse.Namespace(gpu_memory_utilization=0.5, kv_cache_memory_gb=None, model=None, model_tag=None)
    with caplog.at_level(logging.INFO, logger="dspark.server.test"):
        assert kv_cache_gb(ns, "cpu", 4, log) is None
    assert "ignored" in caplog.text
    ns.kv_cache_memory_gb = 2.0
    assert kv_cache_gb(ns, "cpu", 4, log) == 2.0
    ns.gpu_memory_utilization = 1.5
    with pytest.raises(ValueError):
        kv_cache_gb(ns, "cpu", 4, log)


def _out(rid: str, delta: list[int], text: str, finished: bool = False, lps: list | None = None) -> RequestOutput:
    return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[], text=text, token_ids=list(delta),
                         delta_text=text[-len(delta):], delta_token_ids=list(delta), finished=finished,
                         finish_reason="length" if finished else None, logprobs=lps)


def test_coalesce_merges_each_requests_queued_outputs_in_order():
    from dspark.server.engine_client import coalesce

    boom = RuntimeError("engine gone")
    items = [_out("a", [1], "x", lps=[{"t": 1}]), _out("b", [5], "p"), _out("a", [2], "xy", lps=[{"t": 2}]),
             _out("a", [3], "xyz", finished=True, lps=[{"t": 3}]), _out("b", [6], "pq"), boom, _out("b", [7], "pqr")]
    merged = coalesce(items)
    assert [type(m).__name__ if isinstance(m, BaseException) else m.request_id for m in merged] == ["a", "b", "RuntimeError"]
    a, b = merged[0], merged[1]
    assert (a.delta_token_ids, a.delta_text, a.text, a.finished, a.logprobs) == ([1, 2, 3], "xyz", "xyz", True,
                                                                                 [{"t": 1}, {"t": 2}, {"t": 3}])
    assert (b.delta_token_ids, b.delta_text, b.logprobs) == ([5, 6], "pq", None)
    assert merged[2] is boom  # what came after the exception is dropped: the exception ends the group
    assert coalesce([_out("a", [1], "x")])[0].delta_token_ids == [1]


def test_group_outputs_merge_when_the_consumer_is_behind():
    from dspark.server.engine_client import RequestGroup

    async def run():
        group = RequestGroup(SimpleNamespace(), [SimpleNamespace(request_id="r")])
        for i in range(5):  # five steps' outputs arrived before the handler looked
            group.queue.put_nowait(_out("r", [i], "abcde"[: i + 1], finished=i == 4))
        return [o async for o in group.outputs()]

    outs = asyncio.run(run())
    assert len(outs) == 1 and outs[0].delta_token_ids == [0, 1, 2, 3, 4] and outs[0].finished
