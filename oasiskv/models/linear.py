"""The model's linear layers: a faster path for thin fp32 products on the CPU (`linear`, `Linear`), and linears
that read the same input fused into one matmul for decode (`FusedLinears`).

MKL computes x @ weightᵀ for an x of 2 to 8 rows (decode: a few tokens) with a kernel that streams the weight
at 3-6 GB/s on a 2-core AVX-512 machine; weight @ xᵀ, the same product, streams it at 11-23 GB/s there
(SmolLM2's tied 49152 x 576 head, 2 rows: 28.1 against 6.1 ms; scripts/cpu_linear_bench.py). Both are fp32
dot products over the same inputs; only the order of the partial sums differs. Elsewhere (GPU, other dtypes,
one row, more than 8 rows) F.linear is as fast or faster and runs as it is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

THIN_ROWS = 8  # 2-8 rows: 1.5-7x faster; from 12 rows on, no faster or slower (scripts/cpu_linear_bench.py)
# Up to this many rows a bf16 matmul on the H200 is bound by the weights it reads (the datasheet's 989 TFLOP/s over
# 4.8 TB/s is about 200 FLOP a byte; each row does 1): fusing saves launches and bandwidth there. Above, in prefill, the
# matmuls are bound by arithmetic, and one fused product would only raise the activation peak.
FUSED_MAX_ROWS = 256


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed as (weight @ xᵀ)ᵀ where that is faster (see the module's note).
    Training (grad enabled) keeps F.linear: a resumed run must repeat an uninterrupted one bit for bit, and the
    transposed product's rounding is not reproducible there (tests/test_train_draft.py saw a 2e-7 drift)."""
    if (x.dim() != 2 or x.device.type != "cpu" or x.dtype != torch.float32 or not 1 < x.shape[0] <= THIN_ROWS
            or torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out + bias


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class FusedLinears:
    """Linears that read the same input (q, k and v; gate and up), computed by one matmul.

    Their weights (and biases) move into adjacent rows of one new tensor, and each linear's parameters
    become views of its rows: no weight is held twice, and loading, sharding and state dicts still see the
    separate linears. One launch reads the weights of all of them: decode matmuls are bound by the weights
    they read, and small ones (k and v) reach far less of the memory bandwidth alone.
    """

    def __init__(self, linears: list[nn.Linear]):
        if len({l.bias is None for l in linears}) != 1:
            raise ValueError("linears to fuse must all have a bias or all have none")
        self.linears = list(linears)
        self.sizes = [l.weight.shape[0] for l in linears]
        with torch.no_grad():
            self.weight = torch.cat([l.weight for l in linears])
            self.bias = None if linears[0].bias is None else torch.cat([l.bias for l in linears])
        start = 0
        for l, n in zip(linears, self.sizes):
            l.weight.data = self.weight[start:start + n]
            if self.bias is not None:
                l.bias.data = self.bias[start:start + n]
            start += n

    def backs(self, linears: list[nn.Linear]) -> bool:
        """Whether these are still the fused linears and their weights still lie in the fused tensor (a
        module replaced, or parameters moved by .to(), since the fusion: then they run apart)."""
        return (len(linears) == len(self.linears) and all(a is b for a, b in zip(linears, self.linears))
                and linears[0].weight.data_ptr() == self.weight.data_ptr()
                and linears[-1].weight.dtype == self.weight.dtype)

    def outputs(self, x: torch.Tensor, linears: list[nn.Linear]) -> tuple[torch.Tensor, ...] | None:
        """Each linear's output for x [T, in], as column views of one product; None where the caller should run
        the linears one by one: above FUSED_MAX_ROWS rows (prefill), or if these are no longer the fused ones."""
        if x.shape[0] <= FUSED_MAX_ROWS and self.backs(linears):
            return linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        return None
