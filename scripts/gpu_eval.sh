#!/usr/bin/env bash
# The accuracy table of issue #7 on the GPU (one device call, aimed at under 9 minutes on an H200):
# SmolLM2-135M-Instruct at 8K context, budgets 512/1024/2048, every mode against dense, the oasis fetch
# cap swept over 0.01/0.05/1. Writes OUT/eval_8k.json (rewritten after each configuration, so a
# timeout still leaves the finished ones), OUT/eval_8k.png (drop against budget) and OUT/eval_8k.log.
#
# Before the call, in the checkout that is sent (see docs/ACCURACY.md, "GPU run"):
#   ../shared/device/stage-smollm2.sh          # its two calls put the GGUF at /root/models/ on the device
#   OASISKV_EVAL_CACHE=.carry/eval-cache python -c "from oasiskv.evals.texts import load_corpus; load_corpus('austen')"
# then carry .carry/eval-cache (about 6 MB: the parsed novels, so the device needs no fetch and no rdata).
#
# Sizes are smaller than `oasiskv eval`'s full defaults to fit the time: per configuration 10 samples of
# each synthetic task, 4 perplexity windows of 128 scored tokens, 2 copy and 2 long-output windows of
# 128 tokens, all requests of a task in one batch. Override with the variables below.
set -u
export PYTHONUNBUFFERED=1
OUT=${1:-${OUT:-results/eval}}
MODEL=${MODEL:-/root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
CACHE=${CACHE:-.carry/eval-cache}
CONTEXT=${CONTEXT:-8192}; BUDGETS=${BUDGETS:-512,1024,2048}; CAPS=${CAPS:-0.01,0.05,1}
MODES=${MODES:-dense,quest,oasis,oracle,retrieval}  # retrieval last: the slowest, and only a transfer baseline
SAMPLES=${SAMPLES:-10}; WINDOWS=${WINDOWS:-4}; SCORED=${SCORED:-128}; GEN=${GEN:-128}; BATCH=${BATCH:-20}
LIMIT=${LIMIT:-530}  # seconds; the eval is stopped before the device call's 600 s limit and its JSON kept
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null
if [ -d .carry/whl ]; then ${PY:-python3} -m pip install -q --no-deps --no-index .carry/whl/*.whl 2>/dev/null; fi
timeout "$LIMIT" ${PY:-python3} -m oasiskv.cli eval --model "$MODEL" --cache-dir "$CACHE" --corpus austen \
  --modes "$MODES" --context "$CONTEXT" --kv-budget "$BUDGETS" --fetch-cap "$CAPS" --draft ngram \
  --samples "$SAMPLES" --windows "$WINDOWS" --scored "$SCORED" --gen-tokens "$GEN" --batch "$BATCH" \
  --json "$OUT/eval_8k.json" --plot "$OUT/eval_8k.png" 2>&1 | grep -v "it/s\]" | tee "$OUT/eval_8k.log"
echo "exit: ${PIPESTATUS[0]}"
if [ ! -f "$OUT/eval_8k.png" ] && [ -f "$OUT/eval_8k.json" ]; then  # stopped early: table and plot of what finished
  ${PY:-python3} -m oasiskv.evals.report "$OUT/eval_8k.json" --plot "$OUT/eval_8k.png" | tee -a "$OUT/eval_8k.log"
fi
