#!/usr/bin/env bash
# Oasis's statistics inside captured (CUDA-graph) decode steps against the same run in eager steps (one device call).
#
#   scripts/gpu_stats_check.sh OUTDIR
#
# The thirty-eighth session corrected, on the CPU, how oasis counts misses and fills (a list's fetch counted as hits,
# the fill rate over cold misses too). Captured steps replay kernels that update the same counters: this runs oasis
# with `--miss-policy fill` and with `--shortlist 2 --miss-policy fetch` (qwen3-8b dummy, 8K in, 64 out, 16 requests)
# once replaying CUDA graphs and once eagerly, and prints the counters side by side. The tokens are the same (same
# seed, same kernels), so every counter should be equal, up to float sums.
set -u -o pipefail
OUT=${1:?usage: scripts/gpu_stats_check.sh OUTDIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
bench() {
  $PY -m oasiskv.cli bench throughput --model qwen3-8b --load-format dummy --input-len 8192 --output-len 64 \
    --num-prompts 16 --max-num-seqs 16 --schedule-policy prefill-first --gpu-memory-gb 72 --host-kv-gb 40 \
    --modes oasis "$@" 2>&1 | grep --line-buffered -v "it/s\]\|tok/s\]"
}
for variant in fill shortlist; do
  case $variant in
    fill) flags=(--miss-policy fill) ;;
    shortlist) flags=(--shortlist 2 --miss-policy fetch) ;;
  esac
  for steps in graphs eager; do
    extra=(); [ "$steps" = eager ] && extra=(--enforce-eager)
    echo "== $variant $steps  $(date -u +%T)"
    bench "${flags[@]}" "${extra[@]}" --json "$OUT/$variant-$steps.json" > "$OUT/$variant-$steps.log"
    tail -4 "$OUT/$variant-$steps.log"
  done
done
$PY - "$OUT" <<'EOF'
import json, sys, os
out = sys.argv[1]
keys = ("hit_rate", "agreement", "fill_rate", "draft_accuracy", "pcie_gb_per_step", "prefetch_gb_per_step",
        "pure_decode_steps", "output_tok_s", "preemptions")
def flat(d, prefix=""):
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else []
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from flat(v, f"{prefix}{k}.")
        elif k in keys:
            yield prefix + k, v
for variant in ("fill", "shortlist"):
    rows = {}
    for steps in ("graphs", "eager"):
        path = os.path.join(out, f"{variant}-{steps}.json")
        if os.path.exists(path):
            rows[steps] = dict(flat(json.load(open(path))))
    print(f"\n{variant}: counter | graphs | eager")
    for k in sorted(set().union(*[r.keys() for r in rows.values()]) if rows else []):
        print(f"  {k} | {rows.get('graphs', {}).get(k)} | {rows.get('eager', {}).get(k)}")
EOF
