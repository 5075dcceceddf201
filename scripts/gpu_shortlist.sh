#!/usr/bin/env bash
# What --shortlist costs and buys on one H200, in three device calls (written in the twenty-sixth session, not yet run).
#
#   scripts/gpu_shortlist.sh cost OUTDIR   qwen3-8b dummy, 16K in, 512 out: dense, quest and oasis with a list of 2x
#                                          (quest and oasis take it; dense runs as the anchor), then oasis with 3x;
#                                          the shortlist kernel's own time a layer in the kernel profile
#   scripts/gpu_shortlist.sh eval OUTDIR   SmolLM2 at the issue's sizes (bf16, every task, 20 samples a task): quest and
#                                          oasis with mass scores over whole blocks, without and with lists of 2x and 3x
#                                          (in the twin, 3x answered niah_single as the oracle does)
#   scripts/gpu_shortlist.sh eval-finer OUTDIR   the same with the finer selection (per KV head, 4-token summaries)
#                                          and a list of 2x
#   scripts/gpu_shortlist.sh tile OUTDIR   the tiled kernel (twenty-eighth session): its GB/s per chunk width in
#                                          `bench kernels`, its time in the engine's kernel profile, and the step
#                                          cost of 2x lists in quest and oasis beside dense
#   scripts/gpu_shortlist.sh eval4 OUTDIR  oasis with a 4x list (stalled on 2026-12-04 in ptxas, compiling the miss
#                                          fill kernel; stacks are dumped if it runs past 420 s)
#   scripts/gpu_shortlist.sh finer3 OUTDIR the finer selection (per KV head, 4-token summaries) with a 3x list
#   scripts/gpu_shortlist.sh eval40 OUTDIR dense, quest and oasis with mass scores and a 3x list at 40 samples a task
#                                          (the first 20 are eval's)
#   The evals need the GGUF at /root/models (scripts/stage_smollm2_three.sh) and OASISKV_EVAL_CACHE=.carry/eval-cache.
USAGE="usage: scripts/gpu_shortlist.sh cost|tile|eval|eval-finer|eval4|finer3|eval40 OUTDIR"
source "$(dirname "$0")/gpu_what_out.sh" "$@"
quiet() { grep -v 'it/s\]' | grep -v '^\[eval\] context'; }
if [ "$WHAT" = tile ]; then
  $PY -m oasiskv.cli bench kernels --batches 8,43 --shortlist 2 --json "$OUT/kernels_shortlist.json" 2>&1 \
    | tee "$OUT/kernels_shortlist.log" | tail -12
  $PY scripts/gpu_kernel_profile.py --modes quest,oasis --batch 43 --host-gb 100 --graphs --shortlist 2 \
    2>&1 | tee "$OUT/profile_shortlist2.log" | grep --line-buffered -E "=====|_block_lse_kernel|span of" | head -12
  $B --modes dense,quest,oasis --shortlist 2 --json "$OUT/shortlist2_512.json" 2>&1 | quiet | tee "$OUT/shortlist2_512.log" | tail -12
elif [ "$WHAT" = cost ]; then
  $B --modes dense,quest,oasis --shortlist 2 --json "$OUT/shortlist2_512.json" 2>&1 | quiet | tee "$OUT/shortlist2_512.log" | tail -12
  $B --modes oasis --shortlist 3 --json "$OUT/shortlist3_512.json" 2>&1 | quiet | tee "$OUT/shortlist3_512.log" | tail -6
  $PY scripts/gpu_kernel_profile.py --modes quest,oasis --batch 43 --host-gb 100 --graphs --shortlist 2 \
    2>&1 | tee "$OUT/profile_shortlist2.log" | grep -E "=====|_block_lse_kernel|span of" | head -12
else
  E="$PY -m oasiskv.cli eval --model /root/models/SmolLM2-135M-Instruct.Q4_1.gguf --cache-dir .carry/eval-cache \
     --corpus austen --context 8192 --max-num-batched-tokens 16384 --kv-budget 2048 --windows 8 --scored 32 \
     --gen-tokens 32 --samples 20 --batch 50 --fetch-cap 0.05 --draft target --miss-policy fill"
  case "$WHAT" in
    eval) $E --modes dense,quest,oasis --block-score mass --shortlist 0,2,3 --json "$OUT/bf16_shortlist.json" 2>&1 \
            | quiet | tee "$OUT/bf16_shortlist.log" | tail -60 ;;
    eval-finer) $E --modes dense,quest,oasis --shortlist 2 --block-score mass --select-per kv-head --summary-tokens 4 \
            --json "$OUT/bf16_shortlist_finer.json" 2>&1 | quiet | tee "$OUT/bf16_shortlist_finer.log" | tail -40 ;;
    eval4) PYTHONPATH=scripts/hang_dump:. OASIS_HANG_S=420 $E --modes dense,oasis --block-score mass --shortlist 4 \
            --json "$OUT/bf16_shortlist4.json" 2>&1 | quiet | tee "$OUT/bf16_shortlist4.log" | tail -60 ;;
    finer3) $E --modes quest,oasis --shortlist 3 --block-score mass --select-per kv-head --summary-tokens 4 \
            --json "$OUT/bf16_shortlist3_finer.json" 2>&1 | quiet | tee "$OUT/bf16_shortlist3_finer.log" | tail -40 ;;
    eval40) $E --modes dense,quest,oasis --block-score mass --shortlist 3 --samples 40 \
            --json "$OUT/bf16_shortlist3_40.json" 2>&1 | quiet | tee "$OUT/bf16_shortlist3_40.log" | tail -60 ;;
    *) echo "$USAGE" >&2; exit 2 ;;
  esac
fi
