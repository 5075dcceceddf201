"""Oasis's statistics from its counters: agreement of the prediction with x_t's selection (in all and per layer),
hit and fill rates, prefetch bytes, and the prefetch's time, hidden behind compute or exposed."""
from __future__ import annotations

import torch


def lookahead_stats(policy, out: dict) -> dict:
    """`out` (the tiered policy's stats) with oasis's added, for `policy` (an OasisPolicy)."""
    chunk = policy.host.chunk_bytes
    hits, total = policy.counter_index["agree_hits"], policy.counter_index["agree_total"]
    agreement = policy.layer_counts[0][:, [hits, total]].tolist()
    out["kv_agreement"] = ratio(out["kv_agree_hits"], out["kv_agree_total"])
    out["kv_agreement_per_layer"] = [ratio(h, t) for h, t in agreement]
    out["kv_hit_rate"] = ratio(out["kv_hits"], out["kv_selected_blocks"])
    # --miss-policy fill: the misses left out (not the cold-start or fetched ones) that it replaced
    out["kv_fill_rate"] = ratio(out["kv_filled_blocks"], out["kv_misses_to_fill"])
    out["kv_prefetch_bytes"] = out["kv_prefetched_blocks"] * chunk
    out["kv_prefetch_bytes_per_step"] = out["kv_prefetch_bytes"] / max(policy.decode_steps, 1)
    out["kv_fetch_cap_blocks"] = policy.fetch_cap_blocks
    out["kv_max_prefetched_blocks"] = int(policy.most_prefetched.max())
    if policy.clock:
        torch.cuda.synchronize()
        policy.clock.collect()
        for name, seconds in policy.clock.totals.items():
            out[f"kv_time_{name}_s"] = round(seconds, 6)
    else:  # synchronous on the CPU: every prefetch is on the critical path
        out["kv_time_prefetch_exposed_s"] = out.get("kv_time_prefetch_s", 0.0)
    out["kv_time_prefetch_hidden_s"] = round(out.get("kv_time_prefetch_s", 0.0)
                                             - out.get("kv_time_prefetch_exposed_s", 0.0), 6)
    return out


def ratio(a: int, b: int) -> float | None:
    return round(a / b, 6) if b else None
