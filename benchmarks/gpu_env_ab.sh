#!/usr/bin/env bash
# A/B of environment settings in one GPU call (same code, same machine): runs AB_CMD once per '|'-separated set of
# VAR=value settings in AB_ENVS, ROUNDS times over (alternating: A B A B), each from /tmp (`python -m` puts the working
# directory first on sys.path) with $V (the set's index and round, e.g. 1r2), $OUT (a scratch folder) and $AB_ROOT
# (this tree) set; each run's output goes to $OUT/ab_$V.log (the last AB_TAIL lines also printed), and after each run
# the scratch folder is packed into the call's $OUT/env_ab.tar.gz (a call brings back 8 files at most; a run cut off
# by the call's limit leaves the earlier ones). No GGUF needed unless AB_CMD reads it.
# Example (the PDL A/B of session 60, random SmolLM2 weights):
#   AB_ENVS='DSPARK_PDL=0|DSPARK_PDL=1' ROUNDS=2 AB_CMD='python3 $AB_ROOT/benchmarks/gpu_graphs_check.py $OUT/g_$V steps' \
#       bash benchmarks/gpu_env_ab.sh
set -uo pipefail
export AB_ROOT=$PWD PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
IFS='|' read -ra SETS <<< "$AB_ENVS"
FINAL_OUT=$OUT
export OUT=/tmp/env_ab; rm -rf $OUT; mkdir -p $OUT
T0=$SECONDS
for r in $(seq 1 "${ROUNDS:-1}"); do
  i=0
  for set in "${SETS[@]}"; do
    i=$((i + 1)); V=${i}r$r
    echo "=== $V ($set) at $((SECONDS - T0))s"
    # shellcheck disable=SC2086  # the set is VAR=value words
    (cd /tmp && env $set V=$V timeout "${AB_S:-280}" bash -c "$AB_CMD") > "$OUT/ab_$V.log" 2>&1
    echo "$V rc=$?"; tail -n "${AB_TAIL:-12}" "$OUT/ab_$V.log"
    tar -C $OUT -czf "$FINAL_OUT/env_ab.tar.gz.tmp" . && mv "$FINAL_OUT/env_ab.tar.gz.tmp" "$FINAL_OUT/env_ab.tar.gz"
  done
done
echo "=== done at $((SECONDS - T0))s"
