#!/usr/bin/env bash
# The throughput benchmark of issue #6 on one H200: qwen3-8b --load-format dummy, 16K input, --gpu-memory-gb 72.
#
#   scripts/gpu_throughput.sh OUTDIR PART [PART...]      (PART "all" runs every part, in this order)
#
# Each part is one device call and should finish in under 9 minutes (estimates from the step times in
# docs/BENCHMARKS.md, before CUDA graphs; the host modes' prefill costs ~2 s per 16K request):
#   modes-a     dense, quest, retrieval at the most each holds, 512 output tokens   ~6 min
#   modes-b     oasis likewise, joined with modes-a (ratios to dense, one plot)     ~4 min
#   kernels-hf  bench kernels, then transformers' generate (static cache) at the
#               largest batch that fits 72 GB, 512 output tokens                    ~3 min
#   caps-a      oasis at fetch caps 0.01, 0.02, 0.05 (CAP_BATCH requests)          ~5 min
#   caps-b      oasis at fetch caps 0.1, 1, joined with caps-a                      ~4 min
#   sweep-a     concurrency 1,8,16,32,64 for dense and quest (64 output tokens)     ~3 min
#   sweep-b     the same for retrieval                                              ~4 min
#   sweep-c     the same for oasis, joined with sweep-a and sweep-b                 ~4 min
#   profile-a   per-phase breakdown of a decode step: dense, quest (PROFILE_BATCH)  ~2 min
#   profile-b   the same for retrieval and oasis                                    ~5 min
# Parts that join an earlier one (--compare-to) read its JSON from OUTDIR: run them after it.
# Every part schedules with SCHEDULE (default prefill-first; SCHEDULE=mixed for the engine's default).
# Outputs: OUTDIR/<part>.json, OUTDIR/<part>.png, OUTDIR/<part>.log. Override the variables below to
# try it on a smaller model (e.g. MODEL=qwen3-0.6b CTX=4096 OUTLEN=64).
set -u -o pipefail
OUT=${1:?usage: scripts/gpu_throughput.sh OUTDIR PART [PART...] (parts: see the header)}
shift
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && { echo "name at least one part, or all" >&2; exit 2; }
[ "${PARTS[*]}" = all ] && PARTS=(modes-a modes-b kernels-hf caps-a caps-b sweep-a sweep-b sweep-c profile-a profile-b)
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
MODEL=${MODEL:-qwen3-8b}; CTX=${CTX:-16384}; OUTLEN=${OUTLEN:-512}; SHORT=${SHORT:-64}
CARD_GB=${CARD_GB:-72}; HOST_GB=${HOST_GB:-64}; CAP_BATCH=${CAP_BATCH:-16}; PROFILE_BATCH=${PROFILE_BATCH:-16}
LEVELS=${LEVELS:-1,8,16,32,64}; EXTRA=${EXTRA:-}; SCHEDULE=${SCHEDULE:-prefill-first}
mkdir -p "$OUT"

quiet() { grep --line-buffered -v "it/s\]\|tok/s\]"; }  # progress bars would flood the call's output tail
bench() {
  $PY -m oasiskv.cli bench throughput --model "$MODEL" --load-format dummy --input-len "$CTX" \
    --max-num-batched-tokens "$CTX" --schedule-policy "$SCHEDULE" --gpu-memory-gb "$CARD_GB" --host-kv-gb "$HOST_GB" \
    $EXTRA "$@" 2>&1 | quiet
}
part() {
  local name=$1 j="$OUT/$1.json" p="$OUT/$1.png"
  case $name in
    modes-a) bench --output-len "$OUTLEN" --modes dense,quest,retrieval --json "$j" --plot "$p" ;;
    modes-b) bench --output-len "$OUTLEN" --modes oasis --compare-to "$OUT/modes-a.json" --json "$j" --plot "$p" ;;
    kernels-hf)
      $PY -m oasiskv.cli bench kernels --context "$CTX" --json "$OUT/kernels.json" 2>&1 | quiet
      $PY -m oasiskv.cli bench hf-reference --model "$MODEL" --input-len "$CTX" --output-len "$OUTLEN" \
        --gpu-memory-gb "$CARD_GB" --json "$OUT/hf_reference.json" 2>&1 | quiet ;;
    caps-a) bench --output-len "$SHORT" --max-num-seqs "$CAP_BATCH" --sweep-fetch-cap 0.01,0.02,0.05 --json "$j" --plot "$p" ;;
    caps-b) bench --output-len "$SHORT" --max-num-seqs "$CAP_BATCH" --sweep-fetch-cap 0.1,1 \
              --compare-to "$OUT/caps-a.json" --json "$j" --plot "$p" ;;
    sweep-a) bench --output-len "$SHORT" --modes dense,quest --sweep-concurrency "$LEVELS" --json "$j" --plot "$p" ;;
    sweep-b) bench --output-len "$SHORT" --modes retrieval --sweep-concurrency "$LEVELS" \
               --compare-to "$OUT/sweep-a.json" --json "$j" --plot "$p" ;;
    sweep-c) bench --output-len "$SHORT" --modes oasis --sweep-concurrency "$LEVELS" \
               --compare-to "$OUT/sweep-b.json" --json "$j" --plot "$p" ;;
    profile-a) bench --output-len 16 --max-num-seqs "$PROFILE_BATCH" --modes dense,quest --profile-step --json "$j" ;;
    profile-b) bench --output-len 16 --max-num-seqs "$PROFILE_BATCH" --modes retrieval,oasis --profile-step --json "$j" ;;
    *) echo "unknown part $name (see the header of $0)" >&2; return 2 ;;
  esac
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null
status=0
for name in "${PARTS[@]}"; do
  echo "== $name  $(date -u +%FT%TZ)"
  SECONDS=0
  part "$name" 2>&1 | tee "$OUT/$name.log" || status=1
  echo "== $name took ${SECONDS}s"
done
exit $status
