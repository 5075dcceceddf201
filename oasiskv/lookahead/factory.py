"""Builds the draft source a --draft flag names."""
from __future__ import annotations

import importlib.resources
import os

import torch

from oasiskv.config import HEAD_DRAFTS, KVConfig
from oasiskv.lookahead.base import DraftSource
from oasiskv.lookahead.device_ngram import DeviceNgramDraft
from oasiskv.lookahead.ngram import NgramDraft, RepeatDraft
from oasiskv.lookahead.target import TargetDraft
from oasiskv.models.loader import DEFAULT_GGUF


# EAGLE-3 heads we trained and ship, by the target they serve (None: the embedded default model)
SHIPPED_HEADS = {None: "smollm2-135m-instruct"}


def build_draft_source(kv: KVConfig, target: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                       model: str | None = None, kv_blocks: tuple[int, int] | None = None) -> DraftSource:
    """kv_blocks: (blocks, block size) of the KV allocator, for the sources that keep tokens on the device in
    its layout (ngram); without it, ngram drafts on the host."""
    if kv.draft == "ngram":
        return DeviceNgramDraft(*kv_blocks, device) if kv_blocks else NgramDraft()
    if kv.draft == "repeat":
        return RepeatDraft()
    if kv.draft == "target":
        return TargetDraft()
    if kv.draft in HEAD_DRAFTS:
        from oasiskv.lookahead.eagle3 import Eagle3Draft
        from oasiskv.lookahead.hybrid import NgramEagle3Draft

        head = Eagle3Draft.from_dir(kv.draft_model or shipped_head(model, kv.draft), target, device, dtype)
        if kv.draft == "target+eagle3":
            return TargetDraft(fallback=head)
        return head if kv.draft == "eagle3" else NgramEagle3Draft(head)
    raise ValueError(f"unknown draft source {kv.draft!r}")


def shipped_head(model: str | None, draft: str = "eagle3") -> str:
    if model is not None and os.path.basename(model) == DEFAULT_GGUF:  # the embedded model's file, given by path
        model = None
    if model not in SHIPPED_HEADS:
        raise ValueError(f"--draft {draft} needs --draft-model DIR (an EAGLE-3 head for this model; "
                         "`oasiskv train-draft` trains one); only the embedded default model has a shipped head")
    return str(importlib.resources.files("oasiskv.lookahead") / "heads" / SHIPPED_HEADS[model])
