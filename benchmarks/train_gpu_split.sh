#!/usr/bin/env bash
# Train DSpark drafters for SmolLM2-135M-Instruct (block sizes in RUNS, default 5; "5 7" trains two side
# by side, each at about half speed) on the H200, split over two device calls (each is limited to
# 10 minutes; /tmp survives between calls made within the machine's idle window). Usage, run from the
# repo root with $OUT set:
#   call A: bash benchmarks/train_gpu_split.sh gen+train   regenerate data, train both runs until the deadline
#            (from random weights, or from the drafter in INIT; EXTRA="--gen-sampling t1" regenerates at T = 1)
#   call B: bash benchmarks/train_gpu_split.sh train+eval  resume both to the end of their schedules, then τ
#           (bash benchmarks/train_gpu_split.sh train: resume until this call's deadline, no τ; a schedule
#           longer than two calls)
#   or, instead of call A, on token files brought from earlier sessions (no regeneration):
#   call A': bash benchmarks/train_gpu_split.sh carried+train   gunzip .model/data/train-*.safetensors.gz
#            (and heldout-*.safetensors) into /tmp/dspark_data, then go on training the drafter in INIT
#            (default: the shipped one; INIT=none starts from random weights)
# Token files in /tmp/dspark_data (carried by any call of this machine's session) are trained on in every
# training call (--extra-data), and its held-out file is the τ_prob set (--eval-data); a held-out file
# regenerated in this session is evaluated as well (heldout1_* metrics: e.g. T = 1 text beside T = 0.7).
# Needs /tmp/smollm.gguf (benchmarks/gguf_pieces.sh: joined from the pieces carried by earlier calls) and the gguf wheel in .whl/ (call A).
# $OUT receives the drafter shards as <run>-<file> plus meta.tar.gz with everything else (the device
# returns at most 8 files). Environment knobs: GEN_S (regeneration seconds), TRAIN_S (training seconds
# over both calls, the schedule is fitted to it), DEADLINE_S (per call), EVAL_PROMPTS, EVAL_TOKENS, RUNS,
# GEN_SEQS / GEN_KV_GB (the regeneration engine's max_num_seqs and KV cache), GEN_GROUPS (below).
# GEN_GROUPS="SAMPLING:PROCS[:FLAGS];..." (gen+train): regenerate with several engine processes side by side,
# PROCS per group, each group with its own --gen-sampling preset and flags, e.g.
#   GEN_GROUPS="t1:3;deepspec:3:--prompt-offset 7400"
# Every group process queues all training prompts three times (--num-prompts 14828 --gen-passes 3, before
# FLAGS, which may override them) so that its queue outlasts GEN_S: with train_gpu.py's default of 6,000
# prompts shared by the group's processes, session 38's four T = 1 processes ran dry after 24-26 s of 170.
# Regeneration is host-bound (one Python scheduler at hundreds of requests per step), so processes on
# separate cores share the GPU; the groups' token files are merged into this call's data file, the first
# group's held-out file is this call's held-out file and each further group's is evaluated too
# (heldout-gen<j>.safetensors among the carried files).
set -euo pipefail
MODE=${1:?gen+train or train+eval}
GEN_S=${GEN_S:-150}
TRAIN_S=${TRAIN_S:-660}
DEADLINE_S=${DEADLINE_S:-550}
EVAL_PROMPTS=${EVAL_PROMPTS:-64}
EVAL_TOKENS=${EVAL_TOKENS:-256}
RUNS=${RUNS:-5}
bash benchmarks/gguf_pieces.sh  # joins the GGUF from the pieces carried so far
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
PROMPTS=/tmp/sharegpt_prompts.json.gz
[ -f .model/sharegpt_prompts.json.gz ] && cp .model/sharegpt_prompts.json.gz $PROMPTS
RES=/tmp/dspark_results
mkdir -p $RES
# EXTRA: flags for every phase (a CPU dry run: EXTRA="--device cpu --num-prompts 8 ..." ).
# shellcheck disable=SC2206
COMMON=(--model /tmp/smollm.gguf --out $RES --work /tmp/dspark_train --prompt-source $PROMPTS ${EXTRA:-})
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
CARRIED=/tmp/dspark_data  # token files this call or an earlier one carried (gguf_pieces.sh unpacks them)
mkdir -p $CARRIED
data_flags() {  # the token files in $CARRIED: trained on (--extra-data) and evaluated (--eval-data)
  DATA_FLAGS=()
  TRAIN_FILES=$(ls $CARRIED/train-*.safetensors 2>/dev/null | paste -sd, - || true)
  if [ -n "$TRAIN_FILES" ]; then DATA_FLAGS+=(--extra-data "$TRAIN_FILES"); fi
  HELDOUT=$(ls $CARRIED/heldout-*.safetensors 2>/dev/null | paste -sd, - || true)
  if [ -n "$HELDOUT" ]; then DATA_FLAGS+=(--eval-data "$HELDOUT"); fi
  echo "carried token files: ${TRAIN_FILES:-none}; held-out: ${HELDOUT:-none} (+ the one regenerated here)"
}
data_flags

gen_groups() {  # GEN_GROUPS: regeneration processes side by side, merged into /tmp/dspark_train
  local gi=0 k samp procs flags
  rm -rf /tmp/dspark_gen
  IFS=';' read -ra groups <<< "$GEN_GROUPS"
  for g in "${groups[@]}"; do
    IFS=':' read -r samp procs flags <<< "$g"
    for ((k = 0; k < procs; k++)); do
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=2 python3 benchmarks/train_gpu.py "${COMMON[@]}" --work /tmp/dspark_gen/$gi-$k --run gen$gi-$k \
        --phase gen --gen-sampling "$samp" --gen-shard $k/$procs --gen-budget-s "$GEN_S" \
        --gen-max-num-seqs ${GEN_SEQS:-256} --gen-kv-cache-gb ${GEN_KV_GB:-8} --num-prompts 14828 --gen-passes 3 $flags > $RES/gen$gi-$k.log 2>&1 &
    done
    gi=$((gi + 1))
  done
  wait
  grep -h "generated" $RES/gen*.log || true
  mkdir -p /tmp/dspark_train
  python3 - "$CARRIED" <<'PY'
import glob, shutil, sys
from dspark.train.data import TokenData
parts = sorted(glob.glob("/tmp/dspark_gen/*/data.safetensors"))
d = TokenData.load_many(parts)
d.save("/tmp/dspark_train/data.safetensors")
print(f"merged {len(parts)} regenerations: {len(d)} sequences, {d.meta['num_response_tokens']} response tokens")
for h in sorted(glob.glob("/tmp/dspark_gen/*-0/heldout.safetensors")):
    g = h.split("/")[-2].split("-")[0]
    shutil.copy(h, "/tmp/dspark_train/heldout.safetensors" if g == "0" else f"{sys.argv[1]}/heldout-gen{g}.safetensors")
PY
  data_flags
}

train_all() {  # $1: extra flags, $2: seconds kept after training; runs stop by the call's deadline
  local stop=$((DEADLINE_S - SECONDS - 40 - $2))
  for b in $RUNS; do
    python3 benchmarks/train_gpu.py "${COMMON[@]}" --phase train --run b$b --block-size $b \
      --train-budget-s "$TRAIN_S" --stop-after-s $stop "${DATA_FLAGS[@]}" $1 > $RES/train_b$b.$MODE.log 2>&1 &
  done
  wait
  tail -n 3 $RES/train_b*.$MODE.log
}

if [ "$MODE" = gen+train ]; then
  if [ -n "${GEN_GROUPS:-}" ]; then
    gen_groups
  else
    python3 benchmarks/train_gpu.py "${COMMON[@]}" --phase gen --gen-budget-s "$GEN_S" \
      --gen-max-num-seqs ${GEN_SEQS:-512} --gen-kv-cache-gb ${GEN_KV_GB:-16} 2>&1 | tee $RES/gen.log
  fi
  INIT=${INIT:-none}  # INIT=dspark/drafters/smollm2-135m-instruct: go on training the shipped drafter
  if [ "$INIT" = none ]; then train_all "" 0; else train_all "--init-from $INIT" 0; fi
elif [ "$MODE" = carried+train ]; then
  [ -n "$TRAIN_FILES" ] || { echo "carried+train: no .model/data/train-*.safetensors.gz carried"; exit 1; }
  INIT=${INIT:-dspark/drafters/smollm2-135m-instruct}
  if [ "$INIT" = none ]; then train_all "" 0; else train_all "--init-from $INIT" 0; fi
elif [ "$MODE" = train ]; then
  train_all --resume 0
else
  train_all --resume 120
  for b in $RUNS; do
    python3 benchmarks/train_gpu.py "${COMMON[@]}" --phase eval --run b$b --eval-prompts "$EVAL_PROMPTS" \
      --eval-max-tokens "$EVAL_TOKENS" > $RES/eval_b$b.log 2>&1 &
  done
  wait
  tail -n 2 $RES/eval_b*.log
fi
# the regenerated token files come back too, gzipped and cut into 15 MiB parts (a returned file is at most
# 16 MiB), so data accumulates over sessions: join them into .model/data/ (cat data-train.gz.part_* | gunzip)
# and pass them to a later session with EXTRA="--extra-data ... --prompt-offset N"
if [ "$MODE" = gen+train ]; then
  gzip -c /tmp/dspark_train/data.safetensors | split -b 15M -a 1 - "$OUT/data-train.gz.part_"
  cp /tmp/dspark_train/heldout.safetensors "$OUT/data-heldout.safetensors"
  for f in $CARRIED/heldout-gen*.safetensors; do if [ -f "$f" ]; then cp "$f" "$OUT/data-$(basename "$f")"; fi; done
fi
# pack: shards as separate files (each ≤ 16 MiB), the rest in one archive
for b in $RUNS; do
  for f in $RES/b$b/drafter/*.safetensors; do if [ -f "$f" ]; then cp "$f" "$OUT/b$b-$(basename "$f")"; fi; done
done
tar -C $RES -czf "$OUT/meta.tar.gz" --exclude='*.safetensors' .
ls -la "$OUT"
