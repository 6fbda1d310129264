#!/usr/bin/env bash
# What each retrieval cold store costs on SmolLM2 (docs/server.md): the first TOKENS tokens
# (default 8000) of the shipped KJV held-out text, looped when TOKENS is longer than it (about
# 21K tokens), prefilled under each policy; the report's cache bytes, disk bytes and peak RSS.
#   TOKENS=32000 POLICIES="ram disk bits8 int4win" bash benchmarks/smollm2_cold_store.sh
# The full cache is measured only within SmolLM2's 8,192-token context.
# Preload OpenBLAS for speed (LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0).
set -euo pipefail
M=${MODEL:-$(python scripts/fetch_smollm2.py)}
OUT=${OUT:-docs/results}
N=${TOKENS:-8000}
POLICIES=${POLICIES:-full ram disk bits8 int4win}
TEXT=$(mktemp) COLD=$(mktemp -d)
trap 'rm -rf "$TEXT" "$COLD"' EXIT
python - "$M" "$TEXT" "$N" <<'PY'
import sys
from tinygpt_mlx.evaluate import inputs
from tinygpt_mlx.loading import load
tok = load(sys.argv[1]).tokenizer
n = int(sys.argv[3])
ids = tok.encode(inputs.read_text(inputs.HELDOUT_KJV))
ids = (ids * (n // len(ids) + 1))[:n]
open(sys.argv[2], "w", encoding="utf-8").write(tok.decode(ids))
PY
HOT="--streaming-llm-sink 4 --kiv-hot-budget 1024"
declare -A FLAGS=(
  [full]=""
  [ram]="$HOT --kiv-cold-store ram"
  [disk]="$HOT --kiv-cold-store disk --kiv-cold-path $COLD"   # the default cold store until 2026-12-04
  [bits8]="$HOT --kiv-cold-bits 8 --kiv-cold-store disk --kiv-cold-path $COLD"  # on disk, 8-bit
  [int4win]="--kv-quantize int4 --streaming-llm-sink 4 --streaming-llm-window 1020")
for name in $POLICIES; do
  echo "smollm2_cold_store: $name at $N tokens" >&2
  # shellcheck disable=SC2086
  posttrainllm sample "$M" --prompt-file "$TEXT" --no-chat-template --tokens 1 --temperature 0 ${FLAGS[$name]} \
    --report-json "$OUT/smollm2_cold_store_$((N / 1000))k_$name.json" > /dev/null
done
