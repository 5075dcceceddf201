"""scripts/selection_twin.py: its selection against the engine's Quest kernel reference and a brute force, its
scored pass against one decode step per row, and dense's rows whenever the budget covers the context."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from oasiskv.kernels.block_select import block_scores_reference
from oasiskv.kernels.selection_rule import select_blocks_padded
from scripts import selection_twin as twin


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation(twin.register())
    return model


def twin_keep(rule, q, k, first_pos, scale=1.0):
    """The twin's key mask for rows q [Hq, Sq, D] at positions first_pos.. over keys k [Hkv, S, D]."""
    group = q.shape[0] // k.shape[0]
    logits = q @ k.repeat_interleave(group, 0).transpose(1, 2)
    causal = torch.arange(k.shape[1])[None] <= (torch.arange(q.shape[1]) + first_pos)[:, None]
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    scores = twin.head_scores(rule, q, k, probs, scale).view(k.shape[0], group, q.shape[1], -1).amax(1)
    if not rule.per_kv_head:
        scores = twin.combine_kv_heads(rule, scores)
    return twin.selected_keys(rule, scores, k.shape[1], first_pos), probs


def engine_keep(scores: torch.Tensor, n: int, s: int, seen: int) -> torch.Tensor:
    """The keys the engine's selection (8 blocks of 16: 1 sink, 4 local, 3 by score) keeps from one row's scores."""
    _, chosen = select_blocks_padded(scores, torch.tensor([n]), 8, 1, 4)
    expect = torch.zeros(s, dtype=torch.bool)
    for b in chosen[0].tolist():
        expect[b * 16:(b + 1) * 16] = True
    expect[seen:] = False
    return expect


def test_bound_selection_equals_the_engines_quest_kernel_reference():
    torch.manual_seed(1)
    hq, hkv, d, s, sq = 4, 2, 8, 300, 5
    q, k = torch.randn(hq, sq, d), torch.randn(hkv, s, d)
    rule = twin.Rule("bound", 16, False, 128)  # 8 blocks: 1 sink, 4 local, 3 by score
    keep, _ = twin_keep(rule, q, k, s - sq)
    for i in range(sq):
        seen = s - sq + i + 1
        n = -(-seen // 16)
        summaries = torch.stack(twin.block_summaries(k[:, :seen], 16), 0).permute(2, 0, 1, 3)  # [n, 2, Hkv, D]
        scores = block_scores_reference(q[:, i][None], summaries, torch.arange(n, dtype=torch.int32)[None],
                                        torch.tensor([n], dtype=torch.int32))
        expect = engine_keep(scores, n, s, seen)
        assert torch.equal(keep[0, i], expect)


def test_mass_selection_equals_the_engines_mass_reference():
    from oasiskv.kernels.block_mass import block_mass_scores_multi_reference

    torch.manual_seed(7)
    hq, hkv, d, s, sq, scale = 4, 2, 8, 300, 5, 0.35
    q, k = torch.randn(hq, sq, d) * 2, torch.randn(hkv, s, d)
    rule = twin.Rule("mass", 16, False, 128)
    keep, _ = twin_keep(rule, q, k, s - sq, scale)
    changed = False
    for i in range(sq):
        seen = s - sq + i + 1
        n = -(-seen // 16)
        summaries = torch.stack(twin.block_summaries(k[:, :seen], 16), 0).permute(2, 0, 1, 3)  # [n, 2, Hkv, D]
        scores = block_mass_scores_multi_reference(q[:, i][None, None], summaries,
                                                   torch.arange(n, dtype=torch.int32)[None],
                                                   torch.tensor([[n]], dtype=torch.int32), scale)[0]
        expect = engine_keep(scores, n, s, seen)
        assert torch.equal(keep[0, i], expect)
        bound_keep, _ = twin_keep(twin.Rule("bound", 16, False, 128), q, k, s - sq)
        changed |= not torch.equal(bound_keep[0, i], expect)
    assert changed  # the mass rule is not the bound's under another name


@pytest.mark.parametrize("per_kv_head,combine", [(False, "sum"), (False, "max"), (True, "sum")])
def test_oracle_selection_keeps_the_blocks_of_most_attention_mass(per_kv_head, combine):
    torch.manual_seed(2)
    hq, hkv, d, s, sq, block = 4, 2, 8, 300, 3, 8
    q, k = torch.randn(hq, sq, d) * 2, torch.randn(hkv, s, d)
    rule = twin.Rule("oracle", block, per_kv_head, 128, combine=combine)  # 16 blocks: 2 sink, 8 local, 6 by mass
    keep, probs = twin_keep(rule, q, k, s - sq)
    for i in range(sq):
        n = -(-(s - sq + i + 1) // block)
        forced = {0, 1} | set(range(n - 8, n))

        def mass(h, b):
            return float(probs[h, i, b * block:(b + 1) * block].sum())

        def best_of_group(g, b):
            return max(mass(2 * g, b), mass(2 * g + 1, b))

        for x in range(hkv if per_kv_head else 1):
            over_groups = max if combine == "max" else sum
            score = {b: best_of_group(x, b) if per_kv_head else over_groups(best_of_group(g, b) for g in range(hkv))
                     for b in range(n)}
            free = sorted((b for b in range(n) if b not in forced), key=lambda b: -score[b])
            got = {j // block for j in keep[x, i].nonzero().flatten().tolist()}
            assert got == forced | set(free[:16 - len(forced)])


def test_the_rule_needs_room_for_sink_and_local_window():
    with pytest.raises(SystemExit, match="exceed the budget"):
        twin.parse_rules(type("A", (), {"scores": "bound", "block_sizes": "4", "budget": 64, "per_kv_head": False,
                                           "summary_tokens": "", "combine": "sum", "rest": "none"}))
    with pytest.raises(SystemExit, match="must divide"):
        twin.parse_rules(type("A", (), {"scores": "bound", "block_sizes": "48", "budget": 64, "per_kv_head": False,
                                           "summary_tokens": "", "combine": "sum", "rest": "none"}))


def test_sub_block_summaries_give_a_tighter_bound_that_still_holds():
    torch.manual_seed(6)
    q, k = torch.randn(4, 3, 8), torch.randn(2, 64, 8)
    probs = torch.zeros(4, 3, 64)
    whole = twin.head_scores(twin.Rule("bound", 16, False, 64), q, k, probs)
    halves = twin.head_scores(twin.Rule("bound", 16, False, 64, summary=8), q, k, probs)
    exact = (q @ k.repeat_interleave(2, 0).transpose(1, 2)).view(4, 3, 4, 16).amax(-1)  # max q.k in each block
    assert (exact <= halves + 1e-5).all() and (halves <= whole + 1e-5).all() and (halves < whole - 1e-3).any()
    per_half = twin.head_scores(twin.Rule("bound", 8, False, 64), q, k, probs).view(4, 3, 4, 2).amax(-1)
    torch.testing.assert_close(halves, per_half)
    args = type("A", (), {"scores": "bound,oracle", "block_sizes": "16", "budget": 128, "per_kv_head": False,
                          "summary_tokens": "8,5", "combine": "sum", "rest": "none"})
    assert [r.label for r in twin.parse_rules(args)] == [
        "bound block 16", "bound block 16 (8-token summaries)", "oracle block 16"]


@pytest.mark.parametrize("score,per_kv_head", [("bound", False), ("oracle", True)])
def test_one_forward_of_the_scored_rows_equals_one_decode_step_per_row(tiny_llama, score, per_kv_head):
    from transformers import DynamicCache

    torch.manual_seed(3)
    window = torch.randint(0, 97, (220,)).tolist()
    rule = twin.Rule(score, 8, per_kv_head, 96)
    batched = twin.scored_rows(tiny_llama, window, 12, [rule])[0]
    prefix = len(window) - 13
    cache = DynamicCache(config=tiny_llama.config)
    rows = []
    with torch.inference_mode():
        tiny_llama(torch.tensor([window[:prefix]]), past_key_values=cache, use_cache=True)
        twin.active = rule
        try:
            for t in range(prefix, len(window) - 1):
                logits = tiny_llama(torch.tensor([[window[t]]]), past_key_values=cache, use_cache=True).logits[0]
                rows.append(torch.log_softmax(logits.float(), -1)[0])
        finally:
            twin.active = None
    torch.testing.assert_close(batched, torch.stack(rows), rtol=1e-4, atol=1e-5)


def test_a_budget_over_the_context_gives_denses_rows(tiny_llama):
    torch.manual_seed(4)
    window = torch.randint(0, 97, (150,)).tolist()
    rules = [twin.Rule("bound", 8, False, 160), twin.Rule("oracle", 16, True, 160)]
    dense, *sparse = twin.scored_rows(tiny_llama, window, 10, [None, *rules])
    for rows in sparse:
        assert torch.equal(rows, dense)
    r = twin.agreement("x", [sparse[0]], [dense], tie_nats=0.69)
    assert (r["top1_agree"], r["flips"], r["kl"]) == (100.0, 0, 0.0)


def test_a_small_budget_changes_the_rows(tiny_llama):
    """The sparse pass really drops keys: a budget of the sink and local window alone moves the rows."""
    torch.manual_seed(5)
    window = torch.randint(0, 97, (400,)).tolist()
    dense, sparse = twin.scored_rows(tiny_llama, window, 8, [None, twin.Rule("bound", 16, False, 80)])
    assert (dense - sparse).abs().max() > 1e-4


def test_mass_with_sub_block_summaries_sums_each_blocks_share():
    """Brute force for each row and head: every 4-token sub-block's estimate (centre and half the radius), a
    softmax over the sub-blocks before the row's tail block, and each 16-token block's sum of its shares."""
    from oasiskv.kernels.block_mass import RADIUS_WEIGHT

    torch.manual_seed(8)
    q, k, scale, s = torch.randn(4, 3, 8), torch.randn(2, 100, 8), 0.4, 100
    got = twin.head_scores(twin.Rule("mass", 16, False, 64, summary=4), q, k, torch.zeros(4, 3, s), scale)
    for h in range(4):
        for i in range(3):
            tail = (s - 3 + i) // 16  # the row at position s - 3 + i sits in this block
            estimates = []
            for sb in range(tail * 4):
                keys = k[h // 2, sb * 4:sb * 4 + 4]
                lo, hi = keys.amin(0), keys.amax(0)
                estimates.append(float(q[h, i] @ ((lo + hi) / 2) + q[h, i].abs() @ ((hi - lo) / 2) * RADIUS_WEIGHT))
            shares = torch.tensor(estimates).mul(scale).softmax(0).view(tail, 4).sum(-1)
            torch.testing.assert_close(got[h, i, :tail], shares, rtol=1e-5, atol=1e-6)
    args = type("A", (), {"scores": "mass", "block_sizes": "16", "budget": 128, "per_kv_head": False,
                          "summary_tokens": "4", "combine": "sum", "rest": "none"})
    assert [r.label for r in twin.parse_rules(args)] == ["mass block 16", "mass block 16 (4-token summaries)"]
    args.combine, args.per_kv_head = "sum,max", True
    assert [r.label for r in twin.parse_rules(args)] == [
        "mass block 16", "mass block 16 max over KV heads", "mass block 16 per KV head",
        "mass block 16 (4-token summaries)", "mass block 16 (4-token summaries) max over KV heads",
        "mass block 16 (4-token summaries) per KV head"]
    args.combine, args.per_kv_head, args.summary_tokens, args.rest = "sum", False, "", "none,mean"
    assert [r.label for r in twin.parse_rules(args)] == ["mass block 16", "mass block 16 + rest"]


def rest_case(seed: int, block: int, keys_per_block: bool):
    """Rows at the last 5 of 160 positions, a selection of sink, local window and one more block (6 of 10), and
    dense's output."""
    torch.manual_seed(seed)
    hq, hkv, d, s, sq, scale = 4, 2, 8, 160, 5, 0.5
    q, v = torch.randn(hq, sq, d), torch.randn(hkv, s, d)
    k = torch.randn(hkv, s // block, d).repeat_interleave(block, 1) if keys_per_block else torch.randn(hkv, s, d)
    rule = twin.Rule("bound", block, False, 96, rest=True)
    keep, _ = twin_keep(twin.Rule("bound", 16, False, 96), q, k, s - sq)
    logits = (q @ k.repeat_interleave(2, 0).transpose(1, 2)) * scale
    causal = torch.arange(s)[None] <= torch.arange(s - sq, s)[:, None]
    logits = logits.masked_fill(~causal, float("-inf"))
    dense = logits.softmax(-1) @ v.repeat_interleave(2, 0)
    return rule, logits, keep, q, k, v, scale, dense


@pytest.mark.parametrize("block", [1, 16])
def test_rest_estimate_is_exact_where_each_block_holds_one_key(block):
    """A block of one token, or of 16 equal keys (values differing), is its mean key and value exactly: the selection
    plus the estimated rest is dense attention."""
    rule, logits, keep, q, k, v, scale, dense = rest_case(9, block, keys_per_block=block > 1)
    assert not (keep | ~torch.isfinite(logits)).all()  # keys are left out
    got = twin.rest_estimated(rule, logits, keep, q, k, v, scale, 2)
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-6)


def test_rest_estimate_differs_from_dense_with_distinct_keys_and_from_the_selection_alone():
    rule, logits, keep, q, k, v, scale, dense = rest_case(10, 16, keys_per_block=False)
    got = twin.rest_estimated(rule, logits, keep, q, k, v, scale, 2)
    selection_only = logits.masked_fill(~keep, float("-inf")).softmax(-1) @ v.repeat_interleave(2, 0)
    assert (got - dense).abs().max() > 1e-3 and (got - selection_only).abs().max() > 1e-3


@pytest.mark.parametrize("layer", [0, 1])
def test_a_dense_layer_attends_to_every_key_and_the_other_layer_still_selects(tiny_llama, layer):
    """--ablate-layers: with one layer dense, that layer's output is dense's, the other's is the sparse rule's."""
    from transformers import DynamicCache

    torch.manual_seed(6)
    ids = torch.randint(0, 97, (1, 400))
    prefix = 380
    rule = twin.Rule("bound", 16, False, 80)
    outputs = {}
    for name, active in [("dense", None), ("sparse", rule),
                         ("one dense", dataclasses.replace(rule, dense_layer=layer))]:
        captured = {}
        hooks = [att.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out[0]))
                 for i, att in enumerate(module.self_attn for module in tiny_llama.model.layers)]
        cache = DynamicCache(config=tiny_llama.config)
        with torch.inference_mode():
            tiny_llama(ids[:, :prefix], past_key_values=cache, use_cache=True)
            twin.active = active
            try:
                tiny_llama(ids[:, prefix:], past_key_values=cache, use_cache=True)
            finally:
                twin.active = None
                for h in hooks:
                    h.remove()
        outputs[name] = captured
    other = 1 - layer
    if layer == 0:  # below layer 1 the runs differ, so only layer 0's output can equal dense's
        torch.testing.assert_close(outputs["one dense"][0], outputs["dense"][0])
    assert not torch.allclose(outputs["sparse"][layer], outputs["one dense"][layer])
    assert not torch.allclose(outputs["one dense"][other], outputs["dense"][other])


def test_a_layer_budget_over_the_context_is_that_layer_dense(tiny_llama):
    """--layer-budgets: layer 1 at a budget above the window attends to every key, as --ablate-layers' dense layer
    does, while layer 0 keeps the rule's budget; a small budget for layer 1 changes the rows."""
    torch.manual_seed(7)
    window = torch.randint(0, 97, (400,)).tolist()
    rule = twin.Rule("bound", 16, False, 80)
    variants = [dataclasses.replace(rule, dense_layer=1), dataclasses.replace(rule, layer_budgets=((1, 512),)),
                dataclasses.replace(rule, layer_budgets=((1, 96),))]
    sparse, one_dense, wide, narrow = twin.scored_rows(tiny_llama, window, 8, [rule, *variants])
    assert torch.equal(one_dense, wide)
    assert not torch.allclose(wide, sparse) and not torch.allclose(narrow, sparse)


def test_layer_budgets_parse_and_label():
    assert twin.parse_layer_budgets(["7=4096,18=4096:1632", "3=64:32"], 30) == [
        (((7, 4096), (18, 4096)), 1632), (((3, 64),), 32)]
    rule = twin.Rule("mass", 16, False, 1632, layer_budgets=((7, 4096),))
    assert rule.label == "mass block 16 + layer 7 at 4096, others at 1632"
    assert rule.at_layer(7).budget == 4096 and rule.at_layer(3) is rule
    with pytest.raises(SystemExit, match="outside 0..29"):
        twin.parse_layer_budgets(["30=4096:1632"], 30)
    with pytest.raises(SystemExit, match="LAYER=BUDGET"):
        twin.parse_layer_budgets(["7:4096"], 30)


def test_the_ablation_suggests_weights_for_the_layers_that_cut_the_kl_most():
    cuts = {0: 0.0001, 7: 0.0018, 18: 0.0009, 20: 0.00052, 3: 0.00017}
    text = twin.suggested_weights(cuts, kl=0.005)
    assert text.endswith("--layer-weights 7=2.5,18=2.5,20=2.5")  # 36%, 18%, 10%; layer 3's 3.4% and layer 0 left out
    assert "7 (36%), 18 (18%), 20 (10%)" in text
    assert "one budget in every layer" in twin.suggested_weights({1: 0.0001}, kl=0.005)


def shortlist_keep(rule, q, k, first_pos):
    """The twin's key mask with its second pass (rule.shortlist), rows q [Hq, Sq, D] over keys k [Hkv, S, D]."""
    group = q.shape[0] // k.shape[0]
    logits = q @ k.repeat_interleave(group, 0).transpose(1, 2)
    causal = torch.arange(k.shape[1])[None] <= (torch.arange(q.shape[1]) + first_pos)[:, None]
    logits = logits.masked_fill(~causal, float("-inf"))
    scores = twin.selection_scores(rule, twin.head_scores(rule, q, k, logits.softmax(-1)), group)
    return twin.selected_keys(rule, twin.shortlist_scores(rule, scores, logits, group), k.shape[1], first_pos)


SHORTLIST_CASE = dict(hq=4, hkv=2, d=8, s=300, sq=3, block=8)  # 38 blocks; budget 128: 2 sink, 8 local, 6 chosen


def shortlist_inputs(seed=3):
    torch.manual_seed(seed)
    c = SHORTLIST_CASE
    return torch.randn(c["hq"], c["sq"], c["d"]) * 2, torch.randn(c["hkv"], c["s"], c["d"])


@pytest.mark.parametrize("score", ["bound", "mass"])
@pytest.mark.parametrize("per_kv_head", [False, True])
def test_a_shortlist_of_the_budget_itself_keeps_the_rules_keys(score, per_kv_head):
    q, k = shortlist_inputs()
    rule = twin.Rule(score, 8, per_kv_head, 128)
    first = k.shape[1] - q.shape[1]
    alone, _ = twin_keep(rule, q, k, first)
    assert torch.equal(shortlist_keep(dataclasses.replace(rule, shortlist=1), q, k, first), alone)


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_a_shortlist_of_every_block_keeps_the_oracles_keys(per_kv_head):
    q, k = shortlist_inputs()
    first = k.shape[1] - q.shape[1]
    oracle, _ = twin_keep(twin.Rule("oracle", 8, per_kv_head, 128), q, k, first)
    listed = twin.Rule("bound", 8, per_kv_head, 128, shortlist=3)  # 384 tokens: all 38 blocks
    assert torch.equal(shortlist_keep(listed, q, k, first), oracle)


def test_a_shortlist_ranks_its_blocks_by_the_mass_of_a_softmax_over_its_keys_alone():
    """Brute force, one selection per layer: the rule's best 24 blocks (sink and local window included), then the
    6 of them outside sink and window with the most mass, each KV group's best head, summed over the groups."""
    q, k = shortlist_inputs(seed=4)
    c, block = SHORTLIST_CASE, 8
    rule = twin.Rule("mass", block, False, 128, shortlist=1.5)  # 192 tokens: 24 blocks
    first = c["s"] - c["sq"]
    keep = shortlist_keep(rule, q, k, first)
    wide, _ = twin_keep(dataclasses.replace(rule, budget=192, shortlist=0), q, k, first)
    logits = q @ k.repeat_interleave(2, 0).transpose(1, 2)
    for i in range(c["sq"]):
        n = -(-(first + i + 1) // block)
        listed = wide[0, i].nonzero().flatten()
        assert len({j // block for j in listed.tolist()}) == 24
        probs = logits[:, i, listed].softmax(-1)  # [Hq, listed keys]
        blocks = listed // block
        mass = {b: sum(max(float(probs[2 * g + h, blocks == b].sum()) for h in (0, 1)) for g in (0, 1))
                for b in set(blocks.tolist())}
        forced = {0, 1} | set(range(n - 8, n))
        free = sorted((b for b in mass if b not in forced), key=lambda b: -mass[b])
        got = {j // block for j in keep[0, i].nonzero().flatten().tolist()}
        assert got == forced | set(free[:6])


def test_the_shortlist_flag_adds_a_second_pass_to_bound_and_mass_rules_only():
    rules = [twin.Rule("mass", 16, False, 2048), twin.Rule("oracle", 16, False, 2048)]
    args = argparse.Namespace(shortlist="2", list_keys="exact", ablate_layers=False, layer_budgets=[])
    out = twin.with_layer_variants(rules, args, 30)
    assert [r.label for r in out] == ["mass block 16", "oracle block 16", "mass block 16 + exact over 2x"]
    args.list_keys = "exact,fp8"
    assert [r.label for r in twin.with_layer_variants(rules, args, 30)][2:] == [
        "mass block 16 + exact over 2x", "mass block 16 + exact over 2x (fp8 keys)"]
    with pytest.raises(SystemExit, match="at least 1"):
        twin.with_layer_variants(rules, argparse.Namespace(shortlist="0.5", list_keys="exact", ablate_layers=False,
                                                           layer_budgets=[]), 30)
    with pytest.raises(SystemExit, match="--list-keys takes exact and fp8 and fp8-token"):
        twin.with_layer_variants(rules, argparse.Namespace(shortlist="2", list_keys="int4", ablate_layers=False,
                                                           layer_budgets=[]), 30)


def fp8_case(keys):
    """q [4, 3, 8] against `keys` [2, S, 8] (2 KV heads), causal rows at the end, and the exact logits."""
    q = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(5))
    logits = q @ keys.repeat_interleave(2, 0).transpose(1, 2) * 0.5
    causal = torch.arange(keys.shape[1])[None] <= (torch.arange(3) + keys.shape[1] - 3)[:, None]
    return q, logits.masked_fill(~causal, float("-inf"))


def test_fp8_list_keys_are_exact_where_e4m3_holds_every_key():
    # keys in {0, +-1, +-2, +-4, +-8} with an 8 in every 8-token block and KV head: k / scale = 56 k, all in e4m3
    gen = torch.Generator().manual_seed(4)
    keys = (2.0 ** torch.randint(0, 4, (2, 40, 8), generator=gen)) * torch.randint(-1, 2, (2, 40, 8), generator=gen)
    keys.view(2, 5, 8, 8)[:, :, 0, 0] = 8.0
    q, logits = fp8_case(keys)
    rule = twin.Rule("mass", 8, False, 16, shortlist=2, list_keys="fp8")
    got = twin.list_logits(rule, logits, q, keys, 0.5, 2)
    assert torch.equal(got == float("-inf"), logits == float("-inf"))
    assert torch.allclose(got, logits, rtol=1e-5, atol=1e-5)
    assert twin.list_logits(dataclasses.replace(rule, list_keys="exact"), logits, q, keys, 0.5, 2) is logits


@pytest.mark.parametrize("per", ["fp8", "fp8-token"])
def test_fp8_list_keys_err_within_e4m3_rounding(per):
    keys = torch.randn(2, 37, 8, generator=torch.Generator().manual_seed(6))  # a partial last block
    q, logits = fp8_case(keys)
    got = twin.list_logits(twin.Rule("mass", 8, False, 16, shortlist=2, list_keys=per), logits, q, keys, 0.5, 2)
    # per key element: half a unit in e4m3's 3 mantissa bits (2^-4 relative), or its subnormal step 2^-9 x scale
    if per == "fp8":
        blocks = torch.nn.functional.pad(keys, (0, 0, 0, 3)).view(2, 5, 8, 8).abs().amax((2, 3)) / 448
        scale = blocks.repeat_interleave(8, 1)[:, :37, None]
    else:
        scale = keys.abs().amax(2, keepdim=True) / 448
    slack = keys.abs() * 2.0 ** -4 + scale * 2.0 ** -10
    bound = q.abs() @ slack.repeat_interleave(2, 0).transpose(1, 2) * 0.5
    finite = logits > float("-inf")
    assert torch.equal(got > float("-inf"), finite)
    err = (got - logits)[finite].abs()
    assert (err <= bound[finite] * 1.0001 + 1e-6).all() and err.max() > 1e-4  # rounded, within the bound


@pytest.mark.parametrize("score", ["oracle", "mass"])
def test_pooled_selection_keeps_the_heads_pairs_of_highest_score(score):
    """Brute force per row: each KV head's sink and local window, then the (head, block) pairs of highest score
    over both heads until budget x heads blocks are kept."""
    torch.manual_seed(9)
    hq, hkv, d, s, sq, block = 4, 2, 8, 300, 3, 8
    q, k = torch.randn(hq, sq, d) * 2, torch.randn(hkv, s, d)
    rule = twin.Rule(score, block, True, 128, pooled=True)  # 16 blocks a head: 2 sink, 8 local, 6 free
    keep, probs = twin_keep(rule, q, k, s - sq, scale=0.5)
    scores = twin.head_scores(rule, q, k, probs, 0.5).view(hkv, 2, sq, -1).amax(1)
    for i in range(sq):
        n = -(-(s - sq + i + 1) // block)
        forced = {0, 1} | set(range(n - 8, n))
        free = sorted(((h, b) for h in range(hkv) for b in range(n) if b not in forced),
                      key=lambda hb: -float(scores[hb[0], i, hb[1]]))
        picked = set(free[:2 * (16 - len(forced))])
        for h in range(hkv):
            got = {j // block for j in keep[h, i].nonzero().flatten().tolist()}
            assert got == forced | {b for g, b in picked if g == h}
        unseen = n * block - (s - sq + i + 1)  # the row's last block is partial
        assert keep[:, i].sum() == 2 * (16 * block - unseen)  # the pooled budget, all of it


def test_pooling_gives_a_head_with_spread_attention_more_than_its_share():
    """Head 0 pays its mass to many blocks, head 1 to a few: pooled, head 0 keeps more than budget tokens and head 1
    fewer; per KV head each keeps exactly its budget."""
    torch.manual_seed(10)
    d, s, block = 8, 320, 8
    k = torch.randn(2, s, d)
    q = torch.zeros(2, 1, d)
    k[1, 40] *= 5
    q[1, 0] = k[1, 40]  # head 1 attends to one key (logit ~200 against others' ~N(0, 14^2)), head 0 evenly
    rule = twin.Rule("oracle", block, True, 128)
    even, _ = twin_keep(rule, q, k, s - 1)
    pooled, _ = twin_keep(dataclasses.replace(rule, pooled=True), q, k, s - 1)
    assert even[0, 0].sum() == even[1, 0].sum() == 128
    assert pooled[0, 0].sum() > 128 > pooled[1, 0].sum() and pooled[:, 0].sum() == 256
    assert pooled[1, 0, 40]  # head 1 still keeps the key it attends to


def test_a_pooled_budget_over_the_context_gives_denses_rows(tiny_llama):
    torch.manual_seed(4)
    window = torch.randint(0, 97, (150,)).tolist()
    dense, pooled = twin.scored_rows(tiny_llama, window, 10, [None, twin.Rule("oracle", 16, True, 160, pooled=True)])
    assert torch.equal(pooled, dense)
    dense, pooled = twin.scored_rows(tiny_llama, torch.randint(0, 97, (400,)).tolist(), 8,
                                     [None, twin.Rule("oracle", 16, True, 96, pooled=True)])
    assert (dense - pooled).abs().max() > 1e-4


def test_pool_kv_heads_adds_pooled_oracle_and_mass_rules_only():
    args = argparse.Namespace(scores="bound,mass,oracle", block_sizes="16", budget=128, per_kv_head=True,
                              summary_tokens="", combine="sum", rest="none", pool_kv_heads=True)
    assert [r.label for r in twin.parse_rules(args)] == [
        "bound block 16", "bound block 16 per KV head", "mass block 16", "mass block 16 per KV head",
        "mass block 16 per KV head, pooled", "oracle block 16", "oracle block 16 per KV head",
        "oracle block 16 per KV head, pooled"]
