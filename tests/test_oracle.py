"""The oracle policy against a brute-force reading of the same cache: per-block attention mass,
the selection it implies (sink + local + top blocks) and the sparse attention over it. Random K/V
in a paged pool with shuffled physical blocks; the reference works on the logical (contiguous)
sequence in float64."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from oasiskv.config import KVConfig
from oasiskv.kv.gpu_pool import KVPool
from oasiskv.kv.summaries import BlockSummaries
from oasiskv.policies.base import AttentionMetadata
from oasiskv.policies.oracle import OraclePolicy, attention_mass_scores
from oasiskv.policies.sparse import QuestPolicy

BS, HQ, HKV, D = 16, 6, 2, 8
SEQ_LENS = [150, 97, 64, 40]  # the new token included; 10, 7, 4 and 3 blocks
KV = KVConfig(mode="oracle", budget=5 * BS, sink_blocks=1, local_blocks=2)
SCALE = D ** -0.5


def make_case(seed: int, with_new_token: bool):
    """Logical K/V per sequence, the pool holding them under shuffled block tables (each sequence's
    last token, the decode token, only with_new_token), decode queries."""
    g = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=HKV, head_dim=D)
    nblocks = [-(-n // BS) for n in SEQ_LENS]
    pool = KVPool(cfg, sum(nblocks) + 3, BS, torch.float32, torch.device("cpu"))
    physical = torch.randperm(pool.num_blocks, generator=g)[: sum(nblocks)].tolist()
    tables = torch.zeros(len(SEQ_LENS), max(nblocks), dtype=torch.int32)
    logical_k, logical_v = [], []
    for b, (n, nb) in enumerate(zip(SEQ_LENS, nblocks)):
        ids, physical = physical[:nb], physical[nb:]
        tables[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        k, v = torch.randn(n, HKV, D, generator=g) * 2, torch.randn(n, HKV, D, generator=g)
        logical_k.append(k)
        logical_v.append(v)
        for j, block in enumerate(ids):
            end = min(n - (not with_new_token), (j + 1) * BS)
            if end > j * BS:
                pool.kv[0, block, 0, : end - j * BS] = k[j * BS: end]
                pool.kv[0, block, 1, : end - j * BS] = v[j * BS: end]
    q = torch.randn(len(SEQ_LENS), HQ, D, generator=g) * 2
    summaries = BlockSummaries(cfg, pool.num_blocks, torch.float32, torch.device("cpu"))
    return pool, summaries, tables, q, logical_k, logical_v


def decode_meta(tables: torch.Tensor) -> AttentionMetadata:
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    last = lens.long() - 1
    return AttentionMetadata(
        slot_blocks=tables.long().gather(1, (last // BS)[:, None]).squeeze(1), slot_offsets=last % BS,
        num_decode=len(SEQ_LENS), decode_block_tables=tables, decode_seq_lens=lens,
        decode_max_seq_len=max(SEQ_LENS), prefills=[], decode_request_ids=[f"r{i}" for i in range(len(SEQ_LENS))])


def brute_force(q, k, v):
    """(block masses [nb] combined over heads, selected block ids, attention output [HQ, D]) of one
    sequence, in float64 with plain loops over heads and blocks."""
    q, k, v = q.double(), k.double(), v.double()
    n, group = len(k), HQ // HKV
    nb = -(-n // BS)
    probs = [torch.softmax(SCALE * k[:, h // group] @ q[h], dim=0) for h in range(HQ)]
    mass = torch.zeros(nb, dtype=torch.float64)
    for j in range(nb):
        for g in range(HKV):
            mass[j] += max(float(probs[h][j * BS:(j + 1) * BS].sum()) for h in range(g * group, (g + 1) * group))
    budget = KV.budget // BS
    if nb <= budget:
        chosen = list(range(nb))
    else:
        forced = set(range(KV.sink_blocks)) | set(range(nb - KV.local_blocks, nb))
        rest = sorted((j for j in range(nb) if j not in forced), key=lambda j: -float(mass[j]))
        chosen = sorted(forced | set(rest[: budget - len(forced)]))
    tokens = torch.cat([torch.arange(j * BS, min(n, (j + 1) * BS)) for j in chosen])
    out = torch.stack([torch.softmax(SCALE * k[tokens, h // group] @ q[h], dim=0) @ v[tokens, h // group]
                       for h in range(HQ)])
    return mass, chosen, out


def test_attention_mass_matches_brute_force():
    pool, _, tables, q, ks, vs = make_case(seed=0, with_new_token=True)
    scores = attention_mass_scores(q, pool.layer(0), tables, torch.tensor(SEQ_LENS), SCALE)
    for b in range(len(SEQ_LENS)):
        mass, _, _ = brute_force(q[b], ks[b], vs[b])
        nb = len(mass)
        torch.testing.assert_close(scores[b, :nb].double(), mass, atol=1e-6, rtol=1e-5)
        assert torch.isinf(scores[b, nb:]).all() and (scores[b, nb:] < 0).all()


def test_oracle_decode_attends_to_the_brute_force_selection():
    pool, summaries, tables, q, ks, vs = make_case(seed=1, with_new_token=False)  # attend() writes it
    policy = OraclePolicy(pool, KV, summaries, BS, SCALE, torch.device("cpu"), timing=False)
    policy.begin_step(decode_meta(tables))
    new_k = torch.stack([k[-1] for k in ks])
    new_v = torch.stack([v[-1] for v in vs])
    out = policy.attend(0, q, new_k, new_v)
    picked_top = 0
    for b in range(len(SEQ_LENS)):
        mass, chosen, expected = brute_force(q[b], ks[b], vs[b])
        torch.testing.assert_close(out[b].double(), expected, atol=1e-5, rtol=1e-4)
        forced = KV.sink_blocks + KV.local_blocks
        picked_top += len(chosen) > forced and len(mass) > len(chosen)
    assert picked_top >= 2  # sequences longer than the budget really chose among their blocks
    assert int(policy.stats()["kv_selected_blocks"]) == sum(min(-(-n // BS), 5) for n in SEQ_LENS)


def test_oracle_selection_is_not_quests():
    """The two policies differ only in scores; on random keys they must pick different blocks
    somewhere, or the oracle would be quest under another name."""
    pool, summaries, tables, q, _, _ = make_case(seed=2, with_new_token=True)
    blocks, offsets = token_slots(tables)
    summaries.merge_tokens(0, blocks, offsets, pool.kv[0, blocks, 0, offsets])
    nblocks = torch.tensor([-(-n // BS) for n in SEQ_LENS], dtype=torch.int32)
    oracle = OraclePolicy(pool, KV, summaries, BS, SCALE, torch.device("cpu"), timing=False)
    oracle.begin_step(decode_meta(tables))
    quest = QuestPolicy(pool, KV, summaries, BS, SCALE, torch.device("cpu"), timing=False)
    quest.begin_step(decode_meta(tables))
    assert not torch.equal(oracle.select(0, q, tables)[1], quest.select(0, q, tables)[1])
    assert oracle.score_blocks(0, q, tables, nblocks).shape == quest.score_blocks(0, q, tables, nblocks).shape


def token_slots(tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(physical block, offset) of every token of every sequence."""
    blocks, offsets = [], []
    for b, n in enumerate(SEQ_LENS):
        pos = torch.arange(n)
        blocks.append(tables[b].long()[pos // BS])
        offsets.append(pos % BS)
    return torch.cat(blocks), torch.cat(offsets)

