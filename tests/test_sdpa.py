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
