"""benchmarks/invariance_check.py runs (``--smoke``: small shapes, the bitwise part, Triton's CPU interpreter) and
writes its JSON: every launch variant compiles and runs, the segmented sums included. Which variants give the same
bits is a GPU property (docs/benchmarks.md, session 46); the interpreter's numpy products round otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_every_variant(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "invariance_check.py"), str(tmp_path), "--smoke",
                        "--quick"], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "invariance.json").read_text())
    rows = res["bitwise"]
    assert {row["shape"] for row in rows} == {"o", "lm_head"}
    launched = [row for row in rows if row["family"] in ("plain", "seg")]
    assert len(launched) == 2 * (16 + 8)  # per shape: the reference, 12 one-change variants, 3 combos; 8 segmented
    assert all(row["error"] is None and set(row["rows_differing"]) == {"1", "7", "64", "333", "shuffled"}
               for row in launched), [row for row in launched if row["error"]]
    assert sum(row["family"] == "cublas" for row in rows) == 2
