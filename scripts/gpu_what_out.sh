# Sourced by the device scripts that take `WHAT OUTDIR` (gpu_shortlist.sh, gpu_placement.sh), after they set USAGE:
# reads both arguments, makes OUTDIR, sets the environment and $PY, prints the GPU, and defines $B, the throughput
# bench of qwen3-8b dummy at 16K in and 512 out in 72 GB of GPU memory and a 100 GB host store (add --modes ...).
set -u -o pipefail
WHAT=${1:?$USAGE}
OUT=${2:?$USAGE}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
B="$PY -m oasiskv.cli bench throughput --model qwen3-8b --load-format dummy --input-len 16384 --output-len 512 \
   --max-num-batched-tokens 16384 --schedule-policy prefill-first --gpu-memory-gb 72 --host-kv-gb 100"
