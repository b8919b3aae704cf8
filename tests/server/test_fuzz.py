"""Bad input against a live server: schemathesis over the server's own OpenAPI schema (schema-valid and
schema-violating requests) and hypothesis over raw bodies. No response may be a 5xx, every error is
OpenAI-shaped, and afterwards the server is alive, idle, and its KV cache consistent.

The server runs a tiny random model with SmolLM2's tokenizer and chat template and a short context, so
that each of the few hundred generated requests finishes in well under a second: what is tested here
is the HTTP layer, validation and the engine's handling of odd-but-valid sampling values.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from tests.server.conftest import start_server

EXAMPLES = int(os.environ.get("DSPARK_FUZZ_EXAMPLES", "25"))  # per operation and mode
BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_smollm_dir):
    srv = start_server(tmp_path_factory, "tiny_fuzz", [
        str(tiny_smollm_dir), "--served-model-name", "tiny", "--max-model-len", "96", "--max-num-seqs", "64",
        "--kv-cache-memory-gb", "0.05", "--max-request-body-bytes", str(BODY_LIMIT), "--device", "cpu",
    ])
    yield srv
    srv.stop()


FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(HealthCheck), print_blob=True)


def check_response(r, what) -> None:
    assert r.status_code < 500, f"{what} -> {r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        body = r.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}, body


def test_schemathesis_fuzz(tiny_server):
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(tiny_server.base_url + "/openapi.json")
    ops = [res.ok() for res in schema.get_all_operations()]
    labels = sorted(op.label for op in ops)
    assert "POST /v1/completions" in labels and "POST /v1/chat/completions" in labels, labels
    counts: dict[str, int] = {}
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @FUZZ_SETTINGS
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                r = case.call(base_url=tiny_server.base_url, timeout=60)
                counts[f"{op.label} {r.status_code}"] = counts.get(f"{op.label} {r.status_code}", 0) + 1
                assert r.status_code < 500, f"{case.method} {case.formatted_path} {case.body!r} -> {r.status_code}: {r.text[:500]}"
                if r.status_code >= 400:
                    assert set(json.loads(r.text)["error"]) == {"message", "type", "param", "code"}, r.text

            try:
                run()
            except Unsatisfiable:  # nothing to negate (an operation without parameters or body)
                assert mode == GenerationMode.NEGATIVE, op.label
    print("\nschemathesis outcomes:", json.dumps(dict(sorted(counts.items())), indent=1))
    # Positive cases must mostly be accepted (the schema describes what the server takes).
    ok = sum(v for k, v in counts.items() if k.startswith("POST /v1/completions 200"))
    assert ok > 0
    with tiny_server.http() as h:
        assert h.get("/health").status_code == 200
    state = tiny_server.wait_idle(timeout=60)
    assert state["integrity_ok"], state


FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "echo",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids", "ignore_eos",
          "logit_bias", "best_of", "suffix", "tools", "response_format", "user"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                 "content": st.text(max_size=30) | json_values})
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).flatmap(
    lambda d: st.fixed_dictionaries({
        **{k: st.just(v) for k, v in d.items()},
        "messages": st.lists(message, max_size=3) | json_values,
        "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 60000), max_size=5) | json_values,
        "max_tokens": st.integers(-2, 80) | json_values,
    })
)


def test_hypothesis_raw_bodies(tiny_server):
    with tiny_server.http(timeout=60) as h:
        @FUZZ_SETTINGS
        @given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
        def run(body, path):
            check_response(h.post(path, json=body), (path, body))

        @settings(max_examples=EXAMPLES * 2, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode),
               path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/health"]),
               ctype=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]))
        def run_raw(raw, path, ctype):
            headers = {"content-type": ctype} if ctype else {}
            check_response(h.post(path, content=raw, headers=headers), (path, raw))

        run()
        run_raw()
        # Odd but schema-valid sampling values reach the engine and must not break it.
        for extra in ({"temperature": 1e30}, {"temperature": 1e-30}, {"repetition_penalty": 100.0},
                      {"repetition_penalty": 1e-300}, {"top_k": 10**9}, {"seed": -(2**63)}, {"seed": 2**64 - 1},
                      {"min_p": 1.0}, {"top_p": 1e-300}, {"presence_penalty": -2, "frequency_penalty": 2},
                      {"stop": ["\u00e9", "\n"]}, {"logprobs": 20}, {"stop_token_ids": [0, 1, 2, 10**6]},
                      {"n": 64, "seed": 5}):
            r = h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, **extra})
            assert r.status_code == 200, (extra, r.text)
        assert h.get("/health").status_code == 200
    state = tiny_server.wait_idle(timeout=60)
    assert state["integrity_ok"] and state["integrity"]["in_use"] == 0, state


def test_oversized_bodies_get_413(tiny_server):
    big = {"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 1}
    with tiny_server.http() as h:
        r = h.post("/v1/completions", json=big)
        assert r.status_code == 413 and "too large" in r.json()["error"]["message"], r.text

        def chunks():  # no Content-Length: chunked transfer encoding
            data = json.dumps(big).encode()
            for i in range(0, len(data), 8192):
                yield data[i:i + 8192]

        r = h.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        r = h.post("/v1/completions", json={"prompt": "x" * (BODY_LIMIT // 2), "max_tokens": 1})
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"]  # under the limit
        assert h.get("/health").status_code == 200


def test_client_mistakes_never_5xx(tiny_server):
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "n": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "json_object"}}),
        ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}),
        ("/v1/completions", {"prompt": "hi", "best_of": 3}),
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"prompt": ["a"] * 10, "n": 30}),
        ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 17}),
        ("/v1/completions", {"prompt": "hi", "temperature": float("nan")}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**30}),
        ("/v1/completions", {"prompt": "hi", "seed": 2**64}),
    ]
    with tiny_server.http() as h:
        for path, body in cases:
            r = h.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            check_response(r, body)
