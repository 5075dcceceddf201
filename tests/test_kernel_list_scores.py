"""kernels/list_scores.py: the one-launch list scores against their torch twin (listed_mass, then on_the_list), and
the twin against a direct computation."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels import list_scores as ls  # noqa: E402
from oasiskv.kernels.list_scores import listed_scores, listed_scores_reference  # noqa: E402

from tests.kernel_device import DEV, run_without_interpreter  # noqa: E402


def random_lists(batch, hq, width, out_width, seed):
    """Per row `width` distinct logical ids below `out_width`, some columns -1 (anywhere), and per head and column a
    log-sum-exp, -inf where the listed block is not on the GPU (every head alike) or where nothing is listed."""
    gen = torch.Generator().manual_seed(seed)
    listed = torch.stack([torch.randperm(out_width, generator=gen)[:width] for _ in range(batch)]).int()
    listed[torch.rand(listed.shape, generator=gen) < 0.2] = -1
    lse = torch.randn(batch, hq, width, generator=gen) * 3
    absent = (torch.rand(batch, 1, width, generator=gen) < 0.15) | (listed[:, None] < 0)
    lse = lse.masked_fill(absent, float("-inf"))
    return lse.to(DEV), listed.to(DEV)


def direct(lse, listed, kv_heads, width):
    """Each listed block's share of each head's softmax over the listed blocks, best head of a KV group, summed over
    the groups, written at its logical id; -inf for blocks not listed."""
    batch, hq, w = lse.shape
    group = hq // kv_heads
    out = torch.full((batch, width), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for col in range(w):
            logical = int(listed[b, col])
            if logical < 0:
                continue
            total = 0.0
            for kv in range(kv_heads):
                best = 0.0
                for h in range(kv * group, (kv + 1) * group):
                    row = [math.exp(x) for x in lse[b, h].double().tolist() if x > float("-inf")]
                    if lse[b, h, col] > float("-inf"):
                        best = max(best, math.exp(float(lse[b, h, col])) / sum(row))
                total += best
            out[b, logical] = total
    return out


SHAPES = [(3, 4, 2, 5, 9), (2, 9, 3, 12, 30), (4, 32, 8, 24, 40), (1, 2, 2, 7, 7), (2, 6, 1, 3, 2000)]  # batch,
# Hq, KV heads, listed columns, row width (2000: the -inf fill runs over two tiles; group 1; group 6 pads to 8)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scores", [listed_scores, listed_scores_reference])
def test_list_scores_equal_the_direct_computation(scores, shape):
    batch, hq, kv_heads, width, out_width = shape
    lse, listed = random_lists(batch, hq, width, out_width, seed=sum(shape))
    got = scores(lse, listed, kv_heads, out_width).cpu()
    expect = direct(lse.cpu(), listed.cpu(), kv_heads, out_width)
    assert torch.equal(torch.isinf(got), torch.isinf(expect))
    finite = torch.isfinite(expect)
    torch.testing.assert_close(got[finite].double(), expect[finite], atol=1e-6, rtol=1e-5)


def test_a_list_longer_than_the_registers_takes_the_twin(monkeypatch):
    monkeypatch.setattr(ls, "MAX_KERNEL_ELEMENTS", 16)
    lse, listed = random_lists(2, 4, 9, 20, seed=4)
    torch.testing.assert_close(listed_scores(lse, listed, 2, 20), listed_scores_reference(lse, listed, 2, 20))


def test_rejects_bad_arguments():
    lse, listed = random_lists(2, 4, 5, 9, seed=1)
    with pytest.raises(ValueError, match="block_lse must be float32"):
        listed_scores(lse.double(), listed, 2, 9)
    with pytest.raises(ValueError, match="do not split"):
        listed_scores(lse, listed, 3, 9)
    with pytest.raises(ValueError, match="listed must be int32"):
        listed_scores_reference(lse, listed.long(), 2, 9)
    with pytest.raises(ValueError, match="listed must be int32"):
        listed_scores(lse, listed[:, :4], 2, 9)


def test_list_scores_kernel_compiles_for_the_h200():
    """Qwen3-8B's group of 4 with a 3x list at 16K (384 blocks), SmolLM2's 3 with 2x at 8K (256)."""
    run_without_interpreter("from oasiskv.kernels.list_scores import compile_for\n"
                            "assert compile_for(90, 4, 384).asm['cubin']\n"
                            "assert compile_for(90, 3, 256).asm['cubin']\n")


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("bad", [3, 7])
def test_listed_ids_out_of_range_are_clear_errors_on_the_cpu(path, bad, monkeypatch):
    """A listed id past the row of `width` scores: the kernel dropped it silently where the twin (the path of long
    lists) failed with an IndexError; found by a helper's audit of the kernels."""
    if path == "torch":
        monkeypatch.setattr(ls, "MAX_KERNEL_ELEMENTS", 1)
    lse = torch.zeros(2, 2, 3)
    listed = torch.tensor([[0, 2, -1], [1, bad, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"listed block ids must be in \[-1, 3\)"):
        listed_scores(lse, listed, 1, 3)
