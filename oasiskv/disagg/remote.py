"""Decode side: oasis whose host store is remote for the prompt blocks.

RemoteKV knows, per logical block of the decode instance, where its bytes are: a chunk the decode
owns (a tail it spilled), one it cached, or the prefill instance's host store, read with NIXL when a
fetch (prediction, miss, cold start, tail) needs it. A failed read marks every request of that
prefill instance failed; the step goes on for the others and DecodeEngine ends the failed ones with
an error. RemoteOasisPolicy routes the tiered policy's two host accesses (copy_from_host and
spill_full_tails) through it: everything else is plain oasis.

On the GPU the remote reads are synchronous (host-side, before the gather kernel runs) and the
gather is waited for before cached chunks may be reused: correct, not yet overlapped."""
from __future__ import annotations

import logging
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from oasiskv.config import DisaggConfig
from oasiskv.disagg.export import KEEP, RELEASE
from oasiskv.disagg.local import LocalChunks
from oasiskv.disagg.transfer import KVAgent, RemoteKVError
from oasiskv.kv.summaries import BlockSummaries
from oasiskv.policies.oasis import OasisPolicy

log = logging.getLogger("oasiskv.disagg")
KEPT_STATS = 1024  # finished requests whose transfer statistics wait for their HTTP response


@dataclass
class RemoteRequest:
    agent: str
    remote_request_id: str
    kv_addr: int
    kv_layer_bytes: int
    kv_block_bytes: int
    remote_of: dict[int, int]  # local logical block -> block id in the prefill's host store
    lease_s: float  # the prefill frees the KV after this long without a word from us
    renewed: float = 0.0  # monotonic time of our last word


class RemoteKV:
    def __init__(self, agent: KVAgent, chunks: LocalChunks, cfg: DisaggConfig):
        self.agent, self.chunks, self.cfg = agent, chunks, cfg
        self.requests: dict[str, RemoteRequest] = {}
        self.owner: dict[int, str] = {}  # logical prompt block -> request
        self.failed: dict[str, str] = {}  # request -> why its remote KV is lost
        self.remote_bytes = 0
        self.bytes_of: dict[str, int] = defaultdict(int)
        self.finished: OrderedDict[str, dict] = OrderedDict()
        # (prefill agent, its request id) of every params taken or refused here, until their lease deadline: a
        # replay would read KV that the prefill may have freed and given to another prompt
        self.claimed: dict[tuple[str, str], float] = {}
        agent.register(chunks.store.kv)

    def claim(self, params: dict) -> None:
        """Marks the params used; ValueError if they were used here before."""
        now = time.time()
        self.claimed = {k: deadline for k, deadline in self.claimed.items() if deadline > now}
        key = (params["remote_agent"], params["remote_request_id"])
        if key in self.claimed:
            raise ValueError(f"these kv_transfer_params (request {key[1]} of {key[0]}) were used already: a "
                             "prefilled prompt is decoded once (send the request through the proxy again)")
        self.claimed[key] = float(params["lease_deadline"])

    def unclaim(self, params: dict) -> None:
        """The params may be used again (their request was refused for now, not for good)."""
        self.claimed.pop((params["remote_agent"], params["remote_request_id"]), None)

    def give_back(self, params: dict) -> None:
        """Tells the prefill instance that a request it prefilled for us is refused, so it frees the prompt's KV
        now rather than at its lease's end."""
        try:
            self.agent.connect(params["remote_agent"], params["remote_metadata"])
        except Exception as e:  # unreachable or bad metadata: its lease frees the KV
            log.warning("could not tell %s to free request %s: %s", params["remote_agent"],
                        params["remote_request_id"], e)
            return
        self.agent.notify(params["remote_agent"], RELEASE + params["remote_request_id"].encode(), settle_s=0.2)

    # -- a request arrives ----------------------------------------------------------------------------
    def attach(self, request_id: str, params: dict, local_blocks: list[int], summaries: BlockSummaries) -> None:
        """Connects to the request's prefill instance and reads its prompt blocks' summaries into ours."""
        remote_blocks = [int(b) for b in params["remote_block_ids"]]
        if time.time() > float(params["lease_deadline"]):
            raise ValueError("the prefill instance's lease on this request's KV has run out (--kv-release-timeout)")
        if len(remote_blocks) != len(local_blocks):
            raise ValueError(f"kv_transfer_params list {len(remote_blocks)} blocks for {len(local_blocks)} here")
        self.agent.connect(params["remote_agent"], params["remote_metadata"])
        self.read_summaries(params, remote_blocks, local_blocks, summaries)
        self.probe_kv(params, remote_blocks)
        self.requests[request_id] = RemoteRequest(params["remote_agent"], params["remote_request_id"],
                                                  int(params["kv_addr"]), int(params["kv_layer_bytes"]),
                                                  int(params["kv_block_bytes"]), dict(zip(local_blocks, remote_blocks)),
                                                  float(params["lease_s"]), time.monotonic())
        self.owner.update((b, request_id) for b in local_blocks)

    def read_summaries(self, params, remote_blocks, local_blocks, summaries: BlockSummaries) -> None:
        data = summaries.data
        staging = torch.empty(data.shape[0], len(remote_blocks), *data.shape[2:], dtype=data.dtype)
        size = staging[0, 0].numel() * staging.element_size()
        if size != int(params["summary_block_bytes"]):
            raise ValueError(f"summary of one block is {params['summary_block_bytes']} bytes there, {size} here")
        layers = np.arange(data.shape[0], dtype=np.uint64)[:, None]
        blocks = np.asarray(remote_blocks, dtype=np.uint64)[None, :]
        remote = int(params["summary_addr"]) + layers * int(params["summary_layer_bytes"]) + \
            blocks * int(params["summary_block_bytes"])
        local = staging.data_ptr() + np.arange(remote.size, dtype=np.uint64) * size
        self.agent.register(staging)
        try:
            self.read(params["remote_agent"], remote.reshape(-1), local, size)
        finally:
            self.agent.deregister(staging)
        data[:, torch.tensor(local_blocks, device=data.device)] = staging.to(data.device)

    def probe_kv(self, params, remote_blocks: list[int]) -> None:
        """Reads the request's first and last KV chunks (the lowest and highest addresses its fetches will read):
        params whose KV address or strides are wrong fail here, alone, rather than at a fetch, where a failed read
        means the prefill is gone and fails every request it holds."""
        if not remote_blocks:
            return
        layers, size = self.chunks.store.kv.shape[0], self.chunks.chunk_bytes
        probe = torch.empty(2, size, dtype=torch.uint8)
        remote = [int(params["kv_addr"]) + layer * int(params["kv_layer_bytes"]) + block * int(params["kv_block_bytes"])
                  for layer, block in ((0, min(remote_blocks)), (layers - 1, max(remote_blocks)))]
        self.agent.register(probe)
        try:
            self.read(params["remote_agent"], np.asarray(remote, dtype=np.uint64),
                      probe.data_ptr() + np.arange(2, dtype=np.uint64) * size, size)
        except RemoteKVError as e:
            raise ValueError(f"kv_transfer_params' kv_addr and strides do not address the prefill's KV ({e})") from e
        finally:
            self.agent.deregister(probe)

    def read(self, agent: str, remote: np.ndarray, local: np.ndarray, size: int) -> None:
        sizes = np.full(len(remote), size, dtype=np.uint64)
        self.agent.read(agent, np.stack([remote, sizes], 1), np.stack([local, sizes], 1), self.cfg.read_timeout_s)
        self.remote_bytes += len(remote) * size

    # -- a fetch: (layer, logical block) pairs -> local entries -----------------------------------------
    def localize(self, layers: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Entries of the local store holding each (layer, block) (-1 = no copy wanted, or lost),
        reading from the prefill instances what is neither owned nor cached."""
        out, reads = [], defaultdict(list)
        for i, (layer, block) in enumerate(zip(layers.tolist(), blocks.tolist())):
            out.append(-1 if block < 0 else self.entry_of(layer, block, i, reads))
        for agent, items in reads.items():
            try:
                self.read_chunks(agent, items)
            except RemoteKVError as e:
                self.fail_agent(agent, str(e))
                for i, *_ in items:
                    out[i] = -1
        return torch.tensor(out, dtype=blocks.dtype, device=blocks.device)

    def entry_of(self, layer: int, block: int, i: int, reads: dict) -> int:
        entry = self.chunks.owned_entry(layer, block)
        if entry is not None:
            return entry
        rid = self.owner.get(block)
        if rid is None:
            raise RuntimeError(f"block {block} of layer {layer} has neither a local nor a remote copy")
        if rid in self.failed:
            return -1
        entry = self.chunks.cached_entry(rid, layer, block)
        if entry is None:
            try:
                entry = self.chunks.add_cached(rid, layer, block)
            except MemoryError as e:  # this request fails, not the step
                self.failed.setdefault(rid, str(e))
                return -1
            reads[self.requests[rid].agent].append((i, rid, layer, block, entry))
        return entry

    def own(self, request_id: str, layer: int, block: int) -> int:
        """The local entry a filled tail block is written to; -1 (and the request failed) where memory is full."""
        try:
            return self.chunks.own(request_id, layer, block)
        except MemoryError as e:
            self.failed.setdefault(request_id, str(e))
            return -1

    def read_chunks(self, agent: str, items: list) -> None:
        remote, local = [], []
        for _, rid, layer, block, entry in items:
            r = self.requests[rid]
            remote.append(r.kv_addr + layer * r.kv_layer_bytes + r.remote_of[block] * r.kv_block_bytes)
            local.append(self.chunks.address(layer, entry))
            self.bytes_of[rid] += self.chunks.chunk_bytes
        self.read(agent, np.asarray(remote, dtype=np.uint64), np.asarray(local, dtype=np.uint64),
                  self.chunks.chunk_bytes)

    def fail_agent(self, agent: str, message: str) -> None:
        log.error("prefill instance %s is unreachable: %s", agent, message)
        self.agent.forget(agent)
        for rid, r in self.requests.items():
            if r.agent == agent:
                self.failed.setdefault(rid, f"the prefill instance holding this request's KV is gone ({message})")

    def keep_alive(self) -> None:
        """Renews the prefill's lease of every request past a third of it."""
        now = time.monotonic()
        for rid, r in self.requests.items():
            if now - r.renewed > r.lease_s / 3 and rid not in self.failed:
                self.agent.notify(r.agent, KEEP + r.remote_request_id.encode())
                r.renewed = now

    # -- the request ends ---------------------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        r = self.requests.pop(request_id, None)
        if r is None:
            return
        for b in r.remote_of:
            self.owner.pop(b, None)
        self.agent.notify(r.agent, RELEASE + r.remote_request_id.encode())
        self.finished[request_id] = {"remote_kv_bytes": self.bytes_of.pop(request_id, 0),
                                     "local_host_kv_bytes_peak": (self.chunks.release(request_id)
                                                                  * self.chunks.chunk_bytes)}
        while len(self.finished) > KEPT_STATS:
            self.finished.popitem(last=False)

    def stats(self) -> dict:
        return {"kv_remote_bytes": self.remote_bytes,
                "kv_local_host_bytes_held": self.chunks.entries_used * self.chunks.chunk_bytes,
                "kv_remote_requests_held": len(self.requests)}


class RemoteOasisPolicy(OasisPolicy):
    """Oasis on a decode instance: host-store reads and writes go through RemoteKV."""

    remote: RemoteKV  # set by DecodeEngine once the engine is built

    def graph_key(self):
        return None  # remote reads are driven from the host, step by step: never captured in a CUDA graph

    def copy_from_host(self, copies, stream=None, programs: int | None = None) -> None:
        layers, blocks, slots = copies
        if self.cuda:  # host entries freed earlier may still be read or written by queued copies
            torch.cuda.synchronize()
        super().copy_from_host((layers, self.remote.localize(layers, blocks), slots), stream, programs)
        if self.cuda:  # cached chunks are reused only after the gather has read them
            (stream or torch.cuda.current_stream()).synchronize()
        self.remote.chunks.trim()

    def spill_full_tails(self, layer, tail_slots, dst=None) -> None:
        rows = self.rows_now
        tails = zip(self.meta.decode_request_ids, rows.tail_block.tolist(), rows.full.tolist())
        entries = [self.remote.own(rid, layer, block) if full else -1 for rid, block, full in tails]
        super().spill_full_tails(layer, tail_slots, torch.tensor(entries, dtype=torch.int32, device=tail_slots.device))

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.remote.release(request_id)

    def stats(self) -> dict:
        out = {**super().stats(), **self.remote.stats()}
        out["kv_remote_bytes_per_step"] = out["kv_remote_bytes"] / max(self.decode_steps, 1)
        return out
