"""Would a finer block selection reach #7's 99% top-1 agreement? A transformers twin, outside the engine.

The engine selects 16-token blocks, one selection per request and layer (the best head of each KV group,
summed over groups). Its kernels, pool and host store are built for that, so finer rules cannot be tried
in it cheaply. This script tries them in transformers' own Llama code: a custom attention function makes
the teacher-forced query rows attend only to the blocks a rule selects, at any block size, with one
selection per layer or one per KV head.

A rule scores blocks by Quest's upper bound over per-block key min/max (`bound`) or by the attention mass
the query pays them (`oracle`), keeps the sink (the first 16 tokens), the local window (the last 64,
with the query's own block) and the best remaining blocks up to the budget. As in the engine's teacher
forcing, the window's prefix is prefilled densely and the scored rows are sparse at every layer: one
forward of the scored rows equals one decode step per row, because row t depends only on rows before it.

    OASISKV_EVAL_CACHE=.carry/eval-cache python scripts/selection_twin.py --context 8192 --windows 4 \
        --scored 64 --budget 2048 --block-sizes 4,8,16,32 --json twin.json
    python scripts/selection_twin.py --join twin_b*.json --plot twin.png     # a table and plot over budgets
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import time

import torch
from tqdm.auto import tqdm

sys.path.insert(0, ".")
from scripts.top1_flips import dense_gaps  # noqa: E402
from scripts.twin_layers import parse_layer_budgets, suggested_weights  # noqa: E402,F401  (tests use both here)
from scripts.twin_sweep import join_runs, plot_sweep, print_sweep  # noqa: E402

SINK_TOKENS, LOCAL_TOKENS = 16, 64  # the engine's defaults: 1 sink and 4 local blocks of 16 tokens
ATTENTION_NAME = "oasiskv_selection_twin"


@dataclasses.dataclass(frozen=True)
class Rule:
    """How the scored rows select their keys; None (the module's `active`) means dense."""

    score: str  # "bound" (Quest), "mass" (the engine's estimated mass) or "oracle" (exact attention mass)
    block: int  # tokens per block
    per_kv_head: bool  # one selection per KV head, else one per layer
    budget: int  # tokens attended per row and layer (per KV head with per_kv_head)
    # bound and mass: tokens per min/max summary, a divisor of block (default: block). A block's bound is then the
    # largest of its sub-blocks' bounds: still an upper bound of q.k over the block, and a tighter one; its mass
    # the sum of its sub-blocks' estimated masses
    summary: int | None = None
    # one selection per layer: how the KV heads' scores (each the best of its group's heads) combine: "sum" (the
    # engine's) or "max" (a block one head wants ranks by that head's score alone)
    combine: str = "sum"
    # the blocks left out still count, estimated (RetroInfer's idea): each as its block's mean key and mean value,
    # weighted by its token count, beside the exact attention to the selected keys
    rest: bool = False
    dense_layer: int | None = None  # this layer attends densely (--ablate-layers: what each layer's selection costs)
    layer_budgets: tuple[tuple[int, int], ...] = ()  # (layer, budget) pairs that replace `budget` there
    # a second pass (0: none): the score keeps the best `shortlist` x budget tokens' blocks, and the exact attention
    # mass over those keys alone ranks them for the budget
    shortlist: float = 0
    # the keys the second pass reads: "exact" (the pool's), "fp8" (an e4m3 copy with one scale per block and KV
    # head: what a list pass reading half the bytes would see) or "fp8-token" (one scale per token and KV head)
    list_keys: str = "exact"
    # per KV head: the layer's heads share budget x heads tokens (as Ada-KV allocates): each keeps its sink and local
    # window, the rest go to the (head, block) pairs of highest score. Scores must compare across heads (oracle, mass)
    pooled: bool = False

    def at_layer(self, layer: int | None) -> "Rule | None":
        """The rule as this layer applies it: None where the layer is dense, else with the layer's budget."""
        if layer is not None and layer == self.dense_layer:
            return None
        budget = dict(self.layer_budgets).get(layer, self.budget)
        return self if budget == self.budget else dataclasses.replace(self, budget=budget)

    @property
    def label(self) -> str:
        sub = f" ({self.summary}-token summaries)" if self.summary not in (None, self.block) else ""
        combined = " per KV head, pooled" if self.pooled else " per KV head" if self.per_kv_head else \
            " max over KV heads" if self.combine == "max" else ""
        rest = " + rest" if self.rest else ""
        dense = f" + layer {self.dense_layer} dense" if self.dense_layer is not None else ""
        if self.shortlist:
            dense += f" + exact over {self.shortlist:g}x" + ("" if self.list_keys == "exact" else
                                                             f" ({self.list_keys} keys)")
        if self.layer_budgets:
            dense += " + " + ", ".join(f"layer {layer} at {b}" for layer, b in self.layer_budgets) + \
                f", others at {self.budget}"
        return f"{self.score} block {self.block}{sub}{combined}{rest}{dense}"


active: Rule | None = None  # the rule of the scored pass now running; the prefix pass is always dense


def block_summaries(keys: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [Hkv, S, D] -> per-block min and max [Hkv, NB, D]; the last block may be partial."""
    hkv, s, d = keys.shape
    nb = -(-s // block)
    pad = nb * block - s
    lo = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("inf")).view(hkv, nb, block, d).amin(2)
    hi = torch.nn.functional.pad(keys, (0, 0, 0, pad), value=float("-inf")).view(hkv, nb, block, d).amax(2)
    return lo, hi


def head_scores(rule: Rule, q: torch.Tensor, keys: torch.Tensor, probs: torch.Tensor,
                scale: float = 1.0) -> torch.Tensor:
    """Per query head, row and block: [Hq, Sq, NB]. q [Hq, Sq, D]; keys [Hkv, S, D]; probs [Hq, Sq, S]; rows sit
    at the last Sq positions; `scale`: the logits' (the mass estimate's softmax needs it)."""
    hq, hkv = q.shape[0], keys.shape[0]
    if rule.score == "mass":
        return mass_scores(rule, q, keys, scale)
    if rule.score == "oracle":
        nb = -(-keys.shape[1] // rule.block)
        pad = nb * rule.block - keys.shape[1]
        return torch.nn.functional.pad(probs, (0, pad)).view(hq, q.shape[1], nb, rule.block).sum(-1)
    sub = rule.summary or rule.block
    lo, hi = block_summaries(keys, sub)
    lo, hi = lo.repeat_interleave(hq // hkv, 0), hi.repeat_interleave(hq // hkv, 0)
    # sum_d max(q*lo, q*hi) = relu(q).hi + min(q, 0).lo, as lo <= hi
    bounds = q.clamp(min=0) @ hi.transpose(1, 2) + q.clamp(max=0) @ lo.transpose(1, 2)  # [Hq, Sq, sub-blocks]
    per_block = rule.block // sub
    if per_block == 1:
        return bounds
    nb = -(-bounds.shape[-1] // per_block)
    bounds = torch.nn.functional.pad(bounds, (0, nb * per_block - bounds.shape[-1]), value=float("-inf"))
    return bounds.view(*bounds.shape[:-1], nb, per_block).amax(-1)


def mass_scores(rule: Rule, q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The engine's mass score (kernels/block_mass.py) per query head: estimated logits q.centre +
    RADIUS_WEIGHT |q|.radius through a softmax over each row's blocks but its tail. [Hq, Sq, NB]. With
    sub-block summaries the softmax runs over sub-blocks (but the tail block's) and each block sums its own."""
    from oasiskv.kernels.block_mass import RADIUS_WEIGHT

    group, sq, sub = q.shape[0] // keys.shape[0], q.shape[1], rule.summary or rule.block
    lo, hi = (x.repeat_interleave(group, 0) for x in block_summaries(keys, sub))
    centre, radius = (lo + hi) / 2, (hi - lo) / 2 * RADIUS_WEIGHT
    logits = (q @ centre.transpose(1, 2) + q.abs() @ radius.transpose(1, 2)) * scale  # [Hq, Sq, sub-blocks]
    blocks_seen = -(-(torch.arange(sq, device=q.device) + keys.shape[1] - sq + 1) // rule.block)
    per_block = rule.block // sub
    tail_start = (blocks_seen - 1) * per_block  # the first sub-block of each row's tail block
    normalised = torch.arange(logits.shape[-1], device=q.device)[None] < tail_start[:, None]
    lse = logits.masked_fill(~normalised[None], float("-inf")).logsumexp(-1, keepdim=True)
    mass = torch.where(lse > float("-inf"), (logits - lse).exp(), torch.zeros_like(logits))
    if per_block == 1:
        return mass
    nb = -(-mass.shape[-1] // per_block)
    mass = torch.nn.functional.pad(mass, (0, nb * per_block - mass.shape[-1]))
    return mass.view(*mass.shape[:-1], nb, per_block).sum(-1)


def combine_kv_heads(rule: Rule, scores: torch.Tensor) -> torch.Tensor:
    """[Hkv, Sq, NB] -> the layer's one selection's scores [1, Sq, NB]."""
    return scores.amax(0, keepdim=True) if rule.combine == "max" else scores.sum(0, keepdim=True)


def selected_keys(rule: Rule, scores: torch.Tensor, num_keys: int, first_pos: int) -> torch.Tensor:
    """scores [X, Sq, NB] (X = 1, or KV heads) -> bool [X, Sq, num_keys]: the keys each row attends to.
    Row i sits at position first_pos + i and sees keys 0 .. first_pos + i."""
    x, sq, nb = scores.shape
    dev = scores.device
    seen = torch.arange(sq, device=dev) + first_pos + 1  # keys each row sees
    blocks_seen = -(-seen // rule.block)
    j = torch.arange(nb, device=dev)
    sink = -(-SINK_TOKENS // rule.block)
    local = -(-LOCAL_TOKENS // rule.block)
    forced = (j[None] < sink) | (j[None] >= blocks_seen[:, None] - local)
    rank = scores.masked_fill(forced, float("inf")).masked_fill(j[None] >= blocks_seen[:, None], float("-inf"))
    budget_blocks = rule.budget // rule.block
    if rule.pooled:  # one ranking over every head's blocks, budget_blocks a head in all
        pairs = rank.transpose(0, 1).reshape(sq, x * nb)
        top = pairs.topk(min(budget_blocks * x, x * nb), dim=-1).indices
        chosen = torch.zeros(sq, x * nb, dtype=torch.bool, device=dev).scatter_(-1, top, True)
        chosen = chosen.view(sq, x, nb).transpose(0, 1).contiguous()
    else:
        top = rank.topk(min(budget_blocks, nb), dim=-1).indices
        chosen = torch.zeros(x, sq, nb, dtype=torch.bool, device=dev).scatter_(-1, top, True)
    chosen &= j[None, None] < blocks_seen[None, :, None]
    keys = chosen.repeat_interleave(rule.block, -1)[..., :num_keys]
    return keys & (torch.arange(num_keys, device=dev)[None, None] < seen[None, :, None])


def twin_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: query [1, Hq, Sq, D], key/value [1, Hkv, S, D] (cache included)."""
    hq, sq, s = query.shape[1], query.shape[2], key.shape[2]
    group = hq // key.shape[1]
    if sq == s:  # the prefix: dense and causal
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    q, k, v = query[0].float(), key[0].float(), value[0].float()
    logits = (q @ k.repeat_interleave(group, 0).transpose(1, 2)) * scaling  # [Hq, Sq, S]
    pos = torch.arange(s, device=query.device)
    causal = pos[None] <= pos[s - sq:, None]
    logits = logits.masked_fill(~causal, float("-inf"))
    rule = active and active.at_layer(getattr(module, "layer_idx", None))
    if rule is not None:
        scores = selection_scores(rule, head_scores(rule, q, k, logits.softmax(-1), scaling), group)
        if rule.shortlist:
            scores = shortlist_scores(rule, scores, list_logits(rule, logits, q, k, scaling, group), group)
        keep = selected_keys(rule, scores, s, s - sq)
        if rule.per_kv_head:
            keep = keep.repeat_interleave(group, 0)
        if rule.rest:
            return rest_estimated(rule, logits, keep, q, k, v, scaling, group).to(query.dtype).transpose(0, 1)[
                None].contiguous(), None
        logits = logits.masked_fill(~keep, float("-inf"))
    out = logits.softmax(-1) @ v.repeat_interleave(group, 0)
    return out.to(query.dtype).transpose(0, 1)[None].contiguous(), None


def selection_scores(rule: Rule, scores: torch.Tensor, group: int) -> torch.Tensor:
    """Per query head [Hq, Sq, NB] -> the selection's: the best head of each KV group, summed (or their max)
    over the KV groups unless per KV head."""
    scores = scores.view(-1, group, *scores.shape[1:]).amax(1)
    return scores if rule.per_kv_head else combine_kv_heads(rule, scores)


def shortlist_scores(rule: Rule, scores: torch.Tensor, logits: torch.Tensor, group: int) -> torch.Tensor:
    """The second pass: the keys of the best `shortlist` x budget tokens' blocks by `scores`, then each such block's
    exact attention mass in a softmax over those keys alone (what a kernel reading only the shortlist computes);
    blocks off the list rank last. logits [Hq, Sq, S] (causal, -inf beyond)."""
    hq, sq, s = logits.shape
    wide = dataclasses.replace(rule, budget=int(rule.shortlist * rule.budget) // rule.block * rule.block, shortlist=0)
    listed = selected_keys(wide, scores, s, s - sq)
    if rule.per_kv_head:
        listed = listed.repeat_interleave(group, 0)
    probs = logits.masked_fill(~listed, float("-inf")).softmax(-1)
    nb = scores.shape[-1]
    pad = nb * rule.block - s
    exact = torch.nn.functional.pad(probs, (0, pad)).view(hq, sq, nb, rule.block).sum(-1)
    on_list = torch.nn.functional.pad(listed, (0, pad)).view(listed.shape[0], sq, nb, rule.block).any(-1)
    on_list = on_list.view(-1, group, sq, nb).any(1) if rule.per_kv_head else on_list.any(0, keepdim=True)
    return selection_scores(rule, exact, group).masked_fill(~on_list, float("-inf"))


def list_logits(rule: Rule, logits: torch.Tensor, q: torch.Tensor, k: torch.Tensor, scale: float,
                group: int) -> torch.Tensor:
    """The logits the second pass sees: `logits` as they are, or q against keys rounded to float8 e4m3 with one
    scale per block and KV head ("fp8") or per token and KV head ("fp8-token"): the largest |k| it covers maps to
    e4m3's largest value, 448."""
    if rule.list_keys == "exact":
        return logits
    hkv, s, d = k.shape
    nb = -(-s // rule.block)
    blocks = torch.nn.functional.pad(k, (0, 0, 0, nb * rule.block - s)).view(hkv, nb, rule.block, d)
    over = (2, 3) if rule.list_keys == "fp8" else (3,)
    scales = blocks.abs().amax(over, keepdim=True).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    rounded = ((blocks / scales).to(torch.float8_e4m3fn).float() * scales).view(hkv, nb * rule.block, d)[:, :s]
    approx = (q @ rounded.repeat_interleave(group, 0).transpose(1, 2)) * scale
    return approx.masked_fill(logits == float("-inf"), float("-inf"))


def rest_estimated(rule: Rule, logits, keep, q, k, v, scale: float, group: int) -> torch.Tensor:
    """Attention [Hq, Sq, D] to the selected keys exactly and to every other whole block the row sees as one key:
    the block's mean key and mean value, its logit raised by log(tokens) (the block stands for them all).
    logits [Hq, Sq, S] (causal, -inf beyond); keep bool [Hq or 1, Sq, S]."""
    hq, sq, s = logits.shape
    nb = s // rule.block  # whole blocks only: a row's partial tail is in its local window, always selected
    mean_k = k[:, :nb * rule.block].view(k.shape[0], nb, rule.block, -1).mean(2).repeat_interleave(group, 0)
    mean_v = v[:, :nb * rule.block].view(v.shape[0], nb, rule.block, -1).mean(2).repeat_interleave(group, 0)
    blocks_kept = keep[..., :nb * rule.block].view(keep.shape[0], sq, nb, rule.block).any(-1)
    first_row = s - sq
    visible = (torch.arange(nb, device=q.device)[None] + 1) * rule.block <= (
        torch.arange(sq, device=q.device) + first_row + 1)[:, None]  # [Sq, NB]: the row sees the whole block
    estimated = (q @ mean_k.transpose(1, 2)) * scale + math.log(rule.block)
    estimated = estimated.masked_fill(blocks_kept | ~visible[None], float("-inf"))
    joint = torch.cat([logits.masked_fill(~keep, float("-inf")), estimated], -1).softmax(-1)
    return joint[..., :s] @ v.repeat_interleave(group, 0) + joint[..., s:] @ mean_v


def register() -> str:
    """Makes twin_attention known to transformers; returns the name models select it by."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, twin_attention)
    return ATTENTION_NAME


def load_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    register()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype,
                                                 attn_implementation=ATTENTION_NAME)
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


@torch.inference_mode()
def scored_rows(model, window: list[int], scored: int, rules: list[Rule | None]) -> list[torch.Tensor]:
    """Per rule: log-prob rows [scored, vocab] predicting the window's last `scored` tokens."""
    global active
    from transformers import DynamicCache

    prefix_len = len(window) - scored - 1
    ids = torch.tensor([window], device=model.device)
    cache = DynamicCache(config=model.config)
    active = None
    model(ids[:, :prefix_len], past_key_values=cache, use_cache=True, logits_to_keep=1)
    out = []
    try:
        for rule in rules:
            active = rule
            # a copy per rule: the scored pass appends to it (crop() changed meaning across transformers 5.x)
            logits = model(ids[:, prefix_len:-1], past_key_values=copy.deepcopy(cache), use_cache=True).logits[0]
            out.append(torch.log_softmax(logits.float(), -1).cpu())
    finally:
        active = None
    return out


def agreement(name: str, rows: list[torch.Tensor], ref: list[torch.Tensor], tie_nats: float) -> dict:
    """rows, ref: per window [scored, vocab] log-probs. Top-1 agreement, split at dense's near-ties; KL."""
    same = ties = same_at_ties = 0
    flips, kls = [], []
    for mine, theirs in zip(rows, ref):
        gaps = dense_gaps(list(theirs))
        kls += (theirs.exp() * (theirs - mine)).sum(-1).tolist()
        for pos, (a, b, gap) in enumerate(zip(mine.argmax(-1).tolist(), theirs.argmax(-1).tolist(), gaps)):
            tie = gap < tie_nats
            ties += tie
            same += a == b
            same_at_ties += tie and a == b
            if a != b:
                flips.append({"position": pos, "dense_gap_to_runner_up": round(gap, 4),
                              "dense_gap_to_this_token": round(float(theirs[pos, b] - theirs[pos, a]), 4)})
    n = sum(len(r) for r in rows)
    return {"variant": name, "positions": n, "top1_agree": round(100 * same / n, 2), "kl": round(sum(kls) / n, 5),
            "near_tie_positions": ties, "agree_at_near_ties": round(100 * same_at_ties / ties, 2) if ties else None,
            "agree_at_clear": round(100 * (same - same_at_ties) / (n - ties), 2) if n > ties else None,
            "flips": len(flips), "flips_at_near_ties": sum(f["dense_gap_to_runner_up"] < tie_nats for f in flips),
            "flip_list": flips}


def parse_rules(args) -> list[Rule]:
    rules = []
    for score in args.scores.split(","):
        if score not in ("bound", "mass", "oracle"):
            raise SystemExit(f"error: --scores takes bound, mass and oracle, not {score!r}")
        for block in (int(b) for b in args.block_sizes.split(",")):
            if block < 1 or args.budget % block:
                raise SystemExit(f"error: block size {block} must divide --budget {args.budget}")
            if -(-SINK_TOKENS // block) + -(-LOCAL_TOKENS // block) > args.budget // block:
                raise SystemExit(f"error: sink and local window exceed the budget at block size {block}")
            for sub in [None, *sub_summaries(args, score, block)]:
                for rest in (r == "mean" for r in choices("--rest", args.rest, ("none", "mean"))):
                    for combine in choices("--combine", args.combine, ("sum", "max")):
                        rules.append(Rule(score, block, False, args.budget, sub, combine, rest))
                    if args.per_kv_head:
                        rules.append(Rule(score, block, True, args.budget, sub, rest=rest))
                    if getattr(args, "pool_kv_heads", False) and score != "bound":
                        rules.append(Rule(score, block, True, args.budget, sub, rest=rest, pooled=True))
    return rules


def choices(option: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    """A comma-separated option's values, each one of `allowed`."""
    picked = value.split(",")
    if not set(picked) <= set(allowed):
        raise SystemExit(f"error: {option} takes {' and '.join(allowed)}, not {value!r}")
    return picked


def with_layer_variants(rules: list[Rule], args, num_layers: int) -> list[Rule]:
    """rules, then each again with every --shortlist, then all of those with one layer dense per layer
    (--ablate-layers), then each again with every --layer-budgets split."""
    rules = rules + [dataclasses.replace(r, shortlist=f, list_keys=keys) for r in rules if r.score != "oracle"
                     for f in shortlists(args)
                     for keys in choices("--list-keys", args.list_keys, ("exact", "fp8", "fp8-token"))]
    base = list(rules)
    if args.ablate_layers:
        rules = rules + [dataclasses.replace(r, dense_layer=layer) for r in base for layer in range(num_layers)]
    return rules + [dataclasses.replace(r, budget=others, layer_budgets=pairs) for r in base
                    for pairs, others in parse_layer_budgets(args.layer_budgets, num_layers)]


def add_layer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rest", default="none", help="none (attend to the selection only) and/or mean (also the blocks "
                   "left out, each estimated by its mean key and value), e.g. none,mean")
    p.add_argument("--shortlist", default="", help="also each bound and mass rule with a second pass: its score keeps "
                   "this many times the budget, the exact attention mass over those keys picks the budget, e.g. 1.5,2")
    p.add_argument("--list-keys", default="exact", help="with --shortlist: the keys the second pass reads, exact, "
                   "fp8 (e4m3, one scale per block and KV head) and/or fp8-token (a scale per token), e.g. exact,fp8")
    p.add_argument("--ablate-layers", action="store_true", help="also each rule with one layer dense, for every layer: "
                   "how much each layer's selection costs")
    p.add_argument("--layer-budgets", nargs="*", default=[], metavar="L=N[,L=N...]:OTHERS",
                   help="also each rule with these layers at their own budgets and every other layer at OTHERS, e.g. "
                   "7=8192:1824 (the same tokens in all as 2048 each over 30 layers, give or take a block)")


def shortlists(args) -> list[float]:
    factors = [float(f) for f in args.shortlist.split(",")] if args.shortlist else []
    if any(f < 1 for f in factors):
        raise SystemExit(f"error: --shortlist takes factors of the budget of at least 1, not {args.shortlist!r}")
    return factors


def sub_summaries(args, score: str, block: int) -> list[int]:
    """--summary-tokens that apply to this rule: the bound's and mass's, divisors of the block below its size."""
    subs = [int(t) for t in args.summary_tokens.split(",")] if args.summary_tokens else []
    if any(t < 1 for t in subs):
        raise SystemExit("error: --summary-tokens must be positive")
    return [t for t in subs if score in ("bound", "mass") and t < block and block % t == 0]


def windows_for(path: str, args) -> list[list[int]]:
    """The same windows as `oasiskv eval --tasks ppl` and scripts/top1_flips.py draw (seeded per window)."""
    from oasiskv.evals.haystack import Haystack
    from oasiskv.evals.tasks import Perplexity, Settings
    from oasiskv.evals.texts import load_corpus
    from oasiskv.models.tokenizer import HFTokenizer

    hay = Haystack(load_corpus(args.corpus), HFTokenizer.from_gguf(path))
    return Perplexity().prepare(hay, args.context, Settings(windows=args.windows, scored=args.scored))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF; default: the engine's (SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--scored", type=int, default=64)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--block-sizes", default="4,8,16,32")
    p.add_argument("--scores", default="bound,oracle", help="any of bound, mass, oracle")
    p.add_argument("--summary-tokens", default="", help="also bound and mass rules whose blocks keep min/max "
                   "summaries of this many tokens each (divisors of the block size), e.g. 8 or 4,8")
    p.add_argument("--per-kv-head", action=argparse.BooleanOptionalAction, default=True,
                   help="also one selection per KV head (default: yes)")
    p.add_argument("--pool-kv-heads", action="store_true", help="also each oracle and mass rule per KV head with "
                   "the layer's budget pooled over its KV heads (each keeps sink and local window; Quest's bounds do "
                   "not compare across heads, so bound rules are not pooled)")
    p.add_argument("--combine", default="sum", help="per-layer selections: sum (the engine's) and/or max of the KV "
                   "heads' scores, e.g. sum,max")
    add_layer_arguments(p)
    p.add_argument("--corpus", default="austen")
    p.add_argument("--tie-nats", type=float, default=math.log(2))
    p.add_argument("--json", default=None)
    p.add_argument("--join", nargs="+", default=None, metavar="RUN.json",
                   help="print (and --plot) runs made at several budgets instead of running")
    p.add_argument("--plot", default=None, help="with --join: top-1 agreement against budget, as a PNG")
    args = p.parse_args()
    if args.join:
        table = join_runs(args.join)
        print_sweep(table)
        if args.plot:
            plot_sweep(table, args.plot)
        return
    from oasiskv.models.loader import embedded_default_path

    path = args.model or embedded_default_path()
    rules = parse_rules(args)
    model = load_model(path, getattr(torch, args.dtype))
    rules = with_layer_variants(rules, args, model.config.num_hidden_layers)
    windows = windows_for(path, args)
    t0 = time.perf_counter()
    per_rule: list[list[torch.Tensor]] = [[] for _ in range(len(rules) + 1)]
    for w in tqdm(windows, desc="windows"):
        for i, rows in enumerate(scored_rows(model, w, args.scored, [None, *rules])):
            per_rule[i].append(rows)
    ref = per_rule[0]
    results = [agreement(r.label, rows, ref, args.tie_nats) for r, rows in zip(rules, per_rule[1:])]
    ties = results[0]["near_tie_positions"] if results else 0
    print(f"\n{len(windows)} windows x {args.scored} positions, {ties} near-ties, budget {args.budget}, "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"{'rule':34} {'top-1 agree':>11} {'KL':>8} {'near-tie agree':>14} {'clear agree':>11} {'flips':>5}")
    for r in results:
        print(f"{r['variant']:34} {r['top1_agree']:>11} {r['kl']:>8} {str(r['agree_at_near_ties']):>14} "
              f"{str(r['agree_at_clear']):>11} {r['flips']:>5}")
    for rule, kl in zip(rules, (r["kl"] for r in results)):
        if args.ablate_layers and rule.dense_layer is None and not rule.layer_budgets:
            cuts = {r.dense_layer: kl - x["kl"] for r, x in zip(rules, results)
                    if r.dense_layer is not None and dataclasses.replace(r, dense_layer=None) == rule}
            print(f"{rule.label}: {suggested_weights(cuts, kl)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
