#!/usr/bin/env bash
# Reproduces docs/retrieval.md "Beyond KIV's limits": several keyed facts asked one or all of
# them, and a phone book of look-alike entries, on the keyed model (docs/model.md, stage 3).
#   1. the full cache at 480 tokens (inside the trained context), base vs keyed model, and the
#      plain pass key beside them;
#   2. StreamingLLM vs retrieval (the same hot memory: sink 4 + 256) at 2K, 8K and 16K tokens.
# Needs data/heldout.txt (scripts/fetch_corpus.sh). Outputs go to docs/results/kiv_limits/.
# About 30 minutes on a 2-core CPU; STAGE=full or STAGE=long runs one part. POLICIES narrows the
# long part's policies (default streaming,retrieval); EXTRA adds retrieval flags to every run
# (the tables measured before 2026-12-02 used EXTRA="--kiv-summary hybrid --no-kiv-sticky
# --kiv-index-expand 1", the retrieval defaults then).
set -euo pipefail
BASE=${BASE:-models/tinygpt-base.tinygpt}
KEYED=${KEYED:-models/tinygpt-keyed.tinygpt}
OUT=${OUT:-docs/results/kiv_limits}
STAGE=${STAGE:-all}
POLICIES=${POLICIES:-streaming,retrieval}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
COMMON="--depths 0.1,0.3,0.5,0.7,0.9 --filler data/heldout.txt --streaming-llm-sink 4 --kiv-hot-budget 256 $EXTRA"
if [ "$STAGE" != long ]; then
  for model in base keyed; do
    path=$BASE; [ $model = keyed ] && path=$KEYED
    for task in passkey keyed keyed-all phonebook; do
      posttrainllm needle "$path" --contexts 480 --seeds 4 --policies full --task $task --facts 4 $COMMON \
        --json "$OUT/full480_${model}_${task}.json"
    done
  done
fi
if [ "$STAGE" != full ]; then
  for task in keyed keyed-all phonebook; do
    posttrainllm needle "$KEYED" --contexts 2048,8192,16384 --seeds 3 --policies "$POLICIES" \
      --task $task --facts 4 $COMMON --json "$OUT/long_${task}.json"
  done
fi
