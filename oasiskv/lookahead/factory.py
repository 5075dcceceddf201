"""Builds the draft source a --draft flag names."""
from __future__ import annotations

import torch

from oasiskv.config import KVConfig
from oasiskv.lookahead.base import DraftSource
from oasiskv.lookahead.ngram import NgramDraft, RepeatDraft


def build_draft_source(kv: KVConfig, target: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> DraftSource:
    if kv.draft == "ngram":
        return NgramDraft()
    if kv.draft == "repeat":
        return RepeatDraft()
    if kv.draft == "eagle3":
        from oasiskv.lookahead.eagle3 import Eagle3Draft

        return Eagle3Draft.from_dir(kv.draft_model, target, device, dtype)
    raise ValueError(f"unknown draft source {kv.draft!r}")
