#!/usr/bin/env bash
# ../shared/device/stage-smollm2.sh splits the GGUF in two 48 MiB parts, but this tree (about 26 MB, the shipped
# EAGLE-3 head among it) plus one part passes the 64 MiB a device call carries. This runs it, then splits the model
# again in three parts of 32 MiB (.carry/model-a, -b, -c) and prints the three calls. The third call may also carry
# .carry/eval-cache, the eval's texts (about 6 MB; made here by
# `OASISKV_EVAL_CACHE=.carry/eval-cache python -c "from oasiskv.evals.texts import load_corpus; load_corpus('austen')"`).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
../shared/device/stage-smollm2.sh > /dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat .carry/model-a/part .carry/model-b/part > "$work/model.gguf"
sum=$(sha256sum "$work/model.gguf" | cut -d' ' -f1)
rm -rf .carry/model-a .carry/model-b .carry/model-c
split -b 32M -d "$work/model.gguf" "$work/part"
for pair in a:00 b:01 c:02; do
  mkdir -p ".carry/model-${pair%%:*}" && mv "$work/part${pair##*:}" ".carry/model-${pair%%:*}/part"
done
cat <<MSG
Staged in three parts (sha256 $sum). Three device calls, each within 30 s of the last:
  1) carry [".carry/model-a", ".carry/whl"]:
     mkdir -p /root/models && cp .carry/model-a/part /root/models/a.part && python3 -m pip install -q --no-index --no-deps .carry/whl/*.whl
  2) carry [".carry/model-b"]:
     cp .carry/model-b/part /root/models/b.part
  3) carry [".carry/model-c", ".carry/eval-cache"]:
     cat /root/models/a.part /root/models/b.part .carry/model-c/part > /root/models/SmolLM2-135M-Instruct.Q4_1.gguf && sha256sum /root/models/SmolLM2-135M-Instruct.Q4_1.gguf; <your run>
MSG
