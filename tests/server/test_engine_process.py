"""`dspark serve` runs the engine in its own process (dspark/server/engine_process.py): the engine is
really elsewhere, requests go through it, a dead engine process gives 503s (the server stays up), and
an engine that cannot be built stops the server with the engine's own error."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.server.conftest import ServerProcess, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_smollm_dir):
    srv = start_server(tmp_path_factory, "engine_process", ["--model", str(tiny_smollm_dir), "--device", "cpu",
                                                            "--max-model-len", "256", "--kv-cache-memory-gb", "0.05"])
    yield srv
    srv.stop()


def test_engine_runs_in_its_own_process_and_its_death_gives_503(tiny_server):
    state = tiny_server.debug_kv()
    engine_pid = state["engine_pid"]
    assert engine_pid != tiny_server.proc.pid and state["engine_alive"]
    with tiny_server.http() as h:
        r = h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        with h.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 4, "stream": True}) as s:
            lines = [x for x in s.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 3

        os.kill(engine_pid, signal.SIGKILL)  # not a client mistake: the engine is gone
        deadline = time.monotonic() + 30
        while h.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert h.get("/health").status_code == 503
        r = h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        assert tiny_server.proc.poll() is None  # the server itself is still up and answering
        assert h.get("/v1/models").status_code == 200


def test_engine_build_error_stops_the_server_with_its_message(tmp_path):
    srv = ServerProcess(["--model", str(tmp_path / "no-such-model"), "--device", "cpu"], tmp_path / "server.log")
    try:
        assert srv.proc.wait(timeout=120) == 2
        log = srv.log_tail()
        assert "dspark: error:" in log and "no-such-model" in log, log
    finally:
        srv.stop()
