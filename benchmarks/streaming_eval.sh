#!/usr/bin/env bash
# Reproduces docs/streaming.md on the shipped model: bounded memory over a 20,000-token
# generation, and StreamingLLM perplexity on a held-out text 8x the model's context.
# Needs data/heldout.txt (scripts/fetch_corpus.sh). Outputs go to docs/results/.
set -euo pipefail
MODEL=${MODEL:-models/tinygpt-base.tinygpt}
OUT=docs/results
mkdir -p "$OUT"
FLAGS="--streaming-llm-sink 4 --streaming-llm-window 256 --temperature 0.8 --seed 0 --ignore-eos"
for n in 1000 20000; do
  posttrainllm sample "$MODEL" --prompt "And it came to pass" --tokens $n $FLAGS \
    --report-json "$OUT/streaming_rss_$n.json" > /dev/null
done
posttrainllm perplexity "$MODEL" --text data/heldout.txt --max-tokens 4096 --baseline none \
  --modes "window256,window256:absolute,sink1/window255,sink1/window255:absolute,sink4/window252,sink4/window252:absolute" \
  --json "$OUT/streaming_ppl.json"
# the full cache only fits the trained context: score the first 512 tokens for reference
posttrainllm perplexity "$MODEL" --text data/heldout.txt --max-tokens 512 --baseline none \
  --modes "full,window256,sink4/window252,sink4/window252:absolute" --json "$OUT/streaming_ppl_512.json"
