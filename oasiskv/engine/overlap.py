"""Async scheduling (--async-scheduling): the host plans and launches step t+1 while step t runs on the GPU.

Without it the host's work between steps (reading the tokens, stop rules, the plan, the step's inputs, the
policy's per-step lists: 0.5-1.9 ms at b16 on the H200's host, docs/BENCHMARKS.md, fourteenth and fifteenth
sessions) leaves the GPU idle, because
step t+1's input is step t's sampled token. With it, step t's tokens are sampled and stay on the device
(Sampler.sample_on_device: the same draws as the synchronous sampler) and each request counts one pending token
(Request.num_pending). The plan of step t+1 is made at once: its decode chunks hold PENDING_TOKEN, which the
runner fills on the device from step t's tokens (runner.fill_pending) before the model runs, and a device draft
source drafts from them there. Only then does the host wait for step t and read its tokens, while step t+1 is
queued behind it. Under tensor parallelism rank 0 broadcasts the tokens on the device (distributed/launch.py).

What this costs: a request that stops on a token (EOS, a stop token or string) runs one more step whose token is
dropped. Its length limit is known ahead (Request.last_pending), so none is planned after its last token."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oasiskv.engine.runner import PendingTokens, StepResult


@dataclass
class InFlight:
    pending: PendingTokens  # the step's sampled tokens on the device, for the next step's inputs
    request_ids: list[str]  # the requests that sampled, in token order
    host_tokens: torch.Tensor  # the same tokens copied to the host (complete at `done`)
    drafts: torch.Tensor | None  # the drafts that ran beside the step, on the host (StepResult.draft_ids)
    chunks: list  # the step's chunks (decodes first)
    done: torch.cuda.Event | None
    # the Request objects of the step's chunks: a request that ended while its token was in flight may have given its
    # id to a new request, which must not receive the old one's token
    owners: dict = field(default_factory=dict)

    @classmethod
    def launch(cls, result: StepResult, requests: dict, max_model_len: int, sampler, to_host) -> InFlight:
        """Samples the step's tokens on the device and counts one pending token per sampling request."""
        if result.request_ids:
            tokens = sampler.sample_on_device(result.logits, result.request_ids,
                                              [requests[rid].params for rid in result.request_ids])
        else:
            tokens = result.logits.new_zeros(0, dtype=torch.long)
        host = to_host(tokens)
        done = None
        if tokens.is_cuda:
            done = torch.cuda.Event()
            done.record()
        for rid in result.request_ids:
            req = requests[rid]
            req.num_pending += 1
            req.last_pending = (len(req.output_token_ids) + req.num_pending >= req.params.max_tokens
                                or req.num_tokens >= max_model_len)
        row_of = {rid: i for i, rid in enumerate(result.request_ids)}
        owners = {c.request_id: requests[c.request_id] for c in result.chunks}
        return cls(PendingTokens(tokens, row_of), result.request_ids, host, result.draft_ids, result.chunks, done,
                   owners)

    def stale(self, requests: dict) -> set[str]:
        """The step's request ids that name another request now (or none)."""
        return {rid for rid, req in self.owners.items() if requests.get(rid) is not req}

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host_tokens.tolist()


def resolve_async_scheduling(setting: bool | None, drafter, device: torch.device) -> bool:
    """Whether the engine overlaps its steps. `setting` None (the default): where it helps and can run, that is on a
    GPU (on the CPU each op runs as it is launched, so there is nothing to overlap) with no draft source or one that
    drafts on the device. True where it cannot run raises ValueError."""
    host_drafts = drafter is not None and not drafter.on_device
    if setting is None:
        return device.type == "cuda" and not host_drafts
    if setting and host_drafts:
        raise ValueError(f"--async-scheduling needs no draft source or one that drafts on the device (--draft ngram "
                         f"or repeat); "
                         f"--draft {drafter.name} drafts on the host from each step's tokens")
    return setting
