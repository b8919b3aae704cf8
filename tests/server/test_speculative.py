"""The server with speculative decoding on.

* A live `dspark serve --speculative-config` on SmolLM2 with a DSpark drafter (a random-weight one
  unless ``DSPARK_TEST_SPEC_CONFIG`` names a trained one): concurrent streams, some cancelled, give the
  offline non-speculative greedy text; KV integrity holds; /metrics exports τ and per-position
  acceptance; `dspark bench serve` reports τ.
* In process, an oracle drafter that proposes the target's own continuation (every draft accepted,
  τ = N + 1): several tokens arrive per step, and the stream (stop strings included) still equals
  the offline text.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time

import httpx
import pytest

from dspark import SamplingParams
from tests.server.conftest import SMOLLM_ARGS, start_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TOPICS = ["the moon", "coffee", "rivers", "volcanoes", "chess", "bees"]


def conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me one fact about {TOPICS[i % len(TOPICS)]}."}]


def metric_lines(text: str, prefix: str) -> dict[str, float]:
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith(prefix)}


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    spec = os.environ.get("DSPARK_TEST_SPEC_CONFIG")
    if not spec:
        from dspark.config import ModelConfig
        from dspark.models.dspark_drafter import (DrafterConfig, drafter_config_dict, random_drafter_state_dict,
                                                  write_drafter)
        from dspark.models.loader import load_model_config

        out = tmp_path_factory.mktemp("random_drafter")
        cfg = drafter_config_dict(ModelConfig.from_hf(load_model_config(None)), num_hidden_layers=1, block_size=4,
                                  mask_token_id=16)
        write_drafter(out, cfg, random_drafter_state_dict(DrafterConfig.from_dict(cfg), 0))
        spec = json.dumps({"model": str(out), "num_speculative_tokens": 3, "confidence_scheduling": False})
    srv = start_server(tmp_path_factory, "spec_server", SMOLLM_ARGS + ["--speculative-config", spec])
    yield srv
    srv.stop()


def test_spec_server_streams_equal_offline_greedy_with_cancellations(spec_server, smollm_llm):
    max_tokens = 16
    refs = [o.text for o in smollm_llm.chat([conversation(i) for i in range(len(TOPICS))],
                                             SamplingParams(temperature=0, max_tokens=max_tokens))]
    n = 12
    cancel = set(random.Random(3).sample(range(n), 4))

    async def one(client, i):
        stream = await client.chat.completions.create(model=MODEL, messages=conversation(i), max_tokens=max_tokens,
                                                      temperature=0, stream=True)
        text = ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                if i in cancel and len(text) > 8:
                    await stream.close()
                    return text
        return text

    async def run():
        async with spec_server.async_openai(timeout=600) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    texts = asyncio.run(run())
    for i, text in enumerate(texts):
        ref = refs[i % len(TOPICS)]
        assert ref.startswith(text) if i in cancel else text == ref, (i, text, ref)
    state = spec_server.wait_idle(timeout=30)
    assert state["integrity_ok"] and state["integrity"]["in_use"] == 0, state
    with httpx.Client(base_url=spec_server.base_url) as h:
        m = metric_lines(h.get("/metrics").text, "dspark:spec_decode")
    assert m[f'dspark:spec_decode_num_drafts_total{{model_name="{MODEL}"}}'] > 0
    assert m[f'dspark:spec_decode_num_draft_tokens_total{{model_name="{MODEL}"}}'] > 0
    assert m[f'dspark:spec_decode_mean_acceptance_length{{model_name="{MODEL}"}}'] >= 1.0
    assert f'dspark:spec_decode_acceptance_rate_per_pos{{model_name="{MODEL}",position="0"}}' in m
    assert f'dspark:spec_decode_conditional_acceptance_per_pos{{model_name="{MODEL}",position="0"}}' in m


def test_bench_serve_reports_tau(spec_server, tmp_path):
    from dspark.bench.serve import main

    out = tmp_path / "bench.json"
    assert main(["--base-url", spec_server.base_url, "--num-prompts", "4", "--max-tokens", "8", "--dataset-name",
                 "builtin", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["completed"] == 4
    assert rep["speculative"] is not None and rep["speculative"]["tau"] >= 1.0
    assert rep["speculative"]["num_steps"] > 0


# ---------------------------------------------------------------------- oracle drafter, in process
class _ThreadedServer:
    def __init__(self, app) -> None:
        import uvicorn

        from tests.server.conftest import free_port

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "in-process server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def test_oracle_drafter_multi_token_steps_stream_exactly(tiny_smollm_dir):
    from dspark import LLM, LLMEngine
    from dspark.server.app import build_app
    from dspark.server.engine_client import EngineClient
    from tests.spec.drafters import OracleProposer

    n_spec, max_tokens = 3, 25  # 1 token from the prefill, then 6 steps of 4 tokens
    kw = dict(device="cpu", max_model_len=256, kv_cache_memory_gb=0.05)
    ref_llm = LLM(str(tiny_smollm_dir), **kw)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompt_ids = [ref_llm.engine.tokenize_chat(conversation(i)) for i in range(3)]
    refs = ref_llm.generate(prompt_ids, greedy)
    conts = {tuple(p): r.token_ids for p, r in zip(prompt_ids, refs)}
    engine = LLMEngine(str(tiny_smollm_dir), speculative_config={"num_speculative_tokens": n_spec},
                       proposer_factory=OracleProposer(conts, 5), **kw)
    srv = _ThreadedServer(build_app(EngineClient(engine), "tiny"))
    try:
        body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=srv.base_url, timeout=120) as h:
            for i, ref in enumerate(refs):
                r = h.post("/v1/chat/completions", json={**body, "messages": conversation(i)})
                assert r.json()["choices"][0]["message"]["content"] == ref.text
                deltas = []
                with h.stream("POST", "/v1/chat/completions",
                              json={**body, "messages": conversation(i), "stream": True}) as s:
                    for line in s.iter_lines():
                        if line.startswith("data: {"):
                            c = json.loads(line[6:])["choices"]
                            if c and c[0]["delta"].get("content"):
                                deltas.append(c[0]["delta"]["content"])
                assert "".join(deltas) == ref.text
                assert len(deltas) < max_tokens  # several tokens per step
                # A stop string that ends inside an accepted run is cut there and never streamed.
                stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 3]
                if stop.strip():
                    want = ref.text[:ref.text.index(stop)]
                    with h.stream("POST", "/v1/chat/completions", json={**body, "messages": conversation(i),
                                                                       "stream": True, "stop": [stop]}) as s:
                        got = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content", "")
                                      for ln in s.iter_lines() if ln.startswith("data: {")
                                      and json.loads(ln[6:])["choices"])
                    assert got == want
            m = metric_lines(h.get("/metrics").text, "dspark:spec_decode_mean_acceptance_length")
            assert list(m.values()) == [pytest.approx(n_spec + 1, rel=0.05)]
    finally:
        srv.stop()
