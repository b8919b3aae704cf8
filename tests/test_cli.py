"""The command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def dspark(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_help():
    r = dspark("--help")
    assert r.returncode == 0 and "generate" in r.stdout and "bench" in r.stdout


@pytest.mark.slow
def test_generate_streams_and_reports_speed():
    r = dspark("generate", "--device", "cpu", "--chat", "What is the capital of France?", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr


def test_generate_unknown_model_is_a_clear_error():
    r = dspark("generate", "--model", "no-such-model", "--device", "cpu")
    assert r.returncode == 2 and "unknown model 'no-such-model'" in r.stderr and "Traceback" not in r.stderr
