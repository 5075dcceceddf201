"""policies/attention.sdpa: causal attention whose queries are the last n of ctx positions (a later prefill chunk
over its cached prefix), against a float64 softmax written out position by position."""
import pytest
import torch

from oasiskv.policies.attention import split_causal_attention, sdpa


def brute_force(q, k, v, scale, causal):
    """Each query row by itself: softmax over the keys it sees, in float64."""
    n, hq, _ = q.shape
    ctx, hkv, _ = k.shape
    group = hq // hkv
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n):
        seen = ctx - n + i + 1 if causal else ctx
        for h in range(hq):
            keys, values = k[:seen, h // group].double(), v[:seen, h // group].double()
            weights = torch.softmax(keys @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ values
    return out


@pytest.mark.parametrize("n,ctx", [(1, 9), (4, 4), (3, 11), (7, 20)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_matches_brute_force(n, ctx, hq, hkv, causal):
    gen = torch.Generator().manual_seed(n * 100 + ctx)
    q = torch.randn(n, hq, 8, generator=gen)
    k, v = torch.randn(ctx, hkv, 8, generator=gen), torch.randn(ctx, hkv, 8, generator=gen)
    out = sdpa(q, k, v, 8 ** -0.5, causal=causal)
    torch.testing.assert_close(out.double(), brute_force(q, k, v, 8 ** -0.5, causal), atol=1e-5, rtol=1e-5)


def test_sdpa_refuses_more_queries_than_keys():
    q, kv = torch.randn(5, 2, 8), torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="5 queries over 4 keys"):
        sdpa(q, kv, kv, 1.0, causal=True)


def attend_with_lse(q, k, v, scale, causal):
    """[1, H, n, D] attention written out (float64 softmax) and its log-sum-exp; causal aligns the square part."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    scores = q.double() @ k.transpose(-1, -2) * scale
    if causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


@pytest.mark.parametrize("n,ctx", [(1, 5), (3, 11), (7, 20), (6, 7)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_split_causal_attention_is_one_softmax_over_both_parts(n, ctx, hq, hkv):
    """The chunk over its prefix and over itself, merged by log-sum-exp, equals the chunk's causal attention."""
    gen = torch.Generator().manual_seed(n + ctx)
    q = torch.randn(n, hq, 8, generator=gen)
    k, v = torch.randn(ctx, hkv, 8, generator=gen), torch.randn(ctx, hkv, 8, generator=gen)
    q4, k4, v4 = (t.double().transpose(0, 1)[None] for t in (q, k, v))
    out = split_causal_attention(q4, k4, v4, 8 ** -0.5, attend_with_lse)[0].transpose(0, 1)
    torch.testing.assert_close(out, brute_force(q, k, v, 8 ** -0.5, True), atol=1e-10, rtol=1e-10)


class SplitCounter:
    """Stands in for cuDNN's attention on the CPU (float64, written out) and counts the split's calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, scale, causal):
        self.calls += 1
        out, lse = attend_with_lse(q, k, v, scale, causal)
        return out.to(q.dtype), lse.float()


@pytest.mark.parametrize("mode", ["dense", "quest", "retrieval", "oasis"])
def test_prefill_chunks_through_the_split_give_the_masked_chunks_logprobs(mode, tmp_path, monkeypatch):
    """Every caller of sdpa hands the split its K/V in order (prefix, then the chunk): prompts prefilled in chunks
    that run the split (as on the GPU; here with a float64 stand-in for cuDNN) continue as the same chunks run with
    the mask do, logprob for logprob. (The masked chunks are the reference: oasis's prefetches depend on how prefill
    and decode share steps, so against whole prompts its logprobs move by themselves.)"""
    from oasiskv.api import LLM, SamplingParams
    from oasiskv.policies import attention
    from tests.helpers import write_tiny_config

    tiny = write_tiny_config(tmp_path / "tiny")
    prompts = [[(7 * i + 3 * j) % 500 + 5 for i in range(length)] for j, length in enumerate((150, 113))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run(chunk: int) -> list[list[int]]:
        """Per prompt: each greedy token and the logprobs of its row's top 3."""
        llm = LLM(tiny, load_format="dummy", show_progress=False, kv_mode=mode, kv_budget=64, sink_blocks=1,
                  local_blocks=1, fetch_cap=0.25, host_kv_gb=0.01, kv_cache_gb=0.01, max_num_batched_tokens=chunk)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[(t, {i: lp.logprob for i, lp in row.items()}) for t, row in zip(o.outputs[0].token_ids,
                                                                              o.outputs[0].logprobs)] for o in outs]

    masked = run(48)
    counter = SplitCounter()
    monkeypatch.setattr(attention, "split_applies", lambda q, k, v: q.shape[2] >= 16)
    monkeypatch.setattr(attention, "cudnn_attention_with_lse", counter)
    chunked = run(48)
    assert [[t for t, _ in p] for p in chunked] == [[t for t, _ in p] for p in masked]
    for got, want in zip(chunked, masked):
        for (_, got_row), (_, want_row) in zip(got, want):
            assert got_row.keys() == want_row.keys()
            assert max(abs(got_row[i] - want_row[i]) for i in want_row) < 1e-5
    assert counter.calls > 0
