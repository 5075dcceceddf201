"""`oasiskv serve --role prefill|decode`: the usual HTTP server over a PrefillEngine or DecodeEngine,
plus what each role adds to it (ServerState.disagg): the prefill's release ticker and its
kv_transfer_params in responses, the decode's transfer statistics in the response usage."""
from __future__ import annotations

import logging
import threading

from oasiskv.config import DisaggConfig, EngineConfig

TICK_S = 0.1  # how often a prefill instance looks for release notifications and timeouts


def build_engine(config: EngineConfig, disagg: DisaggConfig):
    """(engine, role) for `serve`; role is None for a single instance."""
    from oasiskv.engine.engine import LLMEngine

    disagg.validate()
    if disagg.role is not None and config.tensor_parallel_size > 1:
        raise ValueError(f"--role {disagg.role} runs on one GPU: --tensor-parallel-size must be 1, "
                         f"got {config.tensor_parallel_size}")
    if disagg.role is not None:  # per-request transfer statistics and lost prefills go to stderr
        log = logging.getLogger("oasiskv.disagg")
        log.setLevel(logging.INFO)
        if not log.handlers:
            log.addHandler(logging.StreamHandler())
    if disagg.role == "prefill":
        from oasiskv.disagg.export import PrefillEngine

        engine = PrefillEngine(config, disagg)
        return engine, PrefillRole(engine)
    if disagg.role == "decode":
        from oasiskv.disagg.decode import DecodeEngine

        engine = DecodeEngine(config, disagg)
        return engine, DecodeRole(engine)
    return LLMEngine(config), None


class PrefillRole:
    name = "prefill"

    def __init__(self, engine):
        self.exporter = engine.exporter
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, loop) -> None:
        """Posts the exporter's tick to the engine thread every TICK_S: the NIXL agent and the block
        allocator are touched by that thread only."""
        def run():
            while not self.stopping.wait(TICK_S):
                loop.post(self.exporter.tick)

        self.thread = threading.Thread(target=run, name="oasiskv-kv-release", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.exporter.close()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def annotate(self, payload: dict, request_id: str) -> None:
        payload["kv_transfer_params"] = self.exporter.params_of(request_id)

    def refused(self, params, loop) -> None:
        pass  # nothing was exported for a refused request


class DecodeRole:
    name = "decode"

    def __init__(self, engine):
        self.engine, self.remote = engine, engine.remote

    def start(self, loop) -> None:
        pass

    def stop(self) -> None:
        pass

    def annotate(self, payload: dict, request_id: str) -> None:
        stats = self.remote.finished.pop(request_id, None)
        if stats is not None:
            payload["usage"]["kv_transfer"] = stats

    def refused(self, params, loop) -> None:
        loop.post(lambda: self.engine.refuse(params))  # the NIXL agent is the engine thread's
