"""How much of each head's attention a block-selection rule keeps, on the decode steps of an eval run.

Runs `oasiskv eval --modes quest` with the given flags and, at every sparse decode layer, ranks the blocks
by several rules, selects by each (quest's rule: sink + local window + top blocks, the same budget) and
records the exact attention mass that each query head pays the selected blocks. The tokens are quest's
(its own --block-score); the other rules are only measured. Per rule it prints the mean over heads and
steps, and the mean of each step's worst head.

Rules: `bound` (Quest's score), `mass r=W` (--block-score mass with radius weight W; the engine's is
kernels/block_mass.RADIUS_WEIGHT), `mean key r=0.5` (the same with each block's true mean key in place of its
centre: a third summary the engine does not keep), and `oracle` (exact attention mass: the upper bound of the rule
family). `oracle per KV head` lets each KV head choose its own blocks by its heads' exact mass: the bound of a
selection per KV head instead of one per request and layer, which the engine does not have.

    PYTHONPATH=. python scripts/selection_recall.py --json out.json -- --corpus austen --context 8192 \\
        --kv-budget 2048 --tasks ppl --windows 2 --scored 8 --batch 2
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from oasiskv.cli import main as cli_main
from oasiskv.kernels.block_mass import block_mass_scores_multi_reference, scores_from_logits
from oasiskv.kernels.block_select import block_scores_reference
from oasiskv.kernels.selection_rule import select_blocks_padded
from oasiskv.policies.oracle import attention_mass_per_head
from oasiskv.policies.sparse import QuestPolicy

RADIUS_WEIGHTS = (1.0, 0.75, 0.5, 0.25, 0.0)


def rule_scores(policy: QuestPolicy, layer: int, q: torch.Tensor, tables: torch.Tensor, nblocks: torch.Tensor,
                mass: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 [B, blocks] per rule; `mass` [B, Hkv, group, blocks] is the exact per-head attention mass."""
    summaries = policy.summaries.layer(layer)
    valid = torch.arange(tables.shape[1], device=q.device)[None, :] < nblocks.long()[:, None]
    out = {"bound": block_scores_reference(q, summaries, tables, nblocks)}
    for weight in RADIUS_WEIGHTS:
        out[f"mass r={weight:g}"] = block_mass_scores_multi_reference(q[None], summaries, tables, nblocks[None],
                                                                      policy.scale, radius_weight=weight)[0]
    out["mean key r=0.5"] = mean_key_scores(policy, layer, q, tables, valid, 0.5)
    out["oracle"] = mass.amax(dim=2).sum(dim=1).masked_fill(~valid, float("-inf"))
    return out


def mean_key_scores(policy: QuestPolicy, layer: int, q: torch.Tensor, tables: torch.Tensor, valid: torch.Tensor,
                    weight: float) -> torch.Tensor:
    """--block-score mass's rule with each block's mean key (over its filled slots) as the centre."""
    kv = policy.pool.layer(layer)  # [blocks, 2, block_size, Hkv, D]
    bsz, hq, d = q.shape
    _, _, block_size, hkv, _ = kv.shape
    keys = kv[tables.long().clamp(min=0), 0].float()  # [B, W, block_size, Hkv, D]
    slot = torch.arange(tables.shape[1] * block_size, device=q.device).view(1, -1, block_size)
    filled = slot < policy.meta.decode_seq_lens.long()[:, None, None]
    mean = (keys * filled[..., None, None]).sum(2) / filled.sum(2).clamp(min=1)[..., None, None]
    summaries = policy.summaries.layer(layer)[tables.long().clamp(min=0)].float()
    radius = (summaries[:, :, 1] - summaries[:, :, 0]) / 2
    qf = q.float().view(bsz, hkv, hq // hkv, d)
    est = torch.einsum("bjgd,bghd->bghj", mean, qf) + weight * torch.einsum("bjgd,bghd->bghj", radius, qf.abs())
    return scores_from_logits(est[None] * policy.scale, valid.sum(1, dtype=torch.int32)[None])[0]


def kept_mass_per_kv_head(policy: QuestPolicy, mass: torch.Tensor, nblocks: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, group]: each KV head selects by its own heads' exact mass (best head of the group)."""
    valid = torch.arange(mass.shape[-1], device=mass.device)[None, :] < nblocks.long()[:, None]
    return torch.stack([kept_mass(policy, mass[:, g].amax(1).masked_fill(~valid, float("-inf")), nblocks,
                                  mass)[:, g] for g in range(mass.shape[1])], dim=1)


def kept_mass(policy: QuestPolicy, scores: torch.Tensor, nblocks: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, group]: the attention mass of each head inside the rule's selection."""
    cfg = policy.cfg
    _, picked = select_blocks_padded(scores, nblocks, policy.budget_blocks, cfg.sink_blocks, cfg.local_blocks)
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, picked.clamp(min=0).long(), picked >= 0)
    return (mass * chosen[:, None, None, :]).sum(-1)


def measure_into(totals: dict[str, list[float]]):
    """A QuestPolicy.select that records every rule's kept mass before selecting as quest does."""
    select = QuestPolicy.select

    def measuring_select(policy: QuestPolicy, layer: int, q: torch.Tensor, tables: torch.Tensor):
        nblocks = policy.rows_now.nblocks
        mass = attention_mass_per_head(q, policy.pool.layer(layer), tables, policy.meta.decode_seq_lens, policy.scale)
        kept = {rule: kept_mass(policy, scores, nblocks, mass)
                for rule, scores in rule_scores(policy, layer, q, tables, nblocks, mass).items()}
        kept["oracle per KV head"] = kept_mass_per_kv_head(policy, mass, nblocks)
        for rule, heads in kept.items():
            heads = heads.flatten(1)  # [B, query heads]
            totals[rule + " mean"].append(heads.mean().item())
            totals[rule + " worst head"].append(heads.amin(1).mean().item())
        return select(policy, layer, q, tables)
    return measuring_select


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("eval_args", nargs=argparse.REMAINDER, help="-- then `oasiskv eval` flags (quest mode is set)")
    args = p.parse_args()
    flags = [a for a in args.eval_args if a != "--"]
    totals: dict[str, list[float]] = defaultdict(list)
    QuestPolicy.select = measure_into(totals)
    cli_main(["eval", *flags, "--modes", "quest"])
    result = {k: round(sum(v) / len(v), 5) for k, v in totals.items()}
    result["selections"] = len(totals["bound mean"])
    print(f"\nattention mass kept per head, {result['selections']} selections (decode steps x sparse layers):")
    for rule in dict.fromkeys(k.removesuffix(" worst head").removesuffix(" mean") for k in totals):
        print(f"  {rule:20s} mean {result[rule + ' mean']:.4f}   worst head {result[rule + ' worst head']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"eval_args": flags, "kept_mass": result}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
