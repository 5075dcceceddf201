"""Decode side: DecodeEngine admits requests prefilled on another instance. Such a request arrives
with its prompt, the first token the prefill sampled and the prefill's kv_transfer_params; it enters
the scheduler with its prompt counted as computed (logical blocks allocated, summaries read from the
prefill), so its first step is a decode of that token, and every block it fetches comes through
RemoteOasisPolicy."""
from __future__ import annotations

import dataclasses
import logging

from oasiskv.config import HEAD_DRAFTS, DisaggConfig, EngineConfig
from oasiskv.disagg.export import layout_of
from oasiskv.disagg.local import LocalChunks
from oasiskv.disagg.params import STRINGS, check_transfer_params
from oasiskv.disagg.remote import RemoteKV, RemoteOasisPolicy
from oasiskv.disagg.transfer import KVAgent
from oasiskv.engine.engine import LLMEngine
from oasiskv.engine.request import RequestStatus
from oasiskv.lookahead.base import DraftChunk

log = logging.getLogger("oasiskv.disagg")
PREEMPTED = ("preempted on the decode instance, whose host memory does not hold this request's prompt KV "
             "(it cannot be recomputed here); retry the request")


class NoRoomError(ValueError):
    """The decode instance has no room for a request's prompt blocks now; the same request (its kv_transfer_params
    too: the prefill keeps the KV until its lease ends) may fit later. The server answers 503, not 400."""

    retry_later = True


def layout_mismatch(theirs: dict, ours: dict) -> str:
    if {k: v for k, v in theirs.items() if k != "model"} == {k: v for k, v in ours.items() if k != "model"}:
        return (f"the prefill instance runs other weights than this one (fingerprint {theirs.get('model')} against "
                f"{ours['model']}): serve the same model on both")
    return f"the prefill instance's KV layout {theirs} differs from this one's {ours}"


class DecodeEngine(LLMEngine):
    def __init__(self, config: EngineConfig, disagg: DisaggConfig):
        if config.kv.mode != "oasis":
            raise ValueError("--role decode needs --kv-mode oasis")
        config.kv.require_layer_layout("--role decode")
        if config.kv.draft in HEAD_DRAFTS:
            raise ValueError(f"--role decode supports --draft ngram, repeat or target, not {config.kv.draft} "
                             "(its EAGLE-3 head would need the prompt's hidden states from the prefill instance)")
        self.disagg = disagg
        if config.kv.prefill_keep_tokens is None:  # it never prefills: no GPU room for a prompt's chunks
            config = dataclasses.replace(config, kv=dataclasses.replace(config.kv, prefill_keep_tokens=0))
        super().__init__(config)
        self.remote = RemoteKV(KVAgent("decode"), LocalChunks(self.host, disagg.remote_cache_blocks), disagg)
        self.policy.remote = self.remote
        self.largest_local_share = 0.0
        self.layout = layout_of(self)

    def kv_overrides(self) -> dict:
        return {"policy_class": RemoteOasisPolicy, "store_blocks": self.disagg.local_kv_blocks}

    # -- admission --------------------------------------------------------------------------------------
    def add_request(self, prompt, params, request_id=None, kv_transfer_params: dict | None = None) -> str:
        """A refused request (bad params, no room, a prefill out of reach) raises ValueError and leaves nothing
        behind here; its prefill instance is told to free the prompt's KV (unless the params were used before)."""
        if not isinstance(kv_transfer_params, dict) or "remote_agent" not in kv_transfer_params:
            raise ValueError("this is a --role decode instance: a request needs the kv_transfer_params its prefill "
                             "instance returned (send requests through `oasiskv proxy`)")
        p = kv_transfer_params
        self.claim(p)
        try:
            rid = super().add_request(prompt, params, request_id)
        except ValueError:
            self.remote.give_back(p)
            raise
        try:
            self.admit_prefilled(self.requests[rid], p)
        except NoRoomError as e:  # for now: the prefill keeps the KV (its lease) for the request sent again
            self.abort(rid)
            self.pop_finished(rid)
            self.remote.unclaim(p)
            raise NoRoomError(f"could not take over the prefilled request: {e}") from e
        except Exception as e:  # anything else: a half-admitted request would fail every later step
            self.abort(rid)
            self.pop_finished(rid)
            self.remote.give_back(p)
            raise ValueError(f"could not take over the prefilled request: {type(e).__name__}: {e}") from e
        return rid

    def claim(self, p: dict) -> None:
        """Checks the params and marks them used (a replay is refused). Bad params are refused too, and their
        prefill is told to free the KV where they name it well enough to be told."""
        try:
            check_transfer_params(p, self.model_config.vocab_size)
            if p["layout"] != self.layout:
                raise ValueError(layout_mismatch(p["layout"], self.layout))
        except ValueError:
            self.refuse(p)
            raise
        self.remote.claim(p)

    def refuse(self, p) -> None:
        """A request with these params will not be decoded here (the server refused it before the engine saw it,
        or its params are bad): its prefill instance is told to free the prompt's KV. Params used before, or too
        malformed to name a prefill and a request, are left alone."""
        if not isinstance(p, dict) or not all(isinstance(p.get(k), str) for k in STRINGS) \
                or not isinstance(p.get("lease_deadline"), (int, float)):
            return
        try:
            self.remote.claim(p)
        except ValueError:  # a replay: the first use owns the KV
            return
        self.remote.give_back(p)

    def admit_prefilled(self, req, p: dict) -> None:
        n = len(req.prompt_token_ids)
        if int(p["num_tokens"]) != n:
            raise ValueError(f"the prefill instance computed {p['num_tokens']} prompt tokens, this prompt has {n}")
        need = self.scheduler.blocks_for(n)
        if not self.allocator.can_allocate(need):
            raise NoRoomError(f"no room for {need} more KV blocks on the decode instance now; retry later")
        req.block_ids = self.allocator.allocate(need)
        self.remote.attach(req.request_id, p, req.block_ids, self.policy.summaries)
        req.num_computed_tokens = n
        if self.drafter is not None and self.drafter.on_device:  # its first decode drafts from the prompt
            self.drafter.write_prompt(req.block_ids, req.prompt_token_ids)
        if not self.append_token(req, int(p["first_token_id"])) and self.drafter is not None \
                and not self.drafter.on_device:
            chunk = DraftChunk(req.request_id, 0, req.prompt_token_ids, req.token_slice(1, n + 1), 0, True,
                               req.tokens)
            req.draft_token_id = self.drafter.propose([chunk], []).get(req.request_id)

    # -- the loop ------------------------------------------------------------------------------------------
    def step(self):
        self.remote.keep_alive()
        finished = super().step()
        for req in list(self.scheduler.waiting):
            if req.num_computed_tokens == 0:  # preempted: its prompt KV cannot be recomputed here
                self.remote.failed.setdefault(req.request_id, PREEMPTED)
        self.fail_lost()
        return finished

    def fail_lost(self) -> None:
        """Ends the requests whose remote KV was lost, without the token of the step that noticed. Where that step
        overlapped (async scheduling) its token is still on the device, and is dropped when read; the tokens this
        call landed came from the step before, which had the KV (sampled_from lists only the tokens read at once)."""
        for rid, message in list(self.remote.failed.items()):
            del self.remote.failed[rid]
            req = self.requests.get(rid)
            if req is None:
                continue
            if rid in self.sampled_from:
                del req.output_token_ids[self.sampled_from[rid]:]
            req.error = message
            if req.status != RequestStatus.FINISHED:
                self.abort(rid)
            log.error("request %s failed: %s", rid, message)

    def append_token(self, req, token: int) -> bool:
        finished = super().append_token(req, token)
        if finished:
            self.record_transfer(req)
        return finished

    def record_transfer(self, req) -> None:
        stats = self.remote.finished.get(req.request_id)
        if stats is None:
            return
        known = len(req.prompt_token_ids) + len(req.output_token_ids)  # (not a step's token still in flight)
        blocks = self.scheduler.blocks_for(max(known - 1, 1))  # the last token's K/V is never made
        stats["full_kv_bytes"] = blocks * self.model_config.num_layers * self.host.chunk_bytes
        stats["local_host_kv_share"] = round(stats["local_host_kv_bytes_peak"] / stats["full_kv_bytes"], 4)
        self.largest_local_share = max(self.largest_local_share, stats["local_host_kv_share"])
        log.info("request %s: %d remote KV bytes; local host KV peak %d bytes = %.3f of its full KV (%d bytes)",
                 req.request_id, stats["remote_kv_bytes"], stats["local_host_kv_bytes_peak"],
                 stats["local_host_kv_share"], stats["full_kv_bytes"])

    def stats_dict(self) -> dict:
        return {**super().stats_dict(), "kv_local_host_share_max": self.largest_local_share}
