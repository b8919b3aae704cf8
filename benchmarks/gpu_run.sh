#!/usr/bin/env bash
# Last call of a GPU run (see docs/benchmarks.md): joins the GGUF pieces carried by earlier calls,
# installs carried wheels, runs the GPU smoke checks and the decode benchmark. Results go to $OUT.
set -euo pipefail
bash benchmarks/gguf_pieces.sh && [ -f /tmp/smollm.gguf ]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 benchmarks/gpu_smoke.py /tmp/smollm.gguf "$OUT" 2>&1 | tee "$OUT/gpu_smoke.log"
python3 -m dspark.cli bench decode --no-spec --model /tmp/smollm.gguf --device cuda --max-tokens 128 --runs 3 --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log"
