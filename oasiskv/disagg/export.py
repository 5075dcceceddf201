"""Prefill side. A request sent with kv_transfer_params {"do_remote_decode": true} runs its prompt and
samples the first token as usual; then, instead of freeing its KV blocks, PrefillEngine hands them to
the KVExporter, which keeps them (and a host copy of their summaries) registered with NIXL until the
decode instance reports the request done (a NIXL notification), or until its lease runs out: the
release timeout, renewed by the decode's keep-alive notifications while it decodes (reads are
one-sided: the prefill never sees them, so silence is the only sign of a dead decode)."""
from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from oasiskv.config import DisaggConfig, EngineConfig
from oasiskv.disagg.transfer import KVAgent
from oasiskv.engine.engine import LLMEngine
from oasiskv.kv.host_store import register_pinned

log = logging.getLogger("oasiskv.disagg")
RELEASE, KEEP = b"release:", b"keep:"
PROGRESS_S = 0.0005  # how often the prefill's agent progresses (serves reads, takes notifications)


def layout_of(engine: LLMEngine) -> dict:
    """What both instances must agree on for a block to mean the same bytes, and to be read by the same model."""
    cfg = engine.model_config
    return {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "block_size": engine.block_size, "dtype": str(engine.dtype).removeprefix("torch."),
            "model": weights_fingerprint(engine.model)}


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hash of every weight's name, shape and first values: another model of the same shapes (a fine-tune, other
    random weights) would read the prefill's KV without an error and decode nonsense."""
    h = hashlib.sha256()
    for name, weight in sorted(model.named_parameters(), key=lambda item: item[0]):
        h.update(f"{name}{tuple(weight.shape)}".encode())
        h.update(weight.detach().reshape(-1)[:16].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class Export:
    block_ids: list[int]
    params: dict
    deadline: float


def progress(agent: KVAgent, stopping: threading.Event, messages: queue.SimpleQueue) -> None:
    """The agent's own thread (nothing else touches it after set-up): serves the decode instances' reads and queues
    their notifications for the engine thread. It holds no reference to the exporter, which can then be collected."""
    while not stopping.wait(PROGRESS_S):
        for message in agent.progress():
            messages.put(message)


def stop(stopping: threading.Event, poller: threading.Thread) -> None:
    stopping.set()
    if poller is not threading.current_thread():
        poller.join(timeout=5)


class KVExporter:
    def __init__(self, engine: LLMEngine, agent: KVAgent, cfg: DisaggConfig):
        self.engine, self.agent, self.cfg = engine, agent, cfg
        self.layout = layout_of(engine)
        self.host, summaries = engine.host, engine.policy.summaries.data
        self.summaries = summaries
        self.mirror = torch.zeros(summaries.shape, dtype=summaries.dtype)  # host copy of exported summaries
        if engine.device.type == "cuda":
            register_pinned(self.mirror)
        agent.register(self.host.kv)
        agent.register(self.mirror)
        self.metadata = agent.metadata()
        self.wanted: set[str] = set()  # requests to export once their first token is sampled
        self.exports: dict[str, Export] = {}
        self.released = self.expired = 0
        self.messages: queue.SimpleQueue[bytes] = queue.SimpleQueue()  # from the progress thread
        self.stopping = threading.Event()
        self.poller = threading.Thread(target=progress, args=(agent, self.stopping, self.messages),
                                       name="oasiskv-nixl-progress", daemon=True)
        self.poller.start()
        # the thread stops when this exporter is collected (it polled on for every engine a process dropped) and at
        # interpreter exit (a thread still inside NIXL then aborts the process)
        self.close = weakref.finalize(self, stop, self.stopping, self.poller)

    def export(self, request_id: str, block_ids: list[int], num_tokens: int, first_token: int) -> None:
        self.engine.policy.wait_for_host_writes(host=True)  # decode instances read these blocks from the host
        index = torch.tensor(block_ids, dtype=torch.long, device=self.summaries.device)
        self.mirror[:, index.cpu()] = self.summaries[:, index].cpu()
        kv, mirror = self.host.kv, self.mirror
        params = {"remote_agent": self.agent.name, "remote_metadata": self.metadata,
                  "remote_request_id": request_id, "remote_block_ids": block_ids, "num_tokens": num_tokens,
                  "first_token_id": first_token, "layout": self.layout,
                  "lease_s": self.cfg.release_timeout_s, "lease_deadline": time.time() + self.cfg.release_timeout_s,
                  "kv_addr": kv.data_ptr(), "kv_layer_bytes": kv.stride(0) * kv.element_size(),
                  "kv_block_bytes": kv.stride(1) * kv.element_size(),
                  "summary_addr": mirror.data_ptr(), "summary_layer_bytes": mirror.stride(0) * mirror.element_size(),
                  "summary_block_bytes": mirror.stride(1) * mirror.element_size()}
        self.exports[request_id] = Export(block_ids, params, time.monotonic() + self.cfg.release_timeout_s)

    def params_of(self, request_id: str) -> dict | None:
        export = self.exports.get(request_id)
        return None if export is None else export.params

    def release(self, request_id: str, expired: bool = False) -> None:
        export = self.exports.pop(request_id, None)
        if export is not None:
            self.engine.allocator.free(export.block_ids)
            self.expired += expired
            self.released += not expired

    def tick(self) -> None:
        """On the engine thread: frees what decode reported done and what timed out; renews leases."""
        while not self.messages.empty():
            message = self.messages.get()
            if message.startswith(RELEASE):
                self.release(message[len(RELEASE):].decode())
            elif message.startswith(KEEP) and message[len(KEEP):].decode() in self.exports:
                self.exports[message[len(KEEP):].decode()].deadline = time.monotonic() + self.cfg.release_timeout_s
        now = time.monotonic()
        for rid in [r for r, e in self.exports.items() if e.deadline < now]:
            log.warning("request %s: no word from its decode instance for %.0f s; its KV is freed", rid,
                        self.cfg.release_timeout_s)
            self.release(rid, expired=True)

    def stats(self) -> dict:
        held = sum(len(e.block_ids) for e in self.exports.values())
        block_bytes = self.host.kv[:, 0].numel() * self.host.kv.element_size()
        return {"disagg_requests_held": len(self.exports), "disagg_kv_bytes_held": held * block_bytes,
                "disagg_released_requests": self.released, "disagg_expired_requests": self.expired}


class PrefillEngine(LLMEngine):
    """An engine whose remote-decode requests end after their first token with their KV kept."""

    def __init__(self, config: EngineConfig, disagg: DisaggConfig):
        if not config.kv.offloaded:
            raise ValueError("--role prefill needs --kv-mode oasis or retrieval: the KV is served from the host store")
        config.kv.require_layer_layout("--role prefill")
        super().__init__(config)
        self.exporter = KVExporter(self, KVAgent("prefill"), disagg)

    def add_request(self, prompt, params, request_id=None, kv_transfer_params: dict | None = None) -> str:
        if kv_transfer_params is not None:
            if not kv_transfer_params.get("do_remote_decode"):
                raise ValueError('a prefill instance takes kv_transfer_params {"do_remote_decode": true} only')
            if params.max_tokens != 1:
                raise ValueError("a request prefilled for remote decode must have max_tokens 1, "
                                 f"got {params.max_tokens}")
        rid = super().add_request(prompt, params, request_id)
        if kv_transfer_params is not None:
            self.exporter.wanted.add(rid)
            self.requests[rid].prompt_to_host = True  # exported from the host store, its last token included
        return rid

    def append_token(self, req, token: int) -> bool:
        if req.request_id not in self.exporter.wanted:
            return super().append_token(req, token)
        self.exporter.wanted.discard(req.request_id)
        blocks, req.block_ids = req.block_ids, []  # kept for the decode instance, not freed at the finish
        finished = super().append_token(req, token)
        if finished and req.finish_reason == "length":
            self.exporter.export(req.request_id, blocks, len(req.prompt_token_ids), token)
        else:  # it stopped at its first token: nothing left to decode
            self.allocator.free(blocks)
        return finished

    def abort(self, request_id: str) -> None:
        self.exporter.wanted.discard(request_id)
        super().abort(request_id)

    def stats_dict(self) -> dict:
        return {**super().stats_dict(), **self.exporter.stats()}
