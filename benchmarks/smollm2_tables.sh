#!/usr/bin/env bash
# Re-measures the headline tables on the real model, SmolLM2-135M-Instruct (GGUF Q4_1, dense fp32
# weights on the CPU backend), into docs/results/smollm2_*.json (docs/gguf.md). Preload OpenBLAS
# for the speed rows (LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0).
set -euo pipefail
MODEL=${MODEL:-$(python scripts/fetch_smollm2.py)}
OUT=docs/results
part=${1:-all}
if [[ $part == all || $part == weights ]]; then
  # packed vs dense weights, one interleaved run each way (prefill and decode at 512 tokens)
  for w in dense packed dense packed; do
    posttrainllm bench "$MODEL" --weights $w --contexts 512 --policies fp32 --decode-steps 16 \
      --json "$OUT/smollm2_weights_$w.json"
  done
fi
if [[ $part == all || $part == bench ]]; then
  posttrainllm bench "$MODEL" --contexts 1024 --decode-steps 16 \
    --policies fp32,int8,int4,sink4/window252,mlx,mlx-rotating256,mlx-q8,mlx-q4 --json "$OUT/smollm2_bench.json"
fi
if [[ $part == all || $part == compare ]]; then
  posttrainllm compare "$MODEL" --tokens 60 --modes int8,int4,int2,k8v4,int4+top64,sink4/window252 \
    --json "$OUT/smollm2_compare_short.json"
fi
if [[ $part == all || $part == perplexity ]]; then
  posttrainllm perplexity "$MODEL" --max-tokens 2048 --prefill-tokens 1024 \
    --modes int8,int4,int2,k8v4,sink4/window1020,window1024 --json "$OUT/smollm2_perplexity_2k.json"
fi
if [[ $part == all || $part == streaming ]]; then
  # StreamingLLM past the trained context (8192): perplexity per 2K-token segment over 16K tokens
  # of the shipped held-out text; the windows one token per call, as decoding feeds them; the
  # full cache in chunks of 512 (exact for a full cache), past its context with --past-context
  posttrainllm perplexity "$MODEL" --max-tokens 16385 --prefill-tokens 1024 --baseline none \
    --modes sink4/window1020,window1024 --segment 2048 --json "$OUT/smollm2_streaming_16k.json"
  posttrainllm perplexity "$MODEL" --max-tokens 16385 --prefill-tokens 512 --score-chunk 512 --baseline none \
    --modes full --past-context --segment 2048 --json "$OUT/smollm2_streaming_16k_full.json"
fi
