"""`--api-key`: every /v1 (and /debug) route needs `Authorization: Bearer <key>`; /health and /metrics
stay open. Missing or wrong keys get an OpenAI-shaped 401."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import start_server

KEY = "sk-dspark-test-0123456789"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory, tiny_smollm_dir):
    srv = start_server(tmp_path_factory, "tiny_auth", [
        str(tiny_smollm_dir), "--served-model-name", "tiny", "--max-model-len", "128", "--kv-cache-memory-gb", "0.05",
        "--device", "cpu",
    ], api_key=KEY)
    yield srv
    srv.stop()


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": KEY},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": "Bearer"},
])
def test_missing_or_wrong_key_is_401(auth_server, headers):
    with httpx.Client(base_url=auth_server.base_url, headers=headers, timeout=30) as h:
        assert_401(h.get("/v1/models"))
        assert_401(h.get("/v1/models/tiny"))
        assert_401(h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
        assert_401(h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}))
        assert_401(h.post("/v1/completions", content=b"{not json"))  # auth comes before parsing
        assert_401(h.get("/v1/anything"))
        assert_401(h.get("/debug/kv"))
        assert h.get("/health").status_code == 200
        assert h.get("/metrics").status_code == 200


def test_openai_client_with_and_without_key(auth_server):
    with auth_server.openai(api_key="wrong") as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with auth_server.openai(api_key=KEY) as good:
        assert [m.id for m in good.models.list().data] == ["tiny"]
        r = good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                         temperature=0)
        assert r.usage.completion_tokens == 3
        chunks = list(good.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0, stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason == "length"
    with httpx.Client(base_url=auth_server.base_url, headers={"Authorization": f"bearer {KEY}"}) as h:
        assert h.get("/debug/kv").json()["integrity_ok"]  # the scheme is case-insensitive
