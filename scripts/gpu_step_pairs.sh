#!/usr/bin/env bash
# Alternating quest/oasis rows of scripts/gpu_host_phases.py (b16 x 16K, staggered positions), one process each,
# and each pair's wall and graph ratio: the #4 comparison. Host time varies between processes and machines, so
# compare the rows of one call. Usage: scripts/gpu_step_pairs.sh OUT [PAIRS] [extra gpu_host_phases args]
set -u
export PYTHONUNBUFFERED=1
OUT=${1:?usage: scripts/gpu_step_pairs.sh OUT [PAIRS]}; PAIRS=${2:-4}; shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$OUT"
for i in $(seq 1 "$PAIRS"); do
  for m in quest oasis; do
    PYTHONPATH=. timeout 100 python scripts/gpu_host_phases.py --strides 0 --modes "$m" "$@" \
      --json "$OUT/hp_${m}_$i.json" > "$OUT/hp_${m}_$i.log" 2>&1 || echo "$m $i failed: $(tail -3 "$OUT/hp_${m}_$i.log")"
  done
done
python3 - "$OUT" "$PAIRS" <<'PY'
import json, sys
out, pairs, rows = sys.argv[1], int(sys.argv[2]), []
host = lambda r: sum(v for k, v in r["host_ms_per_step"].items() if not k.startswith(("sample", "land")))
for i in range(1, pairs + 1):
    try:
        q, o = (json.load(open(f"{out}/hp_{m}_{i}.json"))[0] for m in ("quest", "oasis"))
    except (OSError, ValueError, IndexError) as e:
        print(f"pair {i}: no result ({e})")
        continue
    rows.append({"pair": i, "quest": q, "oasis": o})
    print(f"pair {i}: quest wall {q['wall_ms_per_step']:6.2f} graph {q['graph_device_ms']:5.2f} host {host(q):4.2f} | "
          f"oasis wall {o['wall_ms_per_step']:6.2f} graph {o['graph_device_ms']:5.2f} host {host(o):4.2f} | "
          f"wall ratio {o['wall_ms_per_step'] / q['wall_ms_per_step']:.3f} "
          f"graph ratio {o['graph_device_ms'] / q['graph_device_ms']:.3f}")
json.dump(rows, open(f"{out}/host_phases_pairs.json", "w"), indent=1)
if rows:
    q = sum(r["quest"]["wall_ms_per_step"] for r in rows)
    o = sum(r["oasis"]["wall_ms_per_step"] for r in rows)
    print(f"mean wall: quest {q / len(rows):.2f} oasis {o / len(rows):.2f} ratio {o / q:.3f}")
PY
