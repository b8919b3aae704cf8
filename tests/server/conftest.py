"""Live `dspark serve` processes on 127.0.0.1 for the server tests.

Each server is a real subprocess (``python -m dspark.server.cli``, the code behind ``dspark serve``) on
a free port, shared per session (SmolLM2) or per module (small or special configurations), and
stopped at the end. Its log goes to a file whose tail is shown when it fails to start.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        cmd = [sys.executable, "-m", "dspark.server.cli", *args, "--host", "127.0.0.1", "--port", str(self.port),
               "--disable-uvicorn-access-log"]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("DSPARK_API_KEY", None)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 300.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready after {timeout:.0f}s:\n{self.log_tail()}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout, headers=self.headers)

    def openai(self, **kw):
        import openai

        kw.setdefault("api_key", self.api_key or "unused")
        kw.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.base_url + "/v1", **kw)

    def async_openai(self, **kw):
        import openai

        kw.setdefault("api_key", self.api_key or "unused")
        kw.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", **kw)

    def debug_kv(self) -> dict:
        r = httpx.get(self.base_url + "/debug/kv", headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Poll /debug/kv until nothing is running or waiting and the engine holds no request."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.debug_kv()
            if (s["running"] == 0 and s["waiting"] == 0 and s["engine_requests"] == 0 and s["kv_requests"] == 0
                    and s["streams"] == 0 and s["http_generations_in_flight"] == 0):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout}s: {s}")
            time.sleep(0.05)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def start_server(tmp_path_factory, name: str, args: list[str], api_key: str | None = None) -> ServerProcess:
    log = tmp_path_factory.mktemp(name) / "server.log"
    return ServerProcess(args, log, api_key=api_key).wait_ready()


# The default model, the same engine settings the offline reference (tests/conftest.py) uses where
# they matter; greedy text does not depend on the KV size or batch limits.
SMOLLM_ARGS = ["--max-model-len", "2048", "--kv-cache-memory-gb", "0.75", "--max-num-seqs", "64",
               "--dtype", "float32", "--device", "cpu", "--seed", "0"]


@pytest.fixture(scope="session")
def smollm_server(tmp_path_factory):
    srv = start_server(tmp_path_factory, "smollm_server", SMOLLM_ARGS)
    yield srv
    srv.stop()


def write_tiny_smollm(path: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template: a real server in ~1 s, for tests
    of the HTTP layer (fuzzing, auth) that need a tokenizer but not a good model."""
    import torch
    import transformers

    from dspark.models.gguf_loader import default_gguf_path, load_gguf_tokenizer

    tok = load_gguf_tokenizer(default_gguf_path())
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-6,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, initializer_range=0.2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_smollm_dir(tmp_path_factory) -> Path:
    return write_tiny_smollm(tmp_path_factory.mktemp("tiny_smollm"))
