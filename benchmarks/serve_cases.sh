#!/usr/bin/env bash
# `dspark serve` on the GPU, without and with DSpark, each measured by `dspark bench serve` (chat
# endpoint, streaming, held-out ShareGPT prompts) at several concurrencies. Run from the root of the
# dspark tree to measure (benchmarks/gpu_session.sh's serve step; benchmarks/gpu_ab.sh with
# AB_CMD='bash $AB_ROOT/benchmarks/serve_cases.sh' for an A/B). Needs the GGUF at /tmp/smollm.gguf
# (DSPARK_SMOLLM2_GGUF), the server wheels (.whl/serve) on PYTHONPATH and /tmp/sharegpt_prompts.json.gz.
#   SERVE_MODES   default "plain dspark"
#   SERVE_CASES   concurrency:prompts:temperature triples, default "32:128:0"
#   SERVE_MAX_TOKENS (128), SERVE_BENCH_S (100 s per bench call), DEV (cuda)
# Writes $OUT/serve${V:+_$V}/{serve_MODE.log, bench_serve_MODE_cC_tT.{json,log}}.
set -uo pipefail
D=$OUT/serve${V:+_$V}; mkdir -p "$D"
[ -f /tmp/heldout.jsonl ] || python3 -c "
import json
from dspark.train.data import heldout_prompts
with open('/tmp/heldout.jsonl', 'w') as f:
    for p in heldout_prompts(None, '/tmp/sharegpt_prompts.json.gz'):
        f.write(json.dumps({'prompt': p}) + '\n')"
for mode in ${SERVE_MODES:-plain dspark}; do
  spec=(); [ $mode = dspark ] && spec=(--speculative-config '{"method": "dspark"}')
  python3 -m dspark.cli serve --device ${DEV:-cuda} --port 8011 --max-num-seqs 64 --disable-uvicorn-access-log \
    "${spec[@]}" > "$D/serve_$mode.log" 2>&1 &
  pid=$!
  python3 -c "
import time, urllib.request
for _ in range(480):
    try:
        urllib.request.urlopen('http://127.0.0.1:8011/health', timeout=2); break
    except Exception:
        time.sleep(0.5)"
  for case in ${SERVE_CASES:-32:128:0}; do
    IFS=: read -r conc nump temp <<< "$case"; tag=${mode}_c${conc}_t${temp}
    timeout ${SERVE_BENCH_S:-100} python3 -m dspark.cli bench serve --port 8011 --dataset-path /tmp/heldout.jsonl \
      --num-prompts $nump --max-concurrency $conc --temperature $temp --max-tokens ${SERVE_MAX_TOKENS:-128} \
      --json "$D/bench_serve_$tag.json" > "$D/bench_serve_$tag.log" 2>&1
    echo "${V:+$V }bench serve $tag rc=$?: $(grep -E 'Output token throughput' "$D/bench_serve_$tag.log" | tr -s ' ') \
| $(grep -E 'Median TPOT' "$D/bench_serve_$tag.log" | tr -s ' ') | $(grep -E 'P99 ITL' "$D/bench_serve_$tag.log" | tr -s ' ') \
| $(grep -E 'P90 TTFT' "$D/bench_serve_$tag.log" | tr -s ' ') | $(grep -E '^tau' "$D/bench_serve_$tag.log" | tr -s ' ')"
  done
  kill $pid; wait $pid 2>/dev/null
done
