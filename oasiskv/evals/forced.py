"""Teacher forcing through the engine's decode path.

Sparse attention applies to decode steps only (prefill is dense), so the scored tokens of a window
are fed one decode step at a time: the request's prompt is the window minus its last n + 1 tokens,
and a forcing sampler stands in for the engine's sampler, answering every step with the window's
next token. The first answer follows the prefill and is not scored; the n that follow each come
from a decode step and predict one of the window's last n tokens."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from oasiskv.config import SamplingParams

_request_ids = itertools.count()


@dataclass
class ForcedScores:
    """One window's scored positions."""

    logprobs: list[float] = field(default_factory=list)  # log p(true next token)
    top1: list[int] = field(default_factory=list)  # the model's most likely next token
    kl: list[float] = field(default_factory=list)  # KL(reference || model) per position, with a reference
    rows: list[torch.Tensor] = field(default_factory=list)  # log-prob rows, kept for a later KL


class ForcingSampler:
    """Has the engine sampler's interface (sample, forget); returns the forced tokens."""

    reads_each_step = True  # the forced tokens come from the host: async scheduling pauses

    def __init__(self, forced: dict[str, list[int]], reference: dict[str, list[torch.Tensor]] | None,
                 keep_rows: bool):
        self.forced, self.reference, self.keep_rows = forced, reference, keep_rows
        self.scores = {rid: ForcedScores() for rid in forced}
        self.steps = {rid: 0 for rid in forced}

    def sample(self, logits: torch.Tensor, request_ids: list[str], params) -> list[int]:
        logp = torch.log_softmax(logits.float(), dim=-1)
        top1 = logp.argmax(dim=-1).tolist()
        out = []
        for i, rid in enumerate(request_ids):
            step = self.steps[rid]
            self.steps[rid] += 1
            token = self.forced[rid][step]
            if step > 0:  # step 0 follows the (dense) prefill
                self.record(rid, step - 1, logp[i], top1[i], token)
            out.append(token)
        return out

    def record(self, rid: str, position: int, logp: torch.Tensor, top1: int, token: int) -> None:
        s = self.scores[rid]
        s.logprobs.append(float(logp[token]))
        s.top1.append(top1)
        if self.keep_rows:
            s.rows.append(logp.cpu())
        if self.reference is not None:
            ref = self.reference[rid][position].to(logp.device)
            s.kl.append(float((ref.exp() * (ref - logp)).sum()))

    def forget(self, request_id: str) -> None:
        """The engine calls this when a request finishes; the scores stay until collected."""


def teacher_forced(llm, windows: list[list[int]], num_scored: int,
                   reference: list[list[torch.Tensor]] | None = None, keep_rows: bool = False,
                   desc: str = "teacher forcing") -> list[ForcedScores]:
    """Scores the last num_scored tokens of each window, one decode step per token. With reference
    (per window, per position: the log-prob rows of another run), records KL(reference || this run)."""
    engine = llm.engine
    for w in windows:
        if len(w) < num_scored + 2:
            raise ValueError(f"a window of {len(w)} tokens cannot score its last {num_scored}")
    rids = [f"forced-{next(_request_ids)}" for _ in windows]
    forced = {rid: w[len(w) - num_scored - 1:] for rid, w in zip(rids, windows)}
    ref = dict(zip(rids, reference)) if reference is not None else None
    sampler = ForcingSampler(forced, ref, keep_rows)
    original, engine.sampler = engine.sampler, sampler
    preemptions = engine.stats.preemptions
    try:
        params = SamplingParams(max_tokens=num_scored + 1, temperature=0, ignore_eos=True)
        for rid, w in zip(rids, windows):
            engine.add_request(w[: len(w) - num_scored - 1], params, request_id=rid)
        run_to_completion(engine, len(windows) * (num_scored + 1), desc)
    finally:
        engine.sampler = original
        for rid in rids:
            engine.abort(rid)
            engine.requests.pop(rid, None)
    if engine.stats.preemptions != preemptions:
        raise RuntimeError("a request was preempted during teacher forcing (its next logits came from a "
                           "recompute prefill, not a decode step): give the engine more KV blocks")
    return [sampler.scores[rid] for rid in rids]


def run_to_completion(engine, total_tokens: int, desc: str) -> None:
    bar = tqdm(total=total_tokens, desc=desc, leave=False)
    done = 0
    while engine.has_unfinished():
        engine.step()
        now = sum(len(r.output_token_ids) for r in engine.requests.values())
        bar.update(now - done)
        done = now
    bar.close()
