#!/usr/bin/env bash
# The draft's placement compare (kernels/draft_kv.py) and the fill compare (kernels/miss_fill.py) on one H200
# (twenty-ninth session), in two device calls; qwen3-8b dummy, no staging needed.
#
#   scripts/gpu_placement.sh kernels OUTDIR  the fused residency+placement kernel alone per working-set width and
#                                            compare size; the fill kernel per compare size; the kernel profile of
#                                            oasis at 43 requests with a 2x list and without one
#   scripts/gpu_placement.sh engine OUTDIR   the kernel profile of oasis with a 2x list again, then throughput of oasis
#                                            with a 2x list and without one (16K in, 512 out)
USAGE="usage: scripts/gpu_placement.sh kernels|engine OUTDIR"
source "$(dirname "$0")/gpu_what_out.sh" "$@"
KERNELS="=====|_resident_draft_kernel|_block_lse_kernel|_fill_kernel|span of"
case "$WHAT" in
  kernels)
    $PY scripts/gpu_resident_bench.py --json "$OUT/resident_bench.json" 2>&1 | tee "$OUT/resident_bench.log"
    $PY scripts/gpu_fill_bench.py --compare-elements 8192,32768 --json "$OUT/fill_bench.json" 2>&1 \
      | tee "$OUT/fill_bench.log"
    for list in 2 0; do
      $PY scripts/gpu_kernel_profile.py --modes oasis --batch 43 --host-gb 100 --graphs --shortlist $list 2>&1 \
        | tee "$OUT/profile_oasis_list$list.log" | grep --line-buffered -E "$KERNELS" | cut -c1-60,150-260
    done ;;
  engine)
    $PY scripts/gpu_kernel_profile.py --modes oasis --batch 43 --host-gb 100 --graphs --shortlist 2 2>&1 \
      | tee "$OUT/profile_oasis_list2.log" | grep --line-buffered -E "$KERNELS" | cut -c1-60,150-260
    $B --modes oasis --shortlist 2 --json "$OUT/oasis_list2_512.json" 2>&1 | grep -v 'it/s\]' \
      | tee "$OUT/oasis_list2_512.log" | tail -8
    $B --modes oasis --json "$OUT/oasis_512.json" 2>&1 | grep -v 'it/s\]' | tee "$OUT/oasis_512.log" | tail -8 ;;
  *) echo "$USAGE" >&2; exit 2 ;;
esac
