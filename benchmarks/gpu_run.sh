#!/usr/bin/env bash
# Second half of a two-call GPU run (see docs/benchmarks.md): joins the GGUF halves carried in .model/,
# installs carried wheels, runs the GPU smoke checks and the decode benchmark. Results go to $OUT.
set -euo pipefail
cp .model/smollm.gguf.part_ab /tmp/ && cat /tmp/smollm.gguf.part_aa /tmp/smollm.gguf.part_ab > /tmp/smollm.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smollm.gguf" | sha256sum -c
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 benchmarks/gpu_smoke.py /tmp/smollm.gguf "$OUT" 2>&1 | tee "$OUT/gpu_smoke.log"
python3 -m dspark.cli bench --model /tmp/smollm.gguf --device cuda --max-tokens 128 --runs 3 --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log"
