#!/usr/bin/env bash
# What each retrieval cold store costs on SmolLM2 at 8,000 tokens (docs/server.md): the first 8,000
# tokens of the shipped KJV held-out text prefilled under each policy, the report's cache bytes.
# Preload OpenBLAS for speed (LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0).
set -euo pipefail
M=${MODEL:-$(python scripts/fetch_smollm2.py)}
OUT=${OUT:-docs/results}
TEXT=$(mktemp) COLD=$(mktemp -d)
python - "$M" "$TEXT" <<'PY'
import sys
from tinygpt_mlx.evaluate import inputs
from tinygpt_mlx.loading import load
tok = load(sys.argv[1]).tokenizer
ids = tok.encode(inputs.read_text(inputs.HELDOUT_KJV))[:8000]
open(sys.argv[2], "w", encoding="utf-8").write(tok.decode(ids))
PY
for spec in "full:" "ram:--streaming-llm-sink 4 --kiv-hot-budget 1024" \
            "disk:--streaming-llm-sink 4 --kiv-hot-budget 1024 --kiv-cold-store disk --kiv-cold-path $COLD" \
            "bits8:--streaming-llm-sink 4 --kiv-hot-budget 1024 --kiv-cold-bits 8" \
            "int4win:--kv-quantize int4 --streaming-llm-sink 4 --streaming-llm-window 1020"; do
  name=${spec%%:*}; flags=${spec#*:}
  # shellcheck disable=SC2086
  posttrainllm sample "$M" --prompt-file "$TEXT" --no-chat-template --tokens 1 --temperature 0 $flags \
    --report-json "$OUT/smollm2_cold_store_8k_$name.json" > /dev/null
done
rm -rf "$TEXT" "$COLD"
