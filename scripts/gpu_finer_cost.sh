#!/usr/bin/env bash
# What the finer selection (--summary-tokens 4, --select-per kv-head) costs a decode step, and where, on one H200
# (qwen3-8b --load-format dummy, 16K input, 43 requests: oasis's concurrency at --host-kv-gb 100). One device call,
# meant to fit in 10 minutes (not yet run); written after the twenty-fourth session's runs, which left these open:
#   1. the mass score's kernels alone, with whole-block and 4-token summaries (the normaliser now folded once per
#      sequence by its own kernel)
#   2. a kernel profile of oasis's replayed steps with mass scores and 4-token summaries: which kernels the step's
#      time goes to
#   3. dense and oasis in one throughput run at 512 output tokens with mass scores and 4-token summaries
#
#   scripts/gpu_finer_cost.sh OUTDIR
set -u -o pipefail
OUT=${1:?usage: scripts/gpu_finer_cost.sh OUTDIR}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for parts in 1 4; do
  $PY scripts/gpu_score_bench.py --mass --parts $parts --batch 43 --blocks 1314 --json "$OUT/score_mass_p$parts.json" \
    2>&1 | tee "$OUT/score_mass_p$parts.log" | tail -12
done
$PY scripts/gpu_kernel_profile.py --modes oasis --batch 43 --host-gb 100 --graphs --block-score mass --summary-tokens 4 \
  2>&1 | tee "$OUT/profile_sum4.log" | tail -40
$PY -m oasiskv.cli bench throughput --model qwen3-8b --load-format dummy --input-len 16384 --output-len 512 \
  --max-num-batched-tokens 16384 --schedule-policy prefill-first --gpu-memory-gb 72 --host-kv-gb 100 \
  --modes dense,oasis --block-score mass --summary-tokens 4 --json "$OUT/sum4_512.json" \
  2>&1 | grep -v 'it/s\]' | tee "$OUT/sum4_512.log" | tail -30
