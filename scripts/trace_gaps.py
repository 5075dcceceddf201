"""Where the wall time of profiled decode steps goes, from a trace that scripts/gpu_kernel_profile.py
--trace-dir saved: device work (the union of all streams' kernels and copies) against idle gaps, the
gaps longer than --min-gap-us with the work on either side, and how long each cudaGraphLaunch call held
the host.

    python scripts/trace_gaps.py TRACE.json.gz [--min-gap-us 100]"""
from __future__ import annotations

import argparse
import gzip
import json


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--min-gap-us", type=float, default=100)
    args = p.parse_args()
    with gzip.open(args.trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    work = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                  key=lambda e: e["ts"])
    t0, end, last, busy, idle, start = work[0]["ts"], None, None, 0.0, 0.0, work[0]["ts"]
    for e in work:
        if end is not None and e["ts"] > end:
            gap = e["ts"] - end
            idle += gap
            busy += end - start
            start = e["ts"]
            if gap > args.min_gap_us:
                print(f"gap {gap / 1000:6.2f} ms at +{(end - t0) / 1000:7.2f} ms: after {last['name'][:45]!r}, "
                      f"before {e['name'][:45]!r}")
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    busy += end - start
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e["name"]]
    print(f"span {(end - t0) / 1000:.2f} ms: device busy {busy / 1000:.2f} ms, idle {idle / 1000:.2f} ms; "
          f"{len(work)} kernels and copies")
    print("cudaGraphLaunch on the host: " + ", ".join(f"{e['dur'] / 1000:.2f} ms at +{(e['ts'] - t0) / 1000:.2f}"
                                                      for e in launches))


if __name__ == "__main__":
    main()
