#!/usr/bin/env bash
# The oasis GPU run recorded in docs/BENCHMARKS.md (one device call): quest and oasis at the same
# batch, oasis at fetch caps 0.01, 0.05 and 1.0. Each run is its own process so one failure does not
# hide the others. Override MODEL/CTX/OUTLEN/BATCH/OUT for a dry run.
set -u
export PYTHONUNBUFFERED=1
MODEL=${MODEL:-qwen3-8b}; CTX=${CTX:-16384}; OUTLEN=${OUTLEN:-32}; BATCH=${BATCH:-16}; OUT=${OUT:-results}
CARD_GB=${CARD_GB:-72}; HOST_GB=${HOST_GB:-64}; EXTRA=${EXTRA:-}
mkdir -p "$OUT"
bench() { ${PY:-python3} -m oasiskv.cli bench throughput --model "$MODEL" --load-format dummy --input-len "$CTX" --output-len "$OUTLEN" \
  --max-num-batched-tokens "$CTX" --gpu-memory-gb "$CARD_GB" --batch-sizes "$BATCH" $EXTRA "$@" 2>&1 | grep -v "it/s\]" ; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null
bench --kv-mode quest --out "$OUT/quest_b${BATCH}.json"
for cap in 0.05 0.01 1; do
  bench --kv-mode oasis --fetch-cap "$cap" --host-kv-gb "$HOST_GB" --out "$OUT/oasis_cap${cap}_b${BATCH}.json"
done
for f in "$OUT"/*.json; do echo "== $f"; python3 -c "import json,sys; [print(r) for r in json.load(open(sys.argv[1]))['rows']]" "$f"; done
