"""Llama-family decoder (Llama 3.x, Qwen2/2.5, Qwen3, SmolLM2) with our own forward pass.

Parameter names follow transformers' (model.layers.N.self_attn.q_proj.weight, lm_head.weight...),
so Hugging Face checkpoints load by name. Attention over the KV cache is not done here: each layer
hands its q, k, v to an attention backend (the KV policy), which owns the cache.
"""
from __future__ import annotations

import math
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from oasiskv.config import ModelConfig
from oasiskv.kernels.rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from oasiskv.kernels.rotary import apply_rotary_qk, apply_rotary_qk_reference
from oasiskv.kernels.silu_mul import silu_mul, silu_mul_reference
from oasiskv.models.linear import FusedLinears, Linear, linear


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (rotary already applied) -> [T, Hq, D]."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused Triton kernel on the GPU; the torch ops (transformers' math) on the CPU, and where
        # autograd needs them (EAGLE-3 draft training): the kernel has no backward.
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if x.is_cuda and not needs_grad:
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, the norm of that sum): the residual add and this norm in one kernel on the GPU.
        delta None: (x, the norm of x)."""
        if delta is None:
            return x, self(x)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, delta, self.weight))
        if x.is_cuda and not needs_grad:
            return add_rms_norm(x, delta, self.weight, self.eps)
        return add_rms_norm_reference(x, delta, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":
        return _divided_by_factors(inv_freq, scaling["freq_factors"])
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: llama3, linear, freq_factors)")


def _divided_by_factors(inv_freq: torch.Tensor, factors: list[float]) -> torch.Tensor:
    """A GGUF's rope_freqs tensor (oasiskv/models/gguf_meta.py): llama.cpp divides each frequency by its factor."""
    if len(factors) != len(inv_freq):
        raise ValueError(f"{len(factors)} RoPE frequency factors for {len(inv_freq)} rotary frequencies "
                         "(head_dim / 2)")
    return inv_freq / torch.tensor(factors, dtype=inv_freq.dtype)


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(medium, smoothed, out)


class Rotary(nn.Module):
    """Non-interleaved rotary embedding (transformers' rotate_half convention)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg).float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: FusedLinears | None = None  # set by fuse()

    def fuse(self) -> None:
        """q, k and v in one matmul from now on (see FusedLinears)."""
        if self.qkv is None or not self.qkv.backs(self.projections()):
            self.qkv = FusedLinears(self.projections())

    def projections(self) -> list[nn.Linear]:
        return [self.q_proj, self.k_proj, self.v_proj]

    def forward(self, x, cos, sin, backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        projections = self.projections()
        fused = self.qkv.outputs(x, projections) if self.qkv else None
        q, k, v = fused or (proj(x) for proj in projections)
        v = v.contiguous()  # fused, a column view of the product; q and k leave the norm and rotary contiguous
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # One Triton launch for q and k on the GPU (bit for bit the torch ops); the torch ops on the
        # CPU, and where autograd needs them (EAGLE-3 draft training): the kernel has no backward.
        needs_grad = torch.is_grad_enabled() and any(a.requires_grad for a in (q, k, cos, sin))
        if q.is_cuda and not needs_grad:
            q, k = apply_rotary_qk(q, k, cos, sin)
        else:
            q, k = apply_rotary_qk_reference(q, k, cos, sin)
        out = backend.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: FusedLinears | None = None  # set by fuse()

    def fuse(self) -> None:
        """gate and up in one matmul from now on (see FusedLinears)."""
        if self.gate_up is None or not self.gate_up.backs([self.gate_proj, self.up_proj]):
            self.gate_up = FusedLinears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up.outputs(x, [self.gate_proj, self.up_proj]) if self.gate_up else None
        # SiLU(gate) x up in one Triton launch on the GPU (no temporary between them), its torch twin on the CPU;
        # the torch ops where autograd needs them (the kernel has no backward)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.gate_proj.weight.requires_grad)
        if x.dim() == 2 and not needs_grad:
            gate, up = fused or (self.gate_proj(x), self.up_proj(x))
            return self.down_proj((silu_mul if x.is_cuda else silu_mul_reference)(gate, up))
        if fused is None:  # in this order, gate's output is freed before up's is made: prefill's activation peak
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = fused
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, delta, cos, sin, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream, still without delta, the previous layer's MLP output (None before the first
        layer): each residual add is done by the norm that reads its sum. Returns (the stream after this layer's
        attention, this layer's MLP output): the stream after the layer is their sum."""
        x, h = self.input_layernorm.add_and_norm(x, delta)
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(h, cos, sin, backend))
        return x, self.mlp(h)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The model. forward() runs a flat batch of tokens from many sequences; which token attends to
    what is the backend's business (it was told the step's layout by the runner)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.rotary = Rotary(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        capture_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions: [T]. Returns (final normed hidden [T, H], hidden states after each
        layer in capture_layers (the inputs EAGLE-3 needs))."""
        x, delta = self.model.embed_tokens(input_ids), None
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        captured = []
        for i, layer in enumerate(self.model.layers):
            x, delta = layer(x, delta, cos, sin, backend)
            if i in capture_layers:
                captured.append(x + delta)  # the same bits as the sum the next norm makes
        return self.model.norm.add_and_norm(x, delta)[1], captured

    def fuse_projections(self) -> None:
        """One matmul for q/k/v and one for gate/up in every layer (inference; once the weights are loaded,
        sharded and on their device). Safe to call again."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied (tensor parallelism replaces lm_head by a vocab-parallel head)
            return linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
