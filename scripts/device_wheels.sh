#!/usr/bin/env bash
# Wheels the GPU machine lacks for `oasiskv serve`/`proxy` and NIXL (scripts/gpu_disagg_bench.sh), fetched here
# into .whl/ (ignored by git: add `/.whl/` to .git/info/exclude) and carried with the device call (carry: [".whl"]).
# nixl-cu13 is slimmed to 29 MiB (scripts/slim_nixl_wheel.py) to fit the 64 MiB a call carries. On the device:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp" \
  nixl-cu13==1.5.1 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.54.0 opentelemetry-api==1.45.2 typing-extensions==4.16.0
rm -rf .whl && mkdir .whl
python3 scripts/slim_nixl_wheel.py "$tmp"/nixl_cu13-*.whl .whl/
find "$tmp" -name '*.whl' ! -name 'nixl_cu13-*' -exec cp {} .whl/ \;
du -sh .whl
