"""Block summaries of prefill chunks: the per-chunk reduction (whole blocks at once, the partial ones
merged) against the token-by-token scatter, over chunks that start and end anywhere in a block."""
import pytest
import torch

from oasiskv.config import ModelConfig
from oasiskv.kv.summaries import BlockSummaries
from oasiskv.policies.base import PrefillSpan

CFG = ModelConfig.from_hf(dict(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
BS = 4


def chunked(lengths_by_step: list[list[int]], seed: int):
    """Per step, the prefill chunks of three requests (one per length, 0 = none this step), each request's
    blocks a random set of ids; yields (spans, flat keys, token blocks, token offsets) per step."""
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randperm(40, generator=gen)[:39].view(3, -1)  # 13 blocks per request, none shared
    done = [0, 0, 0]
    for lengths in lengths_by_step:
        spans, keys, blocks, offsets, t = [], [], [], [], 2  # two decode rows come first in the flat batch
        for r, n in enumerate(lengths):
            if not n:
                continue
            start, end = done[r], done[r] + n
            pos = torch.arange(start, end)
            used = tables[r, :-(-end // BS)]
            spans.append(PrefillSpan(t, t + n, start, used, used.tolist()))
            keys.append(torch.randn(n, 2, 8, generator=gen))
            blocks.append(tables[r][pos // BS])
            offsets.append(pos % BS)
            done[r], t = end, t + n
        flat = torch.cat([torch.randn(2, 2, 8, generator=gen)] + keys)
        yield spans, flat, torch.cat(blocks), torch.cat(offsets)


@pytest.mark.parametrize("lengths_by_step", [
    [[16, 8, 3]],                       # whole blocks only, and a chunk inside one block
    [[5, 6, 1], [7, 2, 9], [4, 13, 2]],  # chunks starting and ending mid-block, continued blocks
    [[3, 0, 4], [1, 3, 4], [0, 2, 4]],   # a block filled by three chunks; aligned chunks
])
@pytest.mark.parametrize("parts", [1, 2, 4])  # sub-block summaries of 4, 2 and 1 tokens
def test_chunk_summaries_equal_token_by_token(lengths_by_step, parts):
    fast = BlockSummaries(CFG, 40, torch.float32, torch.device("cpu"), parts)
    reference = BlockSummaries(CFG, 40, torch.float32, torch.device("cpu"), parts)
    garbage = torch.randn(fast.data.shape, generator=torch.Generator().manual_seed(1))
    fast.data.copy_(garbage)  # what freed blocks held: fresh blocks must not keep any of it
    reference.data.copy_(garbage)
    for spans, flat, blocks, offsets in chunked(lengths_by_step, seed=len(lengths_by_step)):
        fast.merge_spans(1, spans, flat, BS)
        reference.merge_tokens(1, blocks, offsets, flat[2:], BS)
        assert torch.equal(fast.data, reference.data)
    assert torch.equal(fast.data[0], garbage[0])  # the other layer is untouched


def test_bf16_keys_into_fp32_summaries_are_exact():
    summaries = BlockSummaries(CFG, 8, torch.float32, torch.device("cpu"))
    keys = torch.randn(10, 2, 8).to(torch.bfloat16)
    summaries.merge_spans(0, [PrefillSpan(0, 10, 0, torch.tensor([3, 5, 6]), [3, 5, 6])], keys, BS)
    blocks = [keys[0:4], keys[4:8], keys[8:10]]
    for block_id, block in zip([3, 5, 6], blocks):
        assert torch.equal(summaries.data[0, block_id, 0], block.float().amin(0))
        assert torch.equal(summaries.data[0, block_id, 1], block.float().amax(0))


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_a_decode_append_recomputes_the_tails_sub_block(parts):
    """update_from after each appended key: every sub-block of the tail holds the min/max of its own keys, by
    brute force; a reused block's stale keys beyond the fill never leak in."""
    summaries = BlockSummaries(CFG, 6, torch.float32, torch.device("cpu"), parts)
    summaries.data.fill_(99.0)
    kv = torch.full((3, 2, BS, 2, 8), 50.0)  # a pool layer: 3 slots, stale keys everywhere
    g, sub = torch.Generator().manual_seed(0), BS // parts
    slot, host_block = torch.tensor([2], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    for t in range(BS):
        kv[2, 0, t] = torch.randn(2, 8, generator=g)
        summaries.update_from(0, kv, slot, torch.tensor([t + 1], dtype=torch.int32), host_block)
        for p in range(t // sub + 1):
            keys = kv[2, 0, p * sub: min(t + 1, (p + 1) * sub)]
            row = summaries.data[0, 5 * parts + p]
            assert torch.equal(row[0], keys.amin(0)) and torch.equal(row[1], keys.amax(0))
    assert bool((summaries.data[0, :5 * parts] == 99.0).all())  # other blocks' rows untouched
