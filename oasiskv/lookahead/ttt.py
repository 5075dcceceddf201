"""Training-time test (../shared/reference/eagle3.md §5): target features of a padded batch, and the
unrolled draft loss with its attention mask."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from oasiskv.lookahead.draft_data import Batch
from oasiskv.models.eagle3 import Eagle3Head
from oasiskv.models.llama import CausalLM

LOGIT_ROWS = 8192  # target logits are computed this many rows at a time (full-vocabulary fp32 is large)


def heads_first(x: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """[B*T, Hkv, D] -> [B, heads, T, D], KV heads repeated for grouped-query attention."""
    x = x.view(batch, -1, *x.shape[1:]).transpose(1, 2)
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


def tokens_first(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B*T, H, D]."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


class PaddedCausalAttention:
    """Causal attention over a right-padded batch flattened to [B*T] (padding sits after every real
    token, so it is never attended to)."""

    def __init__(self, batch: int):
        self.batch = batch

    def attend(self, layer, q, k, v):
        q4 = heads_first(q, self.batch, q.shape[1])
        k4, v4 = heads_first(k, self.batch, q.shape[1]), heads_first(v, self.batch, q.shape[1])
        return tokens_first(F.scaled_dot_product_attention(q4, k4, v4, is_causal=True))


def unroll_mask(length: int, steps: int, device: torch.device) -> torch.Tensor:
    """[T, T * steps] bool: slot t sees step-0 keys at slots <= t, and its own slot in later steps."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    own = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [own] * (steps - 1), dim=1)


class UnrollAttention:
    """The draft layer's attention across unroll steps: step k's keys are appended to the earlier
    steps' keys and every query reads them through unroll_mask."""

    def __init__(self, batch: int):
        self.batch, self.keys, self.values = batch, [], []

    def attend(self, layer, q, k, v):
        heads = q.shape[1]
        self.keys.append(heads_first(k, self.batch, heads))
        self.values.append(heads_first(v, self.batch, heads))
        q4 = heads_first(q, self.batch, heads)
        mask = unroll_mask(q4.shape[2], len(self.keys), q.device)
        out = F.scaled_dot_product_attention(q4, torch.cat(self.keys, 2), torch.cat(self.values, 2), attn_mask=mask)
        return tokens_first(out)


@dataclass
class Targets:
    features: torch.Tensor  # [B*T, 3*H_t]: the captured states, concatenated in layer order
    probs: torch.Tensor  # fp32 [B, T, draft_vocab]: target distribution restricted to the draft vocab, renormalised
    token_ids: torch.Tensor  # long [B, T]: the target's argmax (full vocabulary); 0 where not predicting a reply
    in_draft_vocab: torch.Tensor  # bool [B, T]: predicts a reply token and the argmax is in the draft vocab


@torch.no_grad()
def target_pass(target: CausalLM, batch: Batch, capture_layers: tuple[int, ...], vocab_ids: torch.Tensor) -> Targets:
    b, t = batch.token_ids.shape
    positions = torch.arange(t, device=batch.token_ids.device).repeat(b)
    hidden, captured = target(batch.token_ids.flatten(), positions, PaddedCausalAttention(b), capture_layers)
    rows = batch.predicts_reply.flatten().nonzero().flatten()
    probs = torch.zeros(b * t, len(vocab_ids), device=hidden.device)
    token_ids = torch.zeros(b * t, dtype=torch.long, device=hidden.device)
    for part in rows.split(LOGIT_ROWS):
        logits = target.logits(hidden[part])
        token_ids[part] = logits.argmax(-1)
        probs[part] = logits[:, vocab_ids].softmax(-1)
    member = torch.zeros(target.config.vocab_size, dtype=torch.bool, device=hidden.device)
    member[vocab_ids] = True
    in_vocab = member[token_ids].view(b, t) & batch.predicts_reply
    return Targets(torch.cat(captured, -1), probs.view(b, t, -1), token_ids.view(b, t), in_vocab)


def shifted(x: torch.Tensor, by: int) -> torch.Tensor:
    """x[:, by:] padded with zeros back to x's length."""
    return torch.cat([x[:, by:], x.new_zeros(x.shape[0], min(by, x.shape[1]), *x.shape[2:])], dim=1)


@dataclass
class UnrollResult:
    loss: torch.Tensor  # sum_k decay^k loss_k
    correct: list[torch.Tensor]  # per step: draft argmax (as a target id) == target argmax, over reply predictions
    counted: list[torch.Tensor]  # per step: reply predictions counted


def unrolled(head: Eagle3Head, token_ids: torch.Tensor, features: torch.Tensor, steps: int) -> Iterator[torch.Tensor]:
    """The head's pre-norm outputs [B*T, H] at unroll steps 0 .. steps-1. Step k reads, at slot t,
    (embed(x_{t+1+k}), its own step k-1 output; fc(features) at k = 0) at position t + k, so its
    output stands for the target's state at t + 1 + k."""
    b, t = token_ids.shape
    slots = torch.arange(t, device=token_ids.device).repeat(b)
    backend, hidden = UnrollAttention(b), features
    for k in range(steps):
        hidden = head(shifted(token_ids, 1 + k).flatten(), hidden, slots + k, backend, fed_back=k > 0)
        yield hidden  # fed back pre-norm and not detached


def unroll(head: Eagle3Head, batch: Batch, targets: Targets, steps: int, decay: float) -> UnrollResult:
    """Loss and top-1 hits of every step against the target's distribution at position t + 1 + k."""
    b, t = batch.token_ids.shape
    loss, correct, counted = 0.0, [], []
    for k, out in enumerate(unrolled(head, batch.token_ids, targets.features, steps)):
        logits = head.logits(out).view(b, t, -1)
        mask = shifted(targets.in_draft_vocab, 1 + k)
        soft_ce = -(shifted(targets.probs, 1 + k) * F.log_softmax(logits, -1)).sum(-1)
        loss = loss + decay ** k * (soft_ce * mask).sum() / mask.sum().clamp(min=1)
        counts = shifted(batch.predicts_reply, 1 + k)
        hits = head.to_target_ids(logits.argmax(-1)) == shifted(targets.token_ids, 1 + k)
        correct.append((hits & counts).sum())
        counted.append(counts.sum())
    return UnrollResult(loss, correct, counted)
