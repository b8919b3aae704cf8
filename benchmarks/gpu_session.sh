#!/usr/bin/env bash
# The last call of a GPU session (earlier calls bring the GGUF pieces: benchmarks/gguf_pieces.sh): joins the
# GGUF, installs the carried wheels (.whl/: gguf; .whl/serve/: the server's dependencies for Python 3.12),
# then runs, each bounded by a timeout, and writes every log/JSON to $OUT:
#   1. the long-context recall test at full size (3,000-6,000 tokens, 16 concurrent vs serial) on the GPU,
#      speculating with the shipped drafter;
#   2. `dspark bench serve` against `dspark serve` on the GPU, without and with DSpark
#      (benchmarks/serve_cases.sh: SERVE_CASES, SERVE_MAX_TOKENS, ...);
#   3. the Triton kernel benchmarks (benchmarks/kernel_*_bench.py);
#   graphs: the CUDA-graph checks and step timings on random weights (benchmarks/gpu_graphs_check.py);
#   correctness: `dspark bench correctness` (spec vs no spec vs HF, greedy, 64 prompts x 128 tokens);
#   bench: `dspark bench`, the side-by-side matrix (HF static+compiled, dspark, dspark + DSpark), once per
#          '|'-separated set of options in BENCH_ARGS;
#   cprofile: where continuous batching's time goes, plain vs DSpark (benchmarks/gpu_continuous_profile.py);
#   invariance: benchmarks/invariance_check.py --parts $INV_PARTS (default attention) $INV_ARGS (e.g. --sweep);
#   fewrow: the few-row decoder-layer chains and their kernels' launch sweep (benchmarks/fewrow_chain_bench.py,
#           FEWROW_ARGS, default: 8/2/16 rows, the qkv+RoPE and gate|up kernels swept).
# STEPS picks and orders them; BACKEND (default triton) is the attention backend of the dspark runs. The archive
# ($OUT/gpu_session.tar.gz) is rewritten after every step and every set of options, so that a call cut off by its time
# limit (or by the session's device time) still brings back what finished.
set -uo pipefail
bash benchmarks/gguf_pieces.sh  # joins the GGUF from the pieces carried so far
[ -f /tmp/smollm.gguf ] || exit 1
WHEELS=$(ls .whl/*.whl .whl/serve/*.whl 2>/dev/null)
[ -n "$WHEELS" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DSPARK_SMOLLM2_GGUF=/tmp/smollm.gguf TQDM_DISABLE=1
cp .model/sharegpt_prompts.json.gz /tmp/ 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
STEPS=${STEPS:-longctx serve kernels}
DEV=${DEV:-cuda}
FINAL_OUT=$OUT
OUT=/tmp/gpu_session; rm -rf $OUT; mkdir -p $OUT  # packed into one archive (pack; 8 files come back at most)
T0=$SECONDS
pack() {  # $OUT so far -> the archive that comes back (written aside, then renamed: never half an archive)
  tar -C $OUT -czf "$FINAL_OUT/gpu_session.tar.gz.tmp" . && mv "$FINAL_OUT/gpu_session.tar.gz.tmp" "$FINAL_OUT/gpu_session.tar.gz"
}
split_env() {  # leading VAR=value words -> ENVS, the rest -> ARGS
  ENVS=(); ARGS=()
  for w in "$@"; do
    if [ ${#ARGS[@]} -eq 0 ] && [[ $w =~ ^[A-Z_][A-Z0-9_]*= ]]; then ENVS+=("$w"); else ARGS+=("$w"); fi
  done
}
for step in $STEPS; do
  echo "=== $step at $((SECONDS - T0))s"
  case $step in
  longctx)
    DSPARK_LONGCTX_TOKENS=3000,6000 DSPARK_TEST_DEVICE=cuda DSPARK_TEST_SPEC_CONFIG='{"method": "dspark"}' \
      timeout 240 python3 -m pytest tests/server/test_long_context.py -s -x -q -p no:cacheprovider \
      > "$OUT/longctx.log" 2>&1; echo "longctx rc=$?"; grep -E "recall|passed|failed|Error" "$OUT/longctx.log" | head -5 ;;
  serve)
    bash benchmarks/serve_cases.sh ;;
  graphs)
    timeout ${GRAPHS_S:-240} python3 benchmarks/gpu_graphs_check.py "$OUT/graphs" ${GRAPHS_PARTS:-correct,steps} \
      > "$OUT/graphs.log" 2>&1; echo "graphs rc=$?"; grep -v "^ " "$OUT/graphs.log" | tail -n 30 ;;
  correctness)  # HF's pass (one prompt per generate, the exact default) alone outlasted 200 and 240 s in session 43;
    # CORRECT_ARGS="--hf-batch-size 16" (left padding) took 37.5 s in session 44, the whole step 86 s.
    # CORRECT_ARGS, like BENCH_ARGS: one set or several separated by '|', each may start with VAR=value settings
    i=0; IFS='|' read -ra SETS <<< "${CORRECT_ARGS:-}"; [ ${#SETS[@]} -eq 0 ] && SETS=("")
    for args in "${SETS[@]}"; do
      i=$((i + 1)); name=correctness; [ ${#SETS[@]} -gt 1 ] && name=correctness_$i
      split_env $args
      (cd /tmp && env "${ENVS[@]}" timeout ${CORRECT_S:-420} python3 -m dspark.cli bench correctness --device $DEV \
        --attention-backend ${BACKEND:-triton} --prompt-source /tmp/sharegpt_prompts.json.gz --out "$OUT/$name.json" \
        "${ARGS[@]}") > "$OUT/$name.log" 2>&1
      echo "$name rc=$? ($args)"; tail -n 25 "$OUT/$name.log"; pack
    done ;;
  bench)  # BENCH_ARGS: one set of options, or several separated by '|' (one process each: bench_1, ...); a set
    # may start with VAR=value settings for its process alone, e.g. 'DSPARK_INVARIANT_ATTENTION=mma --runs 3'.
    # Run from /tmp: `python -m` puts the working directory first on sys.path, so from the repo root a set's
    # PYTHONPATH=<another tree> would still import this tree's dspark (session 59's A/B ran the new code twice).
    # Options' paths must be absolute. A/B of code versions: benchmarks/gpu_ab.sh.
    i=0; IFS='|' read -ra SETS <<< "${BENCH_ARGS:-}"; [ ${#SETS[@]} -eq 0 ] && SETS=("")
    for args in "${SETS[@]}"; do
      i=$((i + 1)); name=bench; [ ${#SETS[@]} -gt 1 ] && name=bench_$i
      split_env $args
      (cd /tmp && env "${ENVS[@]}" timeout ${BENCH_S:-300} python3 -m dspark.cli bench --device $DEV \
        --attention-backend ${BACKEND:-triton} --prompt-source /tmp/sharegpt_prompts.json.gz --json "$OUT/$name.json" \
        --plot-dir "$OUT/plots_$name" "${ARGS[@]}") > "$OUT/$name.log" 2>&1
      echo "$name rc=$? ($args)"; tail -n 25 "$OUT/$name.log"; pack
    done ;;
  invariance)  # which launches change a row's bits (benchmarks/invariance_check.py; INV_PARTS, default attention)
    timeout ${INV_S:-200} python3 benchmarks/invariance_check.py "$OUT/inv" --parts ${INV_PARTS:-attention} ${INV_ARGS:-} \
      > "$OUT/invariance.log" 2>&1; echo "invariance rc=$?"; grep -v Warning "$OUT/invariance.log" | tail -n 12 ;;
  cprofile)
    timeout ${CPROF_S:-300} python3 benchmarks/gpu_continuous_profile.py "$OUT/cprofile" \
      --prompt-source /tmp/sharegpt_prompts.json.gz ${CPROF_ARGS:-} > "$OUT/cprofile.log" 2>&1
    echo "cprofile rc=$?"; grep -E '^(plain|dspark)|"(tok_s|calls|ms_per_call|tau)"|"(execute|launch|readback)' "$OUT/cprofile.log" | head -60 ;;
  fewrow)
    timeout ${FEWROW_S:-300} python3 benchmarks/fewrow_chain_bench.py "$OUT/fewrow.json" \
      ${FEWROW_ARGS:---rows 8,2,16 --sweep --kinds qkvr,gu} > "$OUT/fewrow.log" 2>&1
    echo "fewrow rc=$?"; grep -v Warning "$OUT/fewrow.log" | tail -n 12 ;;
  kernels)  # KERNELS: which benchmarks (default attention ops rejection); KERNEL_ARGS: options for each
    for k in ${KERNELS:-attention ops rejection}; do
      [ -f benchmarks/kernel_${k}_bench.py ] || continue
      timeout 100 python3 benchmarks/kernel_${k}_bench.py --out "$OUT/kernel_$k.json" ${KERNEL_ARGS:-} \
        > "$OUT/kernel_$k.log" 2>&1
      echo "kernel $k rc=$?"; tail -n 30 "$OUT/kernel_$k.log"
    done ;;
  esac
  pack
done
echo "=== done at $((SECONDS - T0))s"
pack
