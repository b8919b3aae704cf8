"""`dspark bench serve` against a live (tiny-model) server: it completes every request and reports
throughput and TTFT/TPOT/ITL percentiles as text and JSON."""

from __future__ import annotations

import json

import pytest

from dspark.bench.serve import main
from tests.server.conftest import start_server


@pytest.fixture(scope="module")
def bench_server(tmp_path_factory, tiny_smollm_dir):
    srv = start_server(tmp_path_factory, "tiny_bench", [
        str(tiny_smollm_dir), "--served-model-name", "tiny", "--max-model-len", "1024", "--kv-cache-memory-gb", "0.05",
        "--device", "cpu",
    ])
    yield srv
    srv.stop()


@pytest.mark.parametrize("extra", [
    ["--endpoint", "chat", "--request-rate", "50", "--dataset-name", "builtin"],
    ["--endpoint", "completions", "--max-concurrency", "3", "--ignore-eos"],
])
def test_bench_serve_reports(bench_server, tmp_path, capsys, extra):
    out = tmp_path / "bench.json"
    rc = main(["--base-url", bench_server.base_url, "--num-prompts", "12", "--max-tokens", "8", "--json", str(out),
               *extra])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["completed"] == 12 and rep["failed"] == 0
    assert rep["total_output_tokens"] > 0 and rep["output_throughput"] > 0 and rep["request_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(rep[key]) == {"mean", "median", "p90", "p99"}
    assert rep["ttft_ms"]["p99"] >= rep["ttft_ms"]["median"] > 0
    if "--ignore-eos" in extra:
        assert rep["total_output_tokens"] == 12 * 8
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "P99 ITL (ms)" in text


def test_dataset_path_jsonl(bench_server, tmp_path):
    ds = tmp_path / "prompts.jsonl"
    ds.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": f"Question number {i}?"},
                                                          {"from": "gpt", "value": "ok"}]}) for i in range(5)))
    out = tmp_path / "bench.json"
    assert main(["--base-url", bench_server.base_url, "--dataset-path", str(ds), "--num-prompts", "5",
                 "--max-tokens", "4", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["completed"] == 5
