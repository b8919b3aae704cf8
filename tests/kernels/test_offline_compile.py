"""benchmarks/offline_compile.py: a kernel compiled for sm_90 on this CPU machine (Triton's PTX, then the ptxas its
wheel bundles), with registers / spills / shared memory read back; a launch that cannot compile reports the error.
Run in a subprocess: the tool needs Triton compiled, not in the interpreter these tests import it in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
KERNEL = "dspark.kernels.drafter_attention:_drafter_attention_kernel"
# SmolLM2's drafter at its default launch (drafter_launch(7, 3, 64): one 32-row tile, 64 keys, 2 warps, 2 stages)
SMOL = dict(GAMMA=7, G=3, PAGE=16, HEAD_DIM=64, BLOCK_M=32, BLOCK_G=16, BLOCK_N=64, BLOCK_D=64, NUM_SPLITS=1,
            HAS_SINK=False, DOT_PRECISION="tf32", KV_SHARED=False)
TYPES = {"lse_ptr": "*fp32", "sink_ptr": "*fp32", "block_tables_ptr": "*i64", "ctx_lens_ptr": "*i64"}


def offline(constexprs: dict) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offline_compile.py"), "--kernel", KERNEL,
                        "--constexprs", json.dumps(constexprs), "--types", json.dumps(TYPES), "--warps", "2"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines, r.stderr[-2000:]
    return r.returncode, json.loads(lines[-1])


def test_compiles_for_sm90_without_a_gpu():
    rc, rep = offline(SMOL)
    assert rc == 0 and "error" not in rep, rep
    assert 0 < rep["registers"] <= 255
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0  # SmolLM2's 32 x 64 tile fits in registers
    assert rep["shared_bytes"] > 0 and rep["arch"] == 90


def test_a_launch_that_cannot_compile_reports_why():
    """BLOCK_G = 12 is not a power of two: tl.arange refuses it, as the GPU would, where the call would fail."""
    rc, rep = offline(dict(SMOL, BLOCK_G=12))
    assert rc == 1 and "arange" in rep["error"], rep


def test_fewrow_row_tiles_compile_and_128_rows_do_not_spill():
    """--fewrow: the four SmolLM2 products at every row tile compile for sm_90; 64- and 128-row tiles reach the
    wgmma tensor cores; the 128-row tiles' launch (8 warps, fewrow_config(rows=)) does not spill, as 4 warps did.
    With DSPARK_PDL=1: the launches with programmatic dependent launch and the weight slice's L2 prefetch."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offline_compile.py"), "--fewrow"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "DSPARK_PDL": "1"})
    reps = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0 and len(reps) == 16, r.stderr[-2000:]
    assert all("error" not in rep for rep in reps)
    assert {rep["row_tile"] for rep in reps} == {16, 32, 64, 128}
    assert all(rep["wgmma"] for rep in reps if rep["row_tile"] >= 64)
    big = [rep for rep in reps if rep["row_tile"] == 128]
    assert all(rep["num_warps"] == 8 and rep["spill_stores"] == 0 for rep in big), big
    assert all(rep["constexprs"]["PDL"] and rep["constexprs"]["PF_K"] > 0 for rep in reps)


def test_every_engine_launch_compiles_for_sm90():
    """--engine: every distinct launch of the tiny engines' one-sync DSpark steps (probabilistic and greedy drafts,
    block and standard verification, from logits) and plain steps, recorded under the interpreter, compiles for
    sm_90. Session 57's ``_verify_greedy_kernel`` with sampled rows did not (a value int32 before an ``if`` and
    int64 in it: the interpreter accepts that, Triton's compiler does not); this test fails on that code. With
    DSPARK_PDL=1, so every kernel's programmatic-dependent-launch variant (pdl_wait) is the one compiled."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offline_compile.py"), "--engine"],
                       capture_output=True, text=True, timeout=1200, cwd=ROOT, env={**os.environ, "DSPARK_PDL": "1"})
    reps = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert reps, r.stderr[-3000:]
    assert r.returncode == 0 and not [rep for rep in reps if "error" in rep], [rep for rep in reps if "error" in rep]
    launched = {(rep["kernel"], key, rep["constexprs"].get(key)) for rep in reps for key in rep["constexprs"]}
    for want in [("_verify_greedy_kernel", "SAMPLED", True), ("_markov_temp_kernel", "W1_ROWS", True),
                 ("_rms_norm_kernel", "SELECT", True), ("_verify_block_kernel", "FROM_LOGITS", True),
                 ("_verify_standard_kernel", "Q_ROWS", True), ("_shift_rows_kernel", "HAS_IDX", True)]:
        assert want in launched, want
    assert all(rep["constexprs"].get("PDL", True) for rep in reps)  # every kernel with the parameter: on
    # fused_ops' row-wise kernels as the GPU launches them (recorded at the interpreter's width)
    rows = [rep for rep in reps if "ROWS" in rep["constexprs"]]
    assert {rep["kernel"] for rep in rows} == {"_rms_norm_kernel", "_rope_cache_kernel", "_silu_mul_kernel"}
    assert {rep["constexprs"]["ROWS"] for rep in rows} == {1}
    assert {"_block_inputs_kernel", "_row_flags_kernel", "_drafter_attention_kernel", "_paged_attention_kernel",
            "_stats_kernel", "_drafter_inputs_kernel"} <= {rep["kernel"] for rep in reps}
