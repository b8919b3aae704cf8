#!/usr/bin/env bash
# Side-by-side A/B of code versions in one GPU call: the working tree ("new") against a base revision
# unpacked here into .model/ab_base (git-ignored; carry it), each running the same command, in turn
# ORDER (default "base new"), so all meet the same machine. Any other name X in ORDER runs the copy in
# .model/ab_X (e.g. the working tree with one constant changed: an A/B of that change alone). Make the
# base copy with
#     rm -rf .model/ab_base && mkdir -p .model/ab_base && git archive REV dspark | tar -x -C .model/ab_base \
#         --exclude='dspark/drafters/*'
# (the shipped drafter is copied in from the tree on the machine). The GGUF pieces come first as for
# benchmarks/gpu_session.sh (benchmarks/gguf_pieces.sh). AB_CMD is the command, run from the root of its version
# (others: from .model/ab_$V, since `python -m` puts the working directory first on sys.path) with $V
# (base|new|X), $OUT and $AB_ROOT (this tree's root: scripts of the new version) set, e.g.
#     AB_CMD='python3 -m dspark.cli bench --device cuda --attention-backend triton --no-hf ... --json $OUT/bench_$V.json'
set -uo pipefail
bash benchmarks/gguf_pieces.sh
[ -f /tmp/smollm.gguf ] || exit 1
for V in ${ORDER:-base new}; do
  [ "$V" = new ] && continue
  [ -d .model/ab_$V/dspark ] || { echo "no .model/ab_$V/dspark: carry it"; exit 1; }
  cp -r dspark/drafters .model/ab_$V/dspark/
done
WHEELS=$(ls .whl/*.whl .whl/serve/*.whl 2>/dev/null)
[ -n "$WHEELS" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS
cp .model/sharegpt_prompts.json.gz /tmp/ 2>/dev/null
export AB_ROOT=$PWD PYTHONUNBUFFERED=1 DSPARK_SMOLLM2_GGUF=/tmp/smollm.gguf TQDM_DISABLE=1
T0=$SECONDS
for V in ${ORDER:-base new}; do
  src=$PWD; [ "$V" = new ] || src=$PWD/.model/ab_$V
  echo "=== $V at $((SECONDS - T0))s"
  (cd "$src" && V=$V PYTHONPATH=/tmp/site:$src timeout ${AB_S:-280} bash -c "$AB_CMD") > "$OUT/ab_$V.log" 2>&1
  echo "$V rc=$?"; tail -n ${AB_TAIL:-25} "$OUT/ab_$V.log"
done
echo "=== done at $((SECONDS - T0))s"
