"""Tensor parallelism on the CPU (gloo): a small random Qwen3-shaped model, TP2 against one process.

The reference is the same engine in one process: greedy tokens and the block selections (counted
by the policy) must be the same, including across an abort and a rejected request. Shutdown must
leave no process behind, whether the engine is closed or garbage-collected."""
from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
import weakref

import pytest
import torch

from oasiskv.api import LLM
from oasiskv.config import CacheConfig, EngineConfig, KVConfig, ModelConfig, SamplingParams, SchedulerConfig
from oasiskv.distributed.scores import combine_gathered
from oasiskv.distributed.shard import check_shardable, plan_shard
from oasiskv.engine.engine import LLMEngine
from oasiskv.kernels.block_mass import block_mass_scores_multi_reference
from oasiskv.kernels.block_select import block_scores_reference

VOCAB = 301  # not a multiple of 2: the last vocabulary shard is padded
QWEN3 = {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False}
KV = {"dense": {}, "quest": {}, "oasis": {"fetch_cap": 0.34, "host_kv_gb": 0.01}}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# bytes over PCIe: the whole model's (each rank moves its heads' share; rank 0 reported its share alone)
COUNTERS = ("preemptions", "kv_selected_blocks", "kv_hits", "kv_misses", "kv_prefetched_blocks", "kv_agree_hits",
            "kv_bytes_gathered", "kv_prefetch_bytes")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ranks share the CPU cores
    yield
    torch.set_num_threads(threads)


def engine(tmp_path, mode: str, tp: int, async_scheduling: bool = False, **model) -> LLMEngine:
    return LLMEngine(engine_config(tmp_path, mode, tp, async_scheduling, **model))


def engine_config(tmp_path, mode: str, tp: int, async_scheduling: bool = False, **model) -> EngineConfig:
    """dense: a pool of 12 blocks, too few for the three first requests at once (preemption)."""
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3, **model}))
    kv = KVConfig(mode=mode, budget=48, sink_blocks=1, local_blocks=1, **KV[mode])
    return EngineConfig(model=str(tmp_path), load_format="dummy", dtype="float32", seed=1, show_progress=False,
                        tensor_parallel_size=tp, kv=kv,
                        cache=CacheConfig(kv_cache_gb=0.05, num_kv_blocks=12 if mode == "dense" else None),
                        scheduler=SchedulerConfig(max_num_batched_tokens=96, async_scheduling=async_scheduling))


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (70, 130, 45, 90)]


def drive(e: LLMEngine, before_step=None) -> tuple[dict[str, list[int]], dict]:
    """Three requests (chunked prefill: 96 tokens a step), one aborted mid-way, one rejected, one
    arriving late. `before_step(e, i)` runs before step i."""
    p = prompts()
    for i in range(3):
        e.add_request(p[i], GREEDY, request_id=str(i))
    done = {}
    for step in range(8):
        if before_step:
            before_step(e, step)
        done.update({r.request_id: r.output_token_ids for r in e.step()})
        if step == 3:
            e.abort("1")
            with pytest.raises(ValueError, match="out of range"):
                e.add_request([VOCAB + 5], GREEDY)
            e.add_request(p[3], GREEDY, request_id="3")
    step = 8
    while e.has_unfinished():
        if before_step:
            before_step(e, step)
        done.update({r.request_id: r.output_token_ids for r in e.step()})
        step += 1
    stats = e.stats_dict()
    return done, {k: stats.get(k) for k in COUNTERS}


@pytest.mark.parametrize("mode", ["dense", "oasis"])
def test_tp2_with_async_scheduling_equals_one_process(tmp_path, mode):
    """Rank 0 sends each step's sampled tokens to the other rank, whose next step reads them on its device: the
    tokens and counters of one process with async scheduling, across preemption (dense) and an abort."""
    want, want_stats = drive(engine(tmp_path, mode, 1, async_scheduling=True))
    tp = engine(tmp_path, mode, 2, async_scheduling=True)
    procs = tp.tp.procs
    got, got_stats = drive(tp)
    assert set(got) == {"0", "2", "3"} and got == want and got_stats == want_stats
    assert mode != "dense" or want_stats["preemptions"] > 0
    tp.close()
    assert workers_exit(procs)


class PausingSampler:
    """The engine's sampler, made to read each step's tokens on the host while `pause` is set (as the server's
    logprob sampler does while a request wants logprobs): rank 0 then runs a step without overlap."""

    def __init__(self, inner):
        self.inner, self.pause = inner, False

    @property
    def reads_each_step(self) -> bool:
        return self.pause

    def __getattr__(self, name):
        return getattr(self.inner, name)


def pause_some_steps(e: LLMEngine, step: int) -> None:
    if step == 0:
        e.sampler = PausingSampler(e.sampler)
    e.sampler.pause = step in (2, 3, 6, 9, 10)


def test_tp2_async_scheduling_with_paused_steps_equals_one_process(tmp_path):
    """Where rank 0 pauses async scheduling (its sampler reads each step), it sends no tokens, and the other rank
    does not wait for any: the tokens and counters of one process paused at the same steps."""
    want, want_stats = drive(engine(tmp_path, "oasis", 1, async_scheduling=True), pause_some_steps)
    tp = engine(tmp_path, "oasis", 2, async_scheduling=True)
    procs, send_step, follows = tp.tp.procs, tp.tp.send_step, []

    def send_and_note(plan, tokens_follow=False):
        follows.append(tokens_follow)
        send_step(plan, tokens_follow)

    tp.tp.send_step = send_and_note
    got, got_stats = drive(tp, pause_some_steps)
    assert set(got) == {"0", "2", "3"} and got == want and got_stats == want_stats
    assert follows.count(False) >= 3 and follows.count(True) >= 3  # both kinds of step ran
    tp.close()
    assert workers_exit(procs)


def workers_exit(procs) -> bool:
    for p in procs:
        p.join(15)
    return all(p.exitcode == 0 for p in procs)


@pytest.mark.parametrize("mode", ["dense", "quest", "oasis"])
def test_tp2_equals_one_process(tmp_path, mode):
    """quest runs with ONE KV head: replicated on both ranks, scores combined by all-gather (max, sum);
    dense and oasis split two KV heads (scores all-reduced). dense preempts requests (recompute)."""
    model = {"num_key_value_heads": 1} if mode == "quest" else {}
    want, want_stats = drive(engine(tmp_path, mode, 1, **model))
    tp = engine(tmp_path, mode, 2, **model)
    procs = tp.tp.procs
    got, got_stats = drive(tp)
    assert set(got) == {"0", "2", "3"} and got == want
    assert got_stats == want_stats  # the same selections, hits and prefetches on rank 0 as in one process
    if mode == "dense":
        assert want_stats["preemptions"] > 0
    else:
        assert tp.stats_dict()["tp_score_combines"] > 0 and want_stats["kv_selected_blocks"] > 0
    if mode == "oasis":  # garbage collection stops the ranks
        del tp
        gc.collect()
    else:
        tp.close()
    assert workers_exit(procs)


def mass_scores(q, summaries, tables, nblocks):
    return block_mass_scores_multi_reference(q[None], summaries, tables, nblocks[None], 0.25)[0]


@pytest.mark.parametrize("score", [block_scores_reference, mass_scores])
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_scores_combine_into_the_whole_model_score(score, world):
    """Per-rank scores (max over the rank's query heads) combine into the score of all heads. TP2 splits the
    2 KV heads (sum over ranks, the all-reduce); TP4 replicates each on 2 ranks (max over the ranks sharing
    a KV head, then the sum: combine_gathered). Also for --block-score mass, whose softmax runs per head over
    that head's blocks, which every rank holding the head has."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 16, generator=gen)  # 8 query heads, 2 KV heads
    mn = torch.randn(20, 2, 16, generator=gen)
    summaries = torch.stack([mn, mn + torch.rand(20, 2, 16, generator=gen)], dim=1)
    tables = torch.randperm(20, generator=gen)[:12].to(torch.int32).repeat(3, 1)
    nblocks = torch.tensor([12, 7, 1], dtype=torch.int32)
    cfg = ModelConfig.from_hf({**QWEN3, "num_attention_heads": 8, "num_key_value_heads": 2})
    parts = []
    for rank in range(world):
        s = plan_shard(cfg, rank, world)
        assert s.kv_replicas == world // 2 and len(s.kv_heads) == 1
        parts.append(score(q[:, s.q_heads.start:s.q_heads.stop], summaries[:, :, s.kv_heads.start:s.kv_heads.stop],
                           tables, nblocks))
    whole = score(q, summaries, tables, nblocks)
    combined = torch.stack(parts).sum(0) if world == 2 else combine_gathered(torch.stack(parts), 2)
    torch.testing.assert_close(combined, whole)


@pytest.mark.parametrize("model, world, message", [
    ({"num_attention_heads": 4}, 3, "4 attention heads"),
    ({"num_key_value_heads": 4, "num_attention_heads": 12}, 6, "4 KV heads"),
    ({"intermediate_size": 100}, 8, "100 columns"),
])
def test_sizes_that_do_not_divide_are_clear_errors(model, world, message):
    with pytest.raises(ValueError, match=message):
        check_shardable(ModelConfig.from_hf({**QWEN3, **model}), world)


@pytest.mark.parametrize("config, message", [
    (EngineConfig(tensor_parallel_size=0), "must be >= 1"),
    (EngineConfig(tensor_parallel_size=2, kv=KVConfig(mode="oasis", draft="eagle3")), "eagle3 is not supported"),
])
def test_unsupported_settings_fail_before_any_rank_starts(config, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(config)


def test_a_size_that_does_not_divide_the_model_fails_before_any_rank_starts(monkeypatch):
    """SmolLM2's 9 heads at 2 ranks: the leader's own error, with no rank spawned to print a traceback first."""
    def no_spawn(*args, **kwargs):
        raise AssertionError("a rank was about to be spawned")

    monkeypatch.setattr("oasiskv.distributed.launch.mp.get_context", no_spawn)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 does not divide 9 attention heads"):
        LLMEngine(EngineConfig(tensor_parallel_size=2, device="cpu"))


def test_a_dead_rank_fails_the_next_step_at_once_and_close_returns(tmp_path):
    e = engine(tmp_path, "dense", 2)
    worker = e.tp.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    e.add_request([1, 2, 3], GREEDY)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank1 exited"):
        e.step()
    e.close()
    assert time.monotonic() - t0 < 10


def outcome_within(seconds: float, call):
    """What `call` returns or raises, which it must within `seconds` (it runs in a daemon thread: a hang fails the
    test instead of holding it for the 5-minute collective timeout)."""
    outcome = []

    def run():
        try:
            outcome.append(call())
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"{call.__name__} still runs after {seconds} s"
    return outcome[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_interrupted_on_rank_0_stops_the_ranks_and_a_new_engine_runs(tmp_path, async_scheduling):
    """Ctrl-C on rank 0 between two collectives of a step left rank 1 waiting in the next one, which no later
    message reaches: the next step and close() waited out the collective timeout. Now the ranks are stopped at
    once, the engine says it must be recreated, and a new one can start (while a second is still refused)."""
    e = engine(tmp_path, "dense", 2, async_scheduling=async_scheduling)
    procs = e.tp.procs
    try:
        e.add_request(prompts()[0], GREEDY, request_id="0")
        e.step()

        def interrupt(*args):
            raise KeyboardInterrupt

        if async_scheduling:  # rank 1 waits for the step's sampled tokens
            e.sampler.sample_on_device = interrupt
        else:  # rank 1 goes on into the LM head's all-gather
            e.model.logits = interrupt
        with pytest.raises(KeyboardInterrupt):
            e.step()
        e.discard(["0"])
        e.add_request(prompts()[1], GREEDY, request_id="1")
        error = outcome_within(10, e.step)
        assert isinstance(error, RuntimeError) and "create a new one" in str(error)
        assert outcome_within(10, e.close) is None and not any(p.is_alive() for p in procs)
    finally:
        for p in procs:  # where it failed, rank 0's calls still wait on rank 1: its end ends them
            p.kill()

    retry = engine(tmp_path, "dense", 2)
    with pytest.raises(RuntimeError, match="a tensor-parallel engine is already running in this process"):
        engine(tmp_path, "dense", 2)
    assert drive(retry)[0]
    retry.close()


class ReleaseProbe:
    def __init__(self, owner=None):
        self.calls, self.owner = 0, owner  # the engine's graphs hold its model and policy, and through them the group

    def release(self):
        self.calls += 1


def test_release_hooks_run_before_leaving_and_never_keep_the_engine_alive(tmp_path):
    """On the GPU the engine's CUDA graphs are freed through this hook before NCCL's teardown, which
    hangs while they exist. The hook is held weakly: a dropped engine still stops its ranks."""
    closed = engine(tmp_path, "dense", 2)
    probe = ReleaseProbe()
    closed.tp.before_leave.append(weakref.WeakMethod(probe.release))
    procs = closed.tp.procs
    closed.close()
    assert probe.calls == 1 and workers_exit(procs)

    dropped = engine(tmp_path, "dense", 2)
    dropped.probe = ReleaseProbe(owner=dropped)  # lives and dies with the engine, as the engine's graphs do
    dropped.tp.before_leave.append(weakref.WeakMethod(dropped.probe.release))
    procs = dropped.tp.procs
    del dropped
    gc.collect()
    assert workers_exit(procs)


def test_a_second_engine_while_one_runs_is_refused_and_a_failed_one_leaves_no_group(tmp_path):
    """Rank 0 took the running engine's group for its own (meant for spawned ranks): a second engine joined the first's
    group and hung on its worker. An engine that failed after spawning kept its group as long as its traceback lived
    (a notebook keeps it), and the corrected retry joined that dead group. The refusal's advice, LLM.close(), works."""
    first = LLM.from_config(engine_config(tmp_path, "dense", 2))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="a tensor-parallel engine is already running in this process"):
        engine(tmp_path, "quest", 2)
    assert time.monotonic() - t0 < 10
    first.close()

    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    bad = EngineConfig(model=str(tmp_path), load_format="dummy", dtype="float64", show_progress=False,
                       tensor_parallel_size=2, cache=CacheConfig(kv_cache_gb=0.05))
    try:
        LLMEngine(bad)
    except ValueError as e:
        kept = e  # its traceback holds the failed engine's frames, as a notebook's last error does
    assert "--dtype must be one of" in str(kept)
    retry = engine(tmp_path, "dense", 2)
    assert drive(retry)[0]
    retry.close()
