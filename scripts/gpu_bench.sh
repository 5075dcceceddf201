#!/usr/bin/env bash
# The GPU benchmark run recorded in docs/BENCHMARKS.md (one device call). Each mode runs in its own
# process so one failure does not hide the others. Override MODEL/CTX/OUTLEN/OUT for a dry run.
set -u
export PYTHONUNBUFFERED=1
MODEL=${MODEL:-qwen3-8b}; CTX=${CTX:-16384}; OUTLEN=${OUTLEN:-16}; OUT=${OUT:-results}
CARD_GB=${CARD_GB:-72}; HOST_GB=${HOST_GB:-64}; EXTRA=${EXTRA:-}
mkdir -p "$OUT"
bench() { ${PY:-python3} -m oasiskv.cli bench throughput --model "$MODEL" --load-format dummy --input-len "$CTX" --output-len "$OUTLEN" \
  --max-num-batched-tokens "$CTX" $EXTRA "$@" 2>&1 | grep -v "it/s\]" ; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null
bench --kv-mode dense --batch-sizes 1,8,32 --out "$OUT/dense_full_card.json"
bench --kv-mode retrieval --gpu-memory-gb "$CARD_GB" --host-kv-gb "$HOST_GB" --batch-sizes max --out "$OUT/retrieval_${CARD_GB}gb.json"
bench --kv-mode quest --gpu-memory-gb "$CARD_GB" --batch-sizes max --out "$OUT/quest_${CARD_GB}gb.json"
bench --kv-mode dense --gpu-memory-gb "$CARD_GB" --batch-sizes max --out "$OUT/dense_${CARD_GB}gb.json"
for f in "$OUT"/*.json; do echo "== $f"; python3 -c "import json,sys; [print(r) for r in json.load(open(sys.argv[1]))['rows']]" "$f"; done
