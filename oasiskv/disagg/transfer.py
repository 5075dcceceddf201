"""The NIXL agent of one instance: host memory registered once, one-sided READs of (address, length)
lists from a remote agent, and short notifications (the decode tells the prefill a request is done).

Agents learn each other from metadata (a few hundred bytes) carried in the requests' kv_transfer_params,
so no side channel is needed. Each process gets a fresh agent name: a restarted prefill instance is a
new agent, and reads addressed to the old one fail with RemoteKVError.

NIXL's own progress thread spins (a whole core per agent, measured), so it is off: the reader
progresses while it waits for its reads, and the side that is read from calls `progress` from a
thread of its own (over TCP a remote READ completes only while its target progresses; over RDMA or
shared memory it needs nothing from the target)."""
from __future__ import annotations

import base64
import importlib
import logging
import os
import time
import uuid

import numpy as np
import torch

log = logging.getLogger("oasiskv.disagg")


class RemoteKVError(RuntimeError):
    """A read from a remote agent failed: the agent is gone (restarted, killed) or timed out."""


NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")  # the PyPI wheels nixl-cu12 / nixl-cu13 (CUDA 12 / 13)


def load_nixl():
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise RuntimeError("--kv-transfer nixl needs the NIXL Python API: pip install --no-deps nixl-cu12 "
                       "(or nixl-cu13 with CUDA 13); it also runs on machines without a GPU")


class KVAgent:
    def __init__(self, role: str):
        nixl = load_nixl()
        self.name = f"oasiskv-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl.nixl_agent(self.name, nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.remotes: set[str] = set()
        self.bytes_read = 0

    # -- this side ---------------------------------------------------------------------------------
    def register(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise ValueError("only host memory is registered for KV transfer")
        self.agent.register_memory(tensor)

    def deregister(self, tensor: torch.Tensor) -> None:
        self.agent.deregister_memory(self.agent.get_reg_descs(tensor))

    def metadata(self) -> str:
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def progress(self) -> list[bytes]:
        """Drives the agent's transfers (the remote reads of this side's memory); returns the
        notifications that arrived."""
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]

    # -- a remote agent ---------------------------------------------------------------------------------
    def connect(self, name: str, metadata: str) -> None:
        if name not in self.remotes:
            added = self.agent.add_remote_agent(base64.b64decode(metadata))
            added = added.decode() if isinstance(added, bytes) else added
            if added != name:
                raise RemoteKVError(f"kv_transfer_params name agent {name!r} but its metadata is {added!r}")
            self.remotes.add(name)

    def forget(self, name: str) -> None:
        if name in self.remotes:
            self.remotes.discard(name)
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # already gone on the UCX side
                log.debug("removing remote agent %s failed", name, exc_info=True)

    def read(self, name: str, remote: np.ndarray, local: np.ndarray, timeout_s: float) -> None:
        """Copies remote (address, bytes) ranges into local ones (uint64 [N, 2] each, same lengths),
        blocking until done. Raises RemoteKVError if the remote agent is gone or the read times out."""
        if len(remote) == 0:
            return
        if name not in self.remotes:
            raise RemoteKVError(f"remote agent {name} is not connected (it failed earlier)")
        handle = None
        try:
            handle = self.agent.initialize_xfer("READ", self.descs(local), self.descs(remote), name)
            state, deadline = self.agent.transfer(handle), time.monotonic() + timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
        except Exception as e:  # nixlRemoteDisconnectError and friends
            raise RemoteKVError(f"reading KV from {name} failed: {type(e).__name__}: {e}") from e
        finally:
            if handle is not None:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:
                    log.debug("releasing a transfer handle failed", exc_info=True)
        if state != "DONE":
            raise RemoteKVError(f"reading KV from {name} " + ("timed out" if state == "PROC" else "failed"))
        self.bytes_read += int(remote[:, 1].sum())

    def notify(self, name: str, message: bytes, settle_s: float = 0.0) -> None:
        """`settle_s`: progress this long after sending, for a connection no read has set up yet (a notification
        is sent only as the agent progresses; an idle decode may not progress again for a while)."""
        if name in self.remotes:
            try:
                self.agent.send_notif(name, message)
                until = time.monotonic() + settle_s
                self.progress()
                while time.monotonic() < until:
                    time.sleep(0.005)
                    self.progress()
            except Exception as e:  # the remote is gone: its timeout frees what it held
                log.warning("notifying %s failed: %s", name, e)

    def descs(self, ranges: np.ndarray):
        """(address, bytes) rows -> NIXL's host-memory descriptor list (device id 0)."""
        out = np.zeros((len(ranges), 3), dtype=np.uint64)
        out[:, :2] = ranges
        return self.agent.get_xfer_descs(out, "DRAM")
