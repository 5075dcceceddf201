#!/usr/bin/env bash
# The accuracy table of issue #7 on the GPU, one device call aimed at under 9 minutes on an H200:
# SmolLM2-135M-Instruct at 8K context, budgets 512/1024/2048, modes dense/quest/oracle/oasis with the
# fetch cap swept over 0.01/0.05/1, then retrieval (same tokens as quest by construction, the slowest
# per step) at budget 2048 in the time left. Usage: scripts/gpu_eval.sh OUTDIR
# Writes OUTDIR/eval_8k.{json,png,log} and OUTDIR/eval_8k_retrieval.{json,log}. Each JSON is
# rewritten after every configuration, so a run stopped by its time limit keeps what finished (the
# table and plot of it are then made from the JSON).
#
# Before the call, in the checkout that is sent (docs/ACCURACY.md, "GPU run"):
#   ../shared/device/stage-smollm2.sh      # its two device calls put the GGUF at /root/models/
#   OASISKV_EVAL_CACHE=.carry/eval-cache python -c "from oasiskv.evals.texts import load_corpus; load_corpus('austen')"
# and carry .carry/eval-cache: the parsed novels, so the device needs neither apt nor rdata.
#
# Sizes: the step is host-bound (docs/BENCHMARKS.md: ~3 ms per layer quest, ~8 ms oasis), so time goes
# with decode steps, not batch: 8 perplexity windows x 32 scored tokens (256 positions), 4 copy and
# 4 long-output windows of 32 tokens, 10 samples per synthetic task, every task's requests in one batch.
# Estimate ~195 decode steps per configuration: dense ~5 s, quest/oracle ~18 s, oasis ~47 s each, plus
# ~66 prompts of 8K prefilled per configuration in 16K-token chunks: ~8 minutes for the first eval.
set -u
export PYTHONUNBUFFERED=1
OUT=${1:-${OUT:-results/eval}}
MODEL=${MODEL:-/root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
CACHE=${CACHE:-.carry/eval-cache}
CONTEXT=${CONTEXT:-8192}; BUDGETS=${BUDGETS:-512,1024,2048}; CAPS=${CAPS:-0.01,0.05,1}
MISS=${MISS:-skip}  # oasis's miss policies, e.g. MISS=skip,fill (each policy doubles oasis's rows)
SIZES=${SIZES:---windows 8 --scored 32 --gen-tokens 32 --samples 10 --batch 20 --max-num-batched-tokens 16384}
LIMIT=${LIMIT:-530}  # seconds for both evals: under the device call's 600 s, with room to fetch results
PY=${PY:-python3}
mkdir -p "$OUT"
start=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null

run_eval() {  # NAME SECONDS ARGS...: one eval under a time limit; table and plot from its JSON if it stopped
  local name=$1 limit=$2; shift 2
  timeout "$limit" $PY -m oasiskv.cli eval --model "$MODEL" --cache-dir "$CACHE" --corpus austen \
    --context "$CONTEXT" $SIZES --json "$OUT/$name.json" "$@" 2>&1 | grep -v "it/s\]" | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name: exit $rc after $((SECONDS - start)) s"
  if [ "$rc" != 0 ] && [ -f "$OUT/$name.json" ]; then
    $PY -m oasiskv.evals.report "$OUT/$name.json" --plot "$OUT/$name.png" | tee -a "$OUT/$name.log"
  fi
}

run_eval eval_8k $((LIMIT - 60)) --modes dense,quest,oracle,oasis --kv-budget "$BUDGETS" --fetch-cap "$CAPS" \
  --draft ngram --miss-policy "$MISS" --plot "$OUT/eval_8k.png"
left=$((LIMIT - (SECONDS - start)))
if [ "$left" -gt 45 ]; then
  run_eval eval_8k_retrieval "$left" --modes dense,retrieval --kv-budget 2048
else
  echo "no time left for retrieval ($left s)"
fi
