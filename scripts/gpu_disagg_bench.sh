#!/usr/bin/env bash
# Disaggregated oasis vs single-instance oasis vs dense, served, on one H200 (issue 10): the prefill and
# decode instances are two processes sharing the GPU (each capped at GPU_GB), NIXL over UCX between them
# (same host: shared memory/CMA unless UCX_TLS says otherwise), and `oasiskv proxy` in front. Every
# configuration is measured with the same `oasiskv bench serve` run (random token prompts of CTX tokens,
# OUTLEN output tokens, CONC concurrent requests). Override MODEL/CTX/OUTLEN/NUM/CONC/... for a dry run.
set -u
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
MODEL=${MODEL:-qwen3-8b}; CTX=${CTX:-16384}; OUTLEN=${OUTLEN:-64}; NUM=${NUM:-32}; CONC=${CONC:-16}
# the decode's --host-kv-gb sizes its logical block ids (and their summaries on the GPU) like the prefill's store;
# its real host memory is LOCAL_BLOCKS blocks (qwen3-8b bf16: 2.25 MiB per block of all layers, 6800 = 15 GiB)
GPU_GB=${GPU_GB:-60}; PREFILL_HOST_GB=${PREFILL_HOST_GB:-48}; LOCAL_BLOCKS=${LOCAL_BLOCKS:-6800}
SINGLE_HOST_GB=${SINGLE_HOST_GB:-64}; OUT=${OUT:-results/disagg}; EXTRA=${EXTRA:-}
CONFIGS=${CONFIGS:-"dense oasis disagg"}  # run a subset to split the work across device calls
mkdir -p "$OUT"
MODEL_ARGS=${MODEL_ARGS-"--model $MODEL --load-format dummy"}  # a CPU dry run: MODEL_ARGS="" (SmolLM2)
ENGINE="$MODEL_ARGS --max-num-batched-tokens $CTX --max-model-len $((CTX + OUTLEN + 16)) $EXTRA"
PIDS=()

start() {  # start NAME PORT ARGS...: a server in the background, its log in $OUT/NAME.log
  local name=$1 port=$2; shift 2
  $PY -m oasiskv.cli "$@" --port "$port" --uvicorn-log-level warning > "$OUT/$name.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && return 0
    kill -0 "${PIDS[-1]}" 2> /dev/null || { echo "$name died:"; tail -20 "$OUT/$name.log"; return 1; }
    sleep 1
  done
  echo "$name did not come up"; return 1
}

stop_all() { for p in "${PIDS[@]}"; do kill "$p" 2> /dev/null; done; wait 2> /dev/null; PIDS=(); }
trap stop_all EXIT

bench() {  # bench NAME PORT [METRICS_PORT]: the serving benchmark against one endpoint, then the engine's /metrics
  $PY -m oasiskv.cli bench serve --port "$2" --random-input-len "$CTX" --random-output-len "$OUTLEN" \
    --num-prompts "$NUM" --max-concurrency "$CONC" --ignore-eos --json "$OUT/$1.json" 2>&1 | grep -v "it/s\]"
  curl -s "http://127.0.0.1:${3:-$2}/metrics" | grep -E "^oasiskv:(kv_remote|kv_local|kv_agreement |kv_hit_rate|kv_prefetch_bytes_per_step|engine_disagg)" \
    > "$OUT/$1.metrics"
  cat "$OUT/$1.metrics"
}

nvidia-smi --query-gpu=name,memory.total --format=csv 2> /dev/null
echo "UCX_TLS=${UCX_TLS:-<UCX default>}"

if [[ " $CONFIGS " == *" dense "* ]]; then
echo "== dense, one instance"
start dense 8100 serve $ENGINE --kv-mode dense --gpu-memory-gb "$GPU_GB" && bench dense 8100
stop_all
fi

if [[ " $CONFIGS " == *" oasis "* ]]; then
echo "== oasis, one instance"
start oasis 8100 serve $ENGINE --kv-mode oasis --gpu-memory-gb "$GPU_GB" --host-kv-gb "$SINGLE_HOST_GB" && bench oasis 8100
stop_all
fi

if [[ " $CONFIGS " == *" disagg "* ]]; then
echo "== oasis, disaggregated (prefill + decode on one GPU, NIXL, proxy)"
start prefill 8101 serve $ENGINE --kv-mode oasis --role prefill --kv-transfer nixl --gpu-memory-gb "$GPU_GB" \
  --host-kv-gb "$PREFILL_HOST_GB" &&
start decode 8102 serve $ENGINE --kv-mode oasis --role decode --kv-transfer nixl --gpu-memory-gb "$GPU_GB" \
  --host-kv-gb "$PREFILL_HOST_GB" --local-kv-blocks "$LOCAL_BLOCKS" &&
start proxy 8100 proxy --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8102 &&
bench disagg 8100 8102 && curl -s http://127.0.0.1:8102/metrics | grep -E "^oasiskv:(kv_|engine_)" > "$OUT/disagg_decode.metrics" &&
curl -s http://127.0.0.1:8101/metrics | grep -E "^oasiskv:engine_disagg" > "$OUT/disagg_prefill.metrics"
grep -h "local host KV peak" "$OUT/decode.log" | tail -5
stop_all
fi

for f in "$OUT"/*.json; do echo "== $f"; $PY -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: v for k, v in d.items() if not isinstance(v, (list, dict))})" "$f"; done
