"""quest and retrieval on the embedded SmolLM2: exactness where it must hold, and a host store that
never serves a stale or corrupted block."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from oasiskv.api import LLM, SamplingParams
from oasiskv.config import EngineConfig, KVConfig, SamplingParams as SP, SchedulerConfig, CacheConfig
from oasiskv.engine.engine import LLMEngine

from tests.helpers import write_tiny_config

ALICE = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to "
         "do: once or twice she had peeped into the book her sister was reading, but it had no pictures or "
         "conversations in it, 'and what is the use of a book,' thought Alice 'without pictures or conversations?' ")
PROMPTS = [ALICE, "The numbers are " + ", ".join(str(i) for i in range(40)), "def fibonacci(n):\n    ",
           "The three laws of motion state that"]


def generate(mode: str, budget: int, **kw) -> tuple[list[list[int]], LLMEngine]:
    tokens, _, engine = generate_with_logprobs(mode, budget, **kw)
    return tokens, engine


def generate_with_logprobs(mode: str, budget: int, **kw):
    """(tokens, the sampled tokens' log-probabilities, the engine) of greedy continuations of PROMPTS."""
    llm = LLM(show_progress=False, kv_mode=mode, kv_budget=budget, sink_blocks=1, local_blocks=1, **kw)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    logprobs = [[d[t].logprob for d, t in zip(o.logprobs, o.token_ids)] for o in outs]
    return [o.token_ids for o in outs], logprobs, llm.engine


@pytest.mark.slow
def test_budget_above_context_equals_dense_even_across_preemption():
    """Tokens as dense's without preemption; log-probabilities as dense's under the same preemptions, to the bit
    (a recompute prefills the generated tokens again, so both differ from an unpreempted run in rounding alone)."""
    tight = dict(num_kv_blocks=14, max_num_batched_tokens=32)  # forces chunked prefill and preemption
    dense, _ = generate("dense", 2048, kv_cache_gb=0.2)
    dense_tight, dense_logprobs, _ = generate_with_logprobs("dense", 2048, **tight)
    assert dense_tight == dense
    for mode in ("quest", "retrieval"):
        tokens, logprobs, engine = generate_with_logprobs(mode, 2048, **tight)
        assert engine.stats.preemptions > 0, mode
        assert tokens == dense, mode
        assert logprobs == dense_logprobs, mode


@pytest.mark.slow
def test_small_budget_is_really_sparse_and_quest_equals_retrieval():
    quest, q_engine = generate("quest", 48, kv_cache_gb=0.2, max_num_batched_tokens=64)
    retrieval, r_engine = generate("retrieval", 48, kv_cache_gb=0.2, max_num_batched_tokens=64)
    dense, _ = generate("dense", 48, kv_cache_gb=0.2)
    assert quest == retrieval
    assert quest != dense  # a 3-block budget over ~100-token prompts must change something
    stats = r_engine.stats_dict()
    fetched = stats["kv_misses"] + stats.get("kv_tail_fetches", 0)
    assert stats["kv_misses"] > 0 and stats["kv_bytes_gathered"] == fetched * r_engine.host.chunk_bytes
    assert stats["kv_selected_blocks"] == stats["kv_hits"] + stats["kv_misses"]


def make_engine(mode: str, model: str) -> LLMEngine:
    cfg = EngineConfig(model=model, load_format="dummy", show_progress=False,
                       kv=KVConfig(mode=mode, budget=64, sink_blocks=1, local_blocks=1),
                       cache=CacheConfig(kv_cache_gb=0.2), scheduler=SchedulerConfig(max_num_batched_tokens=128))
    return LLMEngine(cfg)


def check_blocks(quest: LLMEngine, retrieval: LLMEngine) -> int:
    """Every full block in retrieval's host store equals quest's (which never moved), and every
    block resident in retrieval's working set equals the host copy (full blocks) or quest's (the
    tail, whose decoded tokens reach the host only when it fills). Returns blocks compared."""
    compared, bs = 0, retrieval.block_size
    ws, host, gpu = retrieval.policy.ws, retrieval.host.kv, retrieval.pool.kv
    for rid, r_req in retrieval.requests.items():
        q_req = quest.requests[rid]
        if r_req.finished or not r_req.block_ids:
            continue
        full, fill = divmod(r_req.num_computed_tokens, bs)
        row = ws.row(rid)
        for j in range(full + (fill > 0)):
            n = bs if j < full else fill
            truth = quest.pool.kv[:, q_req.block_ids[j], :, :n]
            if j < full:
                assert torch.equal(host[:, r_req.block_ids[j]], truth.reshape(host[:, 0].shape)), (rid, j)
            for layer in range(gpu.shape[0]):
                slot = ws.slot_of[layer, row, j].item()
                if slot >= 0:
                    assert torch.equal(gpu[layer, slot, :, :n], truth[layer]), (rid, j, layer)
                    compared += 1
    return compared


@pytest.mark.slow
def test_retrieval_matches_quest_for_500_steps_with_spills_and_no_stale_block(tmp_path):
    """A 16-layer random-weight model (the host store's bookkeeping does not depend on the weights; SmolLM2 took
    ~2.5 min here), sampled with a seed so that queries and selections keep changing; text is read as bytes."""
    tiny = write_tiny_config(tmp_path / "tiny", num_layers=16)
    quest, retrieval = make_engine("quest", tiny), make_engine("retrieval", tiny)
    params = SP(temperature=1.0, seed=7, max_tokens=520, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:2]):
        quest.add_request(prompt, params, request_id=str(i))
        retrieval.add_request(prompt, params, request_id=str(i))
    steps = compared = 0
    while quest.has_unfinished():
        quest.step()
        retrieval.step()
        steps += 1
        for rid in quest.requests:
            assert quest.requests[rid].output_token_ids == retrieval.requests[rid].output_token_ids, (rid, steps)
        if steps % 50 == 0:
            compared += check_blocks(quest, retrieval)
    assert not retrieval.has_unfinished() and steps >= 520
    stats = retrieval.stats_dict()
    assert compared > 1000 and stats["kv_misses"] > 100


def test_kv_stats_in_cli_json():
    proc = subprocess.run(
        [sys.executable, "-m", "oasiskv.cli", "generate", "--prompt", ALICE, "--max-tokens", "8", "--temperature",
         "0", "--kv-mode", "retrieval", "--kv-budget", "48", "--local-blocks", "1", "--json"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])["stats"]
    assert stats["kv_mode"] == "retrieval"
    for key in ("kv_selected_blocks", "kv_hits", "kv_misses", "kv_bytes_gathered", "kv_time_select_s",
                "kv_time_gather_s", "kv_time_attention_s"):
        assert key in stats, key
    assert stats["kv_selected_blocks"] == stats["kv_hits"] + stats["kv_misses"]
    per_request = stats["request"]  # one request: its own counters equal the run's
    for key in ("kv_selected_blocks", "kv_hits", "kv_misses"):
        assert per_request[key] == stats[key], key


def test_impossible_kv_configuration_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "oasiskv.cli", "generate", "--prompt", "x", "--kv-mode", "quest",
                           "--kv-budget", "40"], capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "multiple of the block size" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("mode, memory", [("dense", r"GPU KV pool \(--kv-cache-gb or --num-kv-blocks\) has 39"),
                                          ("oasis", r"host KV store \(--host-kv-gb or --num-kv-blocks\) has 39")])
def test_a_request_too_big_names_the_memory_that_holds_the_mode_s_kv(tmp_path, mode, memory):
    """Retrieval and oasis keep every request's KV in the host store: the error said "the pool" and "enlarge the KV
    cache", which in those modes is the GPU's working memory and would not have let the request in."""
    cfg = EngineConfig(model=write_tiny_config(tmp_path), load_format="dummy", show_progress=False,
                       kv=KVConfig(mode=mode, budget=64, sink_blocks=1, local_blocks=1, host_kv_gb=0.0003, fetch_cap=0.5),
                       cache=CacheConfig(kv_cache_gb=0.0003), scheduler=SchedulerConfig(max_model_len=1024))
    engine = LLMEngine(cfg)
    with pytest.raises(ValueError, match=memory + "; lower max_tokens or enlarge it"):
        engine.add_request([i % 500 for i in range(1000)], SP(max_tokens=1))
    assert not engine.has_unfinished()
