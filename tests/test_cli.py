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
    # the default model speculates with the drafter dspark ships (dspark/drafters) unless --no-spec; on the CPU its
    # steps are confidence-scheduled (whether any draft is worth verifying in 12 tokens follows measured times)
    assert "confidence scheduling:" in r.stderr and ("DSpark: tau" in r.stderr or "no verification steps" in r.stderr)


@pytest.mark.slow
def test_generate_no_spec_turns_the_shipped_drafter_off():
    r = dspark("generate", "--device", "cpu", "--chat", "What is the capital of France?", "--max-tokens", "12",
               "--no-spec")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "DSpark" not in r.stderr


def test_no_spec_with_speculative_config_is_a_clear_error():
    r = dspark("generate", "--device", "cpu", "--no-spec", "--speculative-config", '{"method": "dspark"}')
    assert r.returncode != 0 and "--no-spec and --speculative-config" in r.stderr and "Traceback" not in r.stderr


def test_generate_unknown_model_is_a_clear_error():
    r = dspark("generate", "--model", "no-such-model", "--device", "cpu")
    assert r.returncode == 2 and "unknown model 'no-such-model'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_generate_with_random_drafter_prints_acceptance(tmp_path):
    r = dspark("init-drafter", "--out", str(tmp_path / "d"), "--num-layers", "1")
    assert r.returncode == 0, r.stderr
    r = dspark("generate", "--device", "cpu", "--chat", "Say hi.", "--max-tokens", "8",
               "--speculative-config", f'{{"model": "{tmp_path / "d"}", "num_speculative_tokens": 3, "confidence_scheduling": false}}')
    assert r.returncode == 0, r.stderr
    assert "DSpark: tau" in r.stderr and "conditional acceptance by position" in r.stderr


def test_bad_speculative_config_is_a_clear_error():
    r = dspark("generate", "--device", "cpu", "--speculative-config", '{"method": "eagle"}')
    assert r.returncode == 2 and "unknown speculative method 'eagle'" in r.stderr
