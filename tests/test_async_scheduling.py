"""--async-scheduling: step t+1 is planned and launched before step t's tokens reach the host, its input tokens
filled on the device. It must change nothing the user sees: the same tokens as the synchronous engine in every
mode, across stop tokens (a step whose token is dropped), length limits, preemption and sampled requests (drawn
on the device from the same generators)."""
from __future__ import annotations

import argparse
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams as SP, SchedulerConfig
from oasiskv.cli import add_engine_args, engine_config
from oasiskv.engine.engine import LLMEngine
from oasiskv.engine.overlap import resolve_async_scheduling
from oasiskv.evals.forced import teacher_forced
from oasiskv.engine.logprobs import LogprobSampler


def tiny_engine(tmp_path, mode: str, async_scheduling: bool, num_kv_blocks: int | None = None,
                max_model_len: int | None = None, num_layers: int = 3, **kv) -> LLMEngine:
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    sparse = dict(budget=64, sink_blocks=1, local_blocks=1) if mode != "dense" else {}
    host = dict(host_kv_gb=0.01) if mode in ("retrieval", "oasis") else {}
    if mode == "oasis":
        kv.setdefault("fetch_cap", 0.25)  # one block of the 64-token budget
    cfg = EngineConfig(model=str(tmp_path), load_format="dummy", show_progress=False, seed=3,
                       kv=KVConfig(mode=mode, **sparse, **host, **kv),
                       cache=CacheConfig(kv_cache_gb=0.05, num_kv_blocks=num_kv_blocks),
                       scheduler=SchedulerConfig(max_num_batched_tokens=128, async_scheduling=async_scheduling,
                                                 max_model_len=max_model_len))
    return LLMEngine(cfg)


def prompts(n: int = 4, seed: int = 7) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {str(i): torch.randint(0, 6, (70 + 37 * i,), generator=gen).tolist() for i in range(n)}


def run(engine: LLMEngine, params: dict[str, SP]) -> tuple[dict[str, list[int]], dict[str, str], list[str]]:
    for rid, ids in prompts(len(params)).items():
        engine.add_request(ids, params[rid], request_id=rid)
    order = []
    while engine.has_unfinished():
        order += [r.request_id for r in engine.step()]
    reqs = {rid: engine.requests[rid] for rid in params}
    return ({rid: r.output_token_ids for rid, r in reqs.items()}, {rid: r.finish_reason for rid, r in reqs.items()},
            order)


@pytest.mark.parametrize("mode", ["dense", "quest", "retrieval", "oasis"])
def test_async_gives_the_synchronous_tokens(tmp_path, mode):
    greedy = SP(temperature=0, max_tokens=30, ignore_eos=True)
    sync, _, _ = run(tiny_engine(tmp_path, mode, False), {str(i): greedy for i in range(4)})
    # a token that request 0 samples midway stops requests 0 and 2 early: the step after runs and is dropped
    stop = sync["0"][12]
    params = {str(i): dataclasses.replace(greedy, stop_token_ids=[stop] if i % 2 == 0 else None,
                                          max_tokens=30 - 3 * i) for i in range(4)}
    synchronous = tiny_engine(tmp_path, mode, False, max_model_len=200)  # request 3 (181 tokens): 19 more at most
    expected = run(synchronous, params)
    engine = tiny_engine(tmp_path, mode, True, max_model_len=200)
    got = run(engine, params)
    assert got[0] == expected[0] and got[1] == expected[1]
    assert sorted(got[2]) == sorted(expected[2]) == [str(i) for i in range(4)]
    assert expected[1]["0"] == "stop" and len(got[0]["0"]) <= 13 and len(got[0]["3"]) == 19
    # one dropped step per request stopped by a token; none after a length limit
    stopped = sum(reason == "stop" for reason in got[1].values())
    assert engine.stats.decode_tokens == synchronous.stats.decode_tokens + stopped
    assert not any(r.num_pending for r in engine.requests.values()) and engine.in_flight is None


def test_async_across_preemption_and_sampled_requests(tmp_path):
    greedy = SP(temperature=0, max_tokens=40, ignore_eos=True)
    params = {"0": greedy, "1": SP(temperature=0.7, top_p=0.9, max_tokens=30, ignore_eos=True),  # engine's generator
              "2": SP(temperature=0.9, seed=5, top_k=20, max_tokens=25, ignore_eos=True), "3": greedy}
    expected = run(tiny_engine(tmp_path, "dense", False, num_kv_blocks=30), params)
    engine = tiny_engine(tmp_path, "dense", True, num_kv_blocks=30)
    got = run(engine, params)
    assert engine.stats.preemptions > 0
    assert got[0] == expected[0] and got[1] == expected[1]


def test_async_oasis_drafts_and_counts_equal_the_synchronous_run(tmp_path):
    """The device drafts of each step and the policy's counters (hits, misses, prefetches) match the synchronous
    engine's: the pending tokens reach the device before anything reads them."""
    greedy = SP(temperature=0, max_tokens=30, ignore_eos=True)
    runs = []
    for overlap in (False, True):
        engine = tiny_engine(tmp_path, "oasis", overlap, num_layers=6)
        tokens = run(engine, {str(i): greedy for i in range(4)})[0]
        counts = {k: v for k, v in engine.stats_dict().items() if k.startswith(("kv_", "draft_")) and "time" not in k}
        runs.append((tokens, counts))
    assert runs[0] == runs[1]
    assert runs[1][1]["draft_tokens"] == sum(len(t) - 1 for t in runs[1][0].values())


def test_async_with_a_host_draft_source_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="drafts on the host"):
        tiny_engine(tmp_path, "oasis", True, draft="target")


def test_async_with_the_repeat_draft(tmp_path):
    """--draft repeat drafts on the device too: each step's draft is its own (pending) token."""
    greedy = SP(temperature=0, max_tokens=20, ignore_eos=True)
    runs = []
    for overlap in (False, True):
        engine = tiny_engine(tmp_path, "oasis", overlap, draft="repeat")
        tokens = run(engine, {str(i): greedy for i in range(3)})[0]
        runs.append((tokens, {k: v for k, v in engine.stats_dict().items() if k.startswith(("kv_", "draft_"))
                              and "time" not in k}))
    assert runs[0] == runs[1]
    right = sum(a == b for out in runs[0][0].values() for a, b in zip(out, out[1:]))
    assert runs[1][1]["draft_tokens"] == 57 and runs[1][1]["draft_tokens_right"] == right


@pytest.mark.parametrize("mode", ["dense", "oasis"])
def test_aborting_a_request_in_flight_leaves_the_others_alone(tmp_path, mode):
    """A request aborted while its token is on the device (the server's cancel) ends at once; its token is never
    read into it, and the other requests get the tokens of a run without it."""
    greedy = SP(temperature=0, max_tokens=25, ignore_eos=True)
    expected = run(tiny_engine(tmp_path, mode, False), {str(i): greedy for i in range(3)})[0]
    engine = tiny_engine(tmp_path, mode, True)
    for rid, ids in prompts(4).items():
        engine.add_request(ids, greedy, request_id=rid)
    while len(engine.requests["3"].output_token_ids) < 5:
        engine.step()
    assert engine.requests["3"].num_pending == 1  # its next token is in flight
    engine.abort("3")
    kept = list(engine.requests["3"].output_token_ids)
    while engine.has_unfinished():
        engine.step()
    assert engine.requests["3"].finish_reason == "abort" and engine.requests["3"].output_token_ids == kept
    assert engine.requests["3"].finish_time is not None
    assert engine.requests["3"].output_text == engine.tokenizer.decode(kept)  # the text so far, as vLLM's
    assert {rid: engine.requests[rid].output_token_ids for rid in expected} == expected


@pytest.mark.parametrize("mode", ["dense", "oasis"])
@pytest.mark.parametrize("ended_by", ["abort", "stop token"])
def test_an_id_reused_while_its_old_token_is_in_flight_gets_only_its_own_tokens(tmp_path, mode, ended_by):
    """A request that ended (aborted, or stopped by a token: the step after it still runs) with its next token in
    flight, popped, and its id given to a new request at once: the old token landed in the new request, which then
    decoded from it (found by a helper's audit of the engine). Reference: the new prompt alone, synchronously."""
    greedy = SP(temperature=0, max_tokens=8, ignore_eos=True)
    old_prompt, new_prompt = prompts(2)["0"], prompts(2)["1"]
    alone = tiny_engine(tmp_path, mode, False)
    alone.add_request(new_prompt, greedy, request_id="x")
    while alone.has_unfinished():
        alone.step()
    first = tiny_engine(tmp_path, mode, False)
    first.add_request(old_prompt, greedy, request_id="x")
    first.step()
    old_first = first.requests["x"].output_token_ids[0]
    engine = tiny_engine(tmp_path, mode, True)
    stop = [old_first] if ended_by == "stop token" else None
    engine.add_request(old_prompt, dataclasses.replace(greedy, stop_token_ids=stop), request_id="x")
    while not engine.requests["x"].output_token_ids:
        engine.step()
    if ended_by == "abort":
        engine.step()
        assert engine.requests["x"].num_pending == 1
        engine.abort("x")
    assert engine.requests["x"].finished and "x" in engine.in_flight.request_ids
    engine.pop_finished("x")
    engine.add_request(new_prompt, greedy, request_id="x")
    while engine.has_unfinished():
        engine.step()
    assert engine.requests["x"].output_token_ids == alone.requests["x"].output_token_ids
    assert not engine.requests["x"].num_pending


def test_logprobs_pause_async_scheduling_and_match_the_synchronous_run(tmp_path):
    """The server's logprob sampler records each sampled token's logprob beside it: while a request wants them,
    the engine reads each step before planning the next, and the logprobs are those of the synchronous run."""
    greedy = SP(temperature=0, max_tokens=12, ignore_eos=True)
    runs = []
    for overlap in (False, True):
        engine = tiny_engine(tmp_path, "dense", overlap)
        engine.sampler = LogprobSampler(engine.sampler)
        engine.sampler.wanted["1"] = 2
        tokens = run(engine, {str(i): greedy for i in range(3)})[0]
        runs.append((tokens, engine.sampler.take("1")))
    (tokens, logprobs), (async_tokens, async_logprobs) = runs
    assert async_tokens == tokens and [lp.token_id for lp in async_logprobs] == tokens["1"]
    assert async_logprobs == logprobs


@pytest.mark.parametrize("mode", ["dense", "oasis"])
def test_penalties_pause_async_scheduling_and_match_the_synchronous_run(tmp_path, mode):
    """A request whose sampling reads its own tokens (penalties, min_tokens) needs each step's token on the host
    before the next one is sampled: the engine reads each step while such a request runs."""
    greedy = SP(temperature=0, max_tokens=30, ignore_eos=True)
    free = run(tiny_engine(tmp_path, mode, False), {str(i): greedy for i in range(4)})[0]
    stop = free["2"][2]  # a token request 2 draws early: with min_tokens it may not end the request before 10
    params = {"0": greedy, "1": SP(temperature=0, max_tokens=30, repetition_penalty=1.5, frequency_penalty=0.5),
              "2": SP(temperature=0, max_tokens=30, stop_token_ids=[stop], min_tokens=10, presence_penalty=0.3),
              "3": SP(temperature=0.8, seed=3, max_tokens=30, repetition_penalty=1.2)}
    expected = run(tiny_engine(tmp_path, mode, False), params)
    got = run(tiny_engine(tmp_path, mode, True), params)
    assert got[0] == expected[0] and got[1] == expected[1]
    assert expected[0]["1"] != free["1"] and len(expected[0]["2"]) >= 10 and stop not in expected[0]["2"][:10]


def test_teacher_forcing_pauses_async_scheduling_and_scores_the_same(tmp_path):
    """The eval's forcing sampler gives the engine its tokens from the host: with async scheduling configured, the
    scores are those of the synchronous engine."""
    windows = list(prompts(3).values())
    scores = []
    for overlap in (False, True):
        engine = tiny_engine(tmp_path, "quest", overlap)
        forced = teacher_forced(SimpleNamespace(engine=engine), windows, num_scored=20)
        scores.append([(s.logprobs, s.top1) for s in forced])
    assert scores[0] == scores[1] and len(scores[0][0][0]) == 20


@pytest.mark.parametrize("setting, device, on_device, want", [
    (None, "cuda", None, True), (None, "cuda", True, True), (None, "cuda", False, False),  # default: where it runs
    (None, "cpu", None, False), (None, "cpu", True, False),  # nothing to overlap on the CPU
    (True, "cpu", True, True), (False, "cuda", True, False), (True, "cuda", None, True)])
def test_async_scheduling_default_is_on_where_it_helps_and_can_run(setting, device, on_device, want):
    drafter = None if on_device is None else SimpleNamespace(on_device=on_device, name="x")
    assert resolve_async_scheduling(setting, drafter, torch.device(device)) is want


def test_asking_async_scheduling_with_a_host_draft_source_is_an_error():
    with pytest.raises(ValueError, match="drafts on the host"):
        resolve_async_scheduling(True, SimpleNamespace(on_device=False, name="target"), torch.device("cuda"))


@pytest.mark.parametrize("flags, want", [([], None), (["--async-scheduling"], True),
                                         (["--no-async-scheduling"], False)])
def test_the_cli_flag_reaches_the_config(flags, want):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(flags)).scheduler.async_scheduling is want


def test_the_default_engine_on_the_cpu_runs_synchronously(tmp_path):
    engine = tiny_engine(tmp_path, "dense", None)
    assert engine.async_scheduling is False and engine.stats_dict()["async_scheduling"] is False


def test_unseeded_draws_are_those_of_the_synchronous_run_after_a_stop_token():
    """A request stopped by a token runs one step more, whose draw came from the shared generator: the unseeded
    requests sampled after it got other tokens than without async scheduling (a helper's differential test)."""
    from oasiskv.api import LLM, SamplingParams

    def run(async_scheduling: bool):
        llm = LLM(show_progress=False, kv_mode="dense", kv_cache_gb=0.2, async_scheduling=async_scheduling)
        tok = llm.get_tokenizer()
        stop = [tok.encode(",")[0], tok.encode(" the")[0]]
        a = llm.generate("It is a truth universally acknowledged, that a single man in possession of a good fortune",
                         SamplingParams(temperature=1.0, max_tokens=25, stop_token_ids=stop), use_tqdm=False)
        b = llm.generate("The capital of France is", SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)
        return a[0].outputs[0], b[0].outputs[0].token_ids

    (a_sync, b_sync), (a_async, b_async) = run(False), run(True)
    assert a_sync.finish_reason == "stop" and a_sync.token_ids == a_async.token_ids  # it stopped on a token
    assert b_async == b_sync
