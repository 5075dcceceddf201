#!/usr/bin/env bash
# The tensor-parallel GPU run for docs/BENCHMARKS.md (device calls on nvidia-h200-x2: see "Parts"):
#   1. equality on the GPUs (NCCL): TP2 tokens and selections = one GPU (scripts/gpu_tp_check.py);
#   2. the collectives TP adds per layer (score all-reduce beside the hidden all-reduce), NCCL;
#   3. decode throughput of qwen3-8b (--load-format dummy) at 16K context with --tensor-parallel-size 2:
#      dense vs oasis, and one GPU of each for reference.
# Each run is its own process so one failure does not hide the others. Override TP/MODEL/CTX/OUTLEN/
# BATCHES/OUT for a dry run (e.g. TP=2 CTX=2048 MODEL=qwen3-0.6b on any two GPUs). Decode steps replay CUDA
# graphs that contain the NCCL collectives; if capture fails there, rerun with EXTRA=--enforce-eager.
# Output is line-buffered so a killed run still shows how far it got. The check is bounded by CHECK_S;
# for stack dumps of a hang, run with PYTHONPATH=scripts/hang_dump:. OASIS_HANG_S=<seconds>.
# Parts (one device call of under 10 minutes each): `gpu_tp_bench.sh check`, `... collectives`,
# `... dense`, `... oasis`; no argument runs all four.
set -u
PARTS=${*:-check collectives dense oasis}
part() { [[ " $PARTS " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1
TP=${TP:-2}; MODEL=${MODEL:-qwen3-8b}; CTX=${CTX:-16384}; OUTLEN=${OUTLEN:-32}; BATCHES=${BATCHES:-1,8,32,max}
HOST_GB=${HOST_GB:-96}; OUT=${OUT:-results/tp}; PY=${PY:-python3}; EXTRA=${EXTRA:-}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null
nvidia-smi topo -m 2>/dev/null | head -5

if part check; then
  echo "== 1. equality (fp32, NCCL)"
  timeout -k 10 ${CHECK_S:-400} $PY scripts/gpu_tp_check.py --tp "$TP" 2>&1 | grep --line-buffered -v "it/s\]"
fi

if part collectives; then
  echo "== 2. collectives per layer (NCCL, bf16 hidden 4096, 1024 blocks = 16K tokens)"
  $PY -m oasiskv.bench.tp_collectives --device cuda --world "$TP" --blocks $((CTX / 16)) --hidden 4096 --batch-sizes 1,8,32
fi

bench() { $PY -m oasiskv.cli bench throughput --model "$MODEL" --load-format dummy --input-len "$CTX" \
  --output-len "$OUTLEN" --max-num-batched-tokens "$CTX" $EXTRA "$@" 2>&1 | grep --line-buffered -v "it/s\]" ; }
echo "== 3. throughput at $CTX tokens"
if part dense; then
  bench --tensor-parallel-size "$TP" --kv-mode dense --batch-sizes "$BATCHES" --out "$OUT/dense_tp${TP}.json"
  bench --kv-mode dense --batch-sizes "$BATCHES" --out "$OUT/dense_tp1.json"
fi
if part oasis; then
  bench --tensor-parallel-size "$TP" --kv-mode oasis --host-kv-gb "$HOST_GB" --batch-sizes "$BATCHES" \
    --out "$OUT/oasis_tp${TP}.json"
  bench --kv-mode oasis --host-kv-gb "$HOST_GB" --batch-sizes "$BATCHES" --out "$OUT/oasis_tp1.json"
fi
for f in "$OUT"/*.json; do [ -e "$f" ] || continue; echo "== $f"
  $PY -c "import json,sys; [print(r) for r in json.load(open(sys.argv[1]))['rows']]" "$f"; done
