"""Drops NIXL's expert-parallel extension (nixl_ep_*, ~100 MB unpacked) from a nixl-cuXX wheel so the
wheel fits the device tool's 64 MiB carry limit; oasiskv needs only the agent API and the UCX plugin.
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 -d /tmp/whl nixl-cu13==1.5.1
  python3 scripts/slim_nixl_wheel.py /tmp/whl/nixl_cu13-*.whl .whl/"""
from __future__ import annotations

import os
import sys
import zipfile


def dropped(name: str) -> bool:
    return name.split("/", 1)[0].startswith("nixl_ep_")


def slim(src: str, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    dst = os.path.join(out_dir, os.path.basename(src))
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if dropped(info.filename):
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):  # pip checks the files it lists
                kept = [line for line in data.decode().splitlines() if not dropped(line.split(",", 1)[0])]
                data = ("\n".join(kept) + "\n").encode()
            zout.writestr(info, data)
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    path = slim(sys.argv[1], sys.argv[2])
    print(f"{path}: {os.path.getsize(path) / 2**20:.1f} MiB")
