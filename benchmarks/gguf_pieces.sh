#!/usr/bin/env bash
# The SmolLM2 GGUF (98 MB) cannot travel in one device call (64 MiB each, tracked tree included, and the
# tree holds the 29 MB shipped drafter: 34.1 MB in all). `bash benchmarks/device_assets.sh` makes the pieces
# (sized to the tree and the other carried files), the prompt file and the gguf wheel in a fresh workspace and
# prints what each call carries. By hand: the pieces, gzipped (92.7 MB) in
# three (two of 31 MiB, the third 26.4 MiB, which leaves room for the 3.7 MB prompt file beside it):
#     gzip -9 -c "$(python -c 'from dspark.models.gguf_loader import default_gguf_path as d; print(d())')" > /tmp/g.gz
#     split -b 31M -a 2 /tmp/g.gz .model/smollm.gguf.gz.p_
# or in pieces of any sizes (session 37: 20 + 32.4 + 32.4 + 7.9 MB, so the first call also carries the
# 10.7 MB Triton cache and the last the prompts and wheels); they are joined once they make a whole stream.
# then make one call per piece, each carrying it (carry [".model/smollm.gguf.gz.p_aa"], ...) and running
#     bash benchmarks/gguf_pieces.sh
# back to back (the machine keeps /tmp only while warm, ~30 s between calls). The call that brings the
# last piece joins them into /tmp/smollm.gguf and checks its sha256. The older ungzipped pieces
# (four .model/smollm.gguf.p30_a? of 30 MiB, or two .model/smollm.gguf.part_a?) are accepted too.
#
# A Triton kernel cache from an earlier session (.model/triton-cache.tar.gz, carried by any call, e.g.
# with p30_ad) is unpacked into ~/.triton/cache once per machine: a fresh machine otherwise compiles
# every kernel again (session 19: a bench process loaded in 138 s cold against 29 s warm, an
# acceptance run's graph capture took ~180 s cold). Make one at the end of a session's last call:
#     tar -C ~/.triton -czf "$OUT/triton-cache.tar.gz" cache      (returned files are at most 16 MiB)
# or, when it is larger (session 43's was 23.6 MB and did not come back), in pieces joined here afterwards:
#     tar -C ~/.triton -czf - cache | split -b 15M -a 2 - "$OUT/triton-cache.tar.gz.p_"
#     cat <files_at>/triton-cache.tar.gz.p_a? > .model/triton-cache.tar.gz
# Triton keys its cache on the kernel source, its version and the GPU, so entries of kernels changed
# since are simply not hit.
set -euo pipefail
# Once per machine (a marker in /tmp), merged into whatever an earlier call, e.g. a kernel benchmark run first,
# already compiled there (session 44: the first call ran --seed-grid, so a check on ~/.triton/cache alone would
# have skipped the unpack).
if [ -f .model/triton-cache.tar.gz ] && [ ! -f /tmp/.dspark_triton_cache_unpacked ]; then
  mkdir -p ~/.triton && tar -C ~/.triton -xzf .model/triton-cache.tar.gz && touch /tmp/.dspark_triton_cache_unpacked \
    && echo "triton cache: $(ls ~/.triton/cache | wc -l) entries"
fi
# Token files from earlier sessions (.model/data/train-*.safetensors.gz, heldout-*.safetensors), carried by any
# call, e.g. one of their own when they do not fit beside a piece: into /tmp/dspark_data, where every training
# call of benchmarks/train_gpu_split.sh finds them (trained on, and the held-out files evaluated).
mkdir -p /tmp/dspark_data
for f in .model/data/train-*.safetensors.gz; do if [ -f "$f" ]; then gunzip -c "$f" > "/tmp/dspark_data/$(basename "$f" .gz)"; fi; done
for f in .model/data/heldout-*.safetensors; do if [ -f "$f" ]; then cp "$f" /tmp/dspark_data/; fi; done
ls /tmp/dspark_data/*.safetensors > /dev/null 2>&1 && echo "token files in /tmp/dspark_data: $(ls /tmp/dspark_data | tr '\n' ' ')"
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
for f in .model/smollm.gguf.gz.p_* .model/smollm.gguf.p30_* .model/smollm.gguf.part_a?; do [ -f "$f" ] && cp "$f" /tmp/; done
if [ ! -f /tmp/smollm.gguf ]; then
  # any number of gzip pieces: joined once they make a whole gzip stream (gunzip -t), whatever their sizes
  if ls /tmp/smollm.gguf.gz.p_* >/dev/null 2>&1 && cat /tmp/smollm.gguf.gz.p_a? | gunzip -t 2>/dev/null; then
    cat /tmp/smollm.gguf.gz.p_a? | gunzip > /tmp/smollm.gguf
  elif [ "$(ls /tmp/smollm.gguf.p30_* 2>/dev/null | wc -l)" -eq 4 ]; then
    cat /tmp/smollm.gguf.p30_a? > /tmp/smollm.gguf
  elif [ -f /tmp/smollm.gguf.part_aa ] && [ -f /tmp/smollm.gguf.part_ab ]; then
    cat /tmp/smollm.gguf.part_aa /tmp/smollm.gguf.part_ab > /tmp/smollm.gguf
  fi
fi
if [ -f /tmp/smollm.gguf ]; then
  echo "$SHA  /tmp/smollm.gguf" | sha256sum -c
else
  echo "pieces in /tmp so far: $(ls /tmp/smollm.gguf.gz.p_* /tmp/smollm.gguf.p30_* /tmp/smollm.gguf.part_a? 2>/dev/null | tr '\n' ' ')"
fi
