"""The official `openai` client against a live `dspark serve` on SmolLM2: completions and chat,
streaming and not; greedy text equals the offline `LLM`; errors are OpenAI-shaped 4xx."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from dspark import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 24
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def client(smollm_server):
    with smollm_server.openai() as c:
        yield c


@pytest.fixture(scope="module")
def http(smollm_server):
    with smollm_server.http() as c:
        yield c


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw)


def assert_openai_error(r: httpx.Response, status: int, *, param: str | None = "", words: tuple[str, ...] = ()):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param != "":
        assert err["param"] == param, err
    for w in words:
        assert w.lower() in err["message"].lower(), err


# ---------------------------------------------------------------------- basics
def test_health_models_version(client, http):
    assert http.get("/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert http.get("/version").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


# ---------------------------------------------------------------------- parity with the offline LLM
def test_chat_equals_offline_greedy(client, smollm_llm):
    ref = smollm_llm.chat(QUESTION, greedy())[0]
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_equals_offline_greedy_with_usage(client, smollm_llm):
    ref = smollm_llm.chat(QUESTION, greedy())[0]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
    assert last.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_completion_equals_offline_greedy(client, smollm_llm):
    ref = smollm_llm.generate(PROMPT, greedy())[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids) and r.usage.prompt_tokens == len(ref.prompt_token_ids)
    # Token-id prompts and echo.
    r2 = client.completions.create(model=MODEL, prompt=ref.prompt_token_ids, max_tokens=MAX_TOKENS, temperature=0,
                                   echo=True)
    assert r2.choices[0].text.endswith(ref.text) and r2.choices[0].text.startswith(PROMPT)


def test_completion_stream_equals_offline_greedy(client, smollm_llm):
    ref = smollm_llm.generate(PROMPT, greedy())[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_raw_sse_ends_with_done(http):
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                      "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        json.loads(ln[len("data: "):])


def test_batch_prompts_and_seeded_n(client, smollm_llm):
    """Several prompts, n choices each; seeded choices i use seed + i and match the offline engine."""
    prompts = [PROMPT, "Once upon a time"]
    kw = dict(temperature=0.9, top_p=0.95, top_k=50, max_tokens=12)
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, seed=7, max_tokens=12, temperature=0.9,
                                  top_p=0.95, extra_body={"top_k": 50})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    ref = smollm_llm.generate([prompts[0], prompts[0], prompts[1], prompts[1]],
                              [SamplingParams(seed=s, **kw) for s in (7, 8, 7, 8)])
    assert [by_index[i] for i in range(4)] == [o.text for o in ref]


def test_sampling_knobs_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0.7, top_p=0.9, seed=3, presence_penalty=0.5,
        frequency_penalty=0.5, stop=["\n\n"], extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    assert r.choices[0].finish_reason in ("stop", "length")


def test_stop_string_stream_never_leaks(client, smollm_llm):
    """A stop string split across tokens is never streamed, and streaming == non-streaming text."""
    full = smollm_llm.generate(PROMPT, greedy(ignore_eos=True, max_tokens=40))[0].text
    k = full.index(" ", len(full) // 3)
    stop = full[k - 2:k + 4]  # spans a word boundary, hence tokens
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                            stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_completion_logprobs(client, smollm_llm):
    ref = smollm_llm.generate(PROMPT, greedy(max_tokens=8, logprobs=3))[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    for got, want in zip(lp.token_logprobs, ref.logprobs):
        assert got == pytest.approx(want["logprob"], abs=1e-4)
    for top, tok, l in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs):
        assert 3 <= len(top) <= 4 and tok in top and l <= 0
        assert max(top.values()) == pytest.approx(l, abs=1e-5)  # greedy: the sampled token is the top one
    # Streaming carries the same logprobs.
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                            stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


# ---------------------------------------------------------------------- bad input
def test_error_shapes(http, client):
    post = lambda path, content: http.post(path, content=content, headers={"content-type": "application/json"})
    assert_openai_error(post("/v1/chat/completions", b'{"messages": [ {"role": "user", '), 400, words=("JSON",))
    assert_openai_error(post("/v1/completions", b""), 400)
    assert_openai_error(post("/v1/completions", b"[1, 2]"), 422)
    assert_openai_error(http.post("/v1/chat/completions", json={"messages": []}), 422, param="messages",
                        words=("messages", "at least 1"))
    assert_openai_error(http.post("/v1/chat/completions", json={"messages": "hi"}), 422, param="messages")
    assert_openai_error(http.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}),
                        422, words=("role",))
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "temperature": "hot"}), 422,
                        param="temperature", words=("temperature",))
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "temperature": -1}), 422,
                        param="temperature", words=("temperature",))
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "top_p": 0}), 422, param="top_p")
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 422, param="max_tokens")
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "n": 0}), 422, param="n")
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "logprobs": 99}), 422, param="logprobs")
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "stop": ""}), 422, param="stop")
    assert_openai_error(http.post("/v1/completions", json={"prompt": [10**9]}), 400, words=("out of range",))
    assert_openai_error(http.post("/v1/completions", json={"prompt": []}), 422, param="prompt")
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "model": "gpt-17"}), 404, param="model",
                        words=("gpt-17",))
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "logit_bias": {"1": 5}}), 422,
                        param="logit_bias", words=("not supported",))
    assert_openai_error(http.get("/v1/nope"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)
    # A prompt longer than the context (2048), and one whose completion does not fit.
    long = "hello " * 2100
    assert_openai_error(http.post("/v1/completions", json={"prompt": long}), 400, words=("context length",))
    assert_openai_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]}),
                        400, words=("context length",))
    assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5000}), 400,
                        words=("context length", "5000"))
    # The official client maps them to its exceptions.
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=QUESTION)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hello " * 3000)
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=MODEL, prompt="x", temperature=-3)
    # Still serving.
    assert http.get("/health").status_code == 200


def test_metrics_exposed(http, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    text = http.get("/metrics").text
    for name in ("dspark:request_success_total", "dspark:time_to_first_token_seconds_bucket",
                 "dspark:time_per_output_token_seconds_bucket", "dspark:e2e_request_latency_seconds_bucket",
                 "dspark:generation_tokens_total", "dspark:prompt_tokens_total", "dspark:num_requests_running",
                 "dspark:num_requests_waiting", "dspark:kv_cache_usage_perc", "dspark:prefix_cache_hit_rate",
                 "dspark:http_requests_total", "dspark:inter_token_latency_seconds_bucket"):
        assert name in text, name
    gen = [ln for ln in text.splitlines() if ln.startswith("dspark:generation_tokens_total")]
    assert float(gen[0].split()[-1]) > 0
