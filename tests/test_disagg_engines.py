"""Prefill and decode engines in one process on a tiny random Llama, two NIXL agents talking over
UCX: several remote requests decoded in one batch give the single-instance oasis tokens; a prefill
frees a prompt's KV when told or after its timeout; a lost prefill fails only its own requests; bad
kv_transfer_params are refused with a clear error."""
from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

pytest.importorskip("nixl_cu12")  # the wheel in pyproject.toml on x86-64 Linux
os.environ.setdefault("UCX_TLS", "tcp")

from oasiskv.config import (CacheConfig, DisaggConfig, EngineConfig, KVConfig, SamplingParams,  # noqa: E402
                            SchedulerConfig)
from oasiskv.disagg.decode import DecodeEngine  # noqa: E402
from oasiskv.disagg.export import PrefillEngine  # noqa: E402
from oasiskv.engine.engine import LLMEngine  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    hf = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny")
    AutoModelForCausalLM.from_config(hf, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    # a 4-block budget over ~110-token prompts, one block prefetched per layer and step: sparse, blocks move
    kv = KVConfig(mode="oasis", budget=64, sink_blocks=1, local_blocks=1, fetch_cap=0.25, draft="ngram")
    return EngineConfig(model=str(path), dtype="float32", device="cpu", show_progress=False,
                        cache=CacheConfig(num_kv_blocks=64), kv=kv, scheduler=SchedulerConfig(max_num_seqs=4))


def prompts(n: int, length: int = 100) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (length + 9 * i,), generator=g).tolist() for i in range(n)]


def run(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def prefilled(prefill: PrefillEngine, rid: str, ids: list[int]) -> dict:
    prefill.add_request(ids, FIRST, rid, kv_transfer_params={"do_remote_decode": True})
    run(prefill)
    return prefill.exporter.params_of(rid)


def single_instance(config, ids_list) -> list[list[int]]:
    engine = LLMEngine(config)
    for i, ids in enumerate(ids_list):
        engine.add_request(ids, GREEDY, str(i))
    run(engine)
    return [engine.requests[str(i)].output_token_ids for i in range(len(ids_list))]


@pytest.mark.parametrize("draft, overlap", [("ngram", False), ("target", False), ("ngram", True)])
def test_batched_remote_decode_equals_single_instance(config, draft, overlap):
    """overlap: the decode instance with --async-scheduling (its first decode reads the prompt's tokens, which
    no step of its own computed, from the draft pool)."""
    config = dataclasses.replace(config, kv=dataclasses.replace(config.kv, draft=draft),
                                 scheduler=dataclasses.replace(config.scheduler, async_scheduling=overlap))
    ids_list = prompts(3)
    prefill = PrefillEngine(config, DisaggConfig(role="prefill"))
    decode = DecodeEngine(config, DisaggConfig(role="decode", remote_cache_blocks=1, local_kv_blocks=48))
    for i, ids in enumerate(ids_list):
        decode.add_request(ids, GREEDY, str(i), kv_transfer_params=prefilled(prefill, f"p{i}", ids))
    run(decode)
    assert [decode.requests[str(i)].output_token_ids for i in range(3)] == single_instance(config, ids_list)
    for i in range(3):
        stats = decode.remote.finished[str(i)]
        assert stats["remote_kv_bytes"] > 0 and stats["local_host_kv_share"] <= 0.5, stats
    assert decode.remote.chunks.entries_used == 0 and decode.allocator.num_free == decode.allocator.num_blocks
    deadline = time.time() + 10
    while prefill.exporter.exports and time.time() < deadline:  # the release notifications
        prefill.exporter.tick()
        time.sleep(0.05)
    assert prefill.exporter.released == 3 and prefill.allocator.num_free == prefill.allocator.num_blocks


def test_prefill_lease_runs_out_without_word_and_is_renewed_while_decoding(config):
    kept, orphan = prompts(2)
    prefill = PrefillEngine(config, DisaggConfig(role="prefill", release_timeout_s=2.0))
    decode = DecodeEngine(config, DisaggConfig(role="decode"))
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    decode.add_request(kept, long, "d", kv_transfer_params=prefilled(prefill, "kept", kept))
    prefilled(prefill, "orphan", orphan)  # no decode instance ever claims it
    start = time.monotonic()
    while time.monotonic() - start < 4.5:  # well past the lease: decode's keep-alives renew it
        decode.step()
        prefill.exporter.tick()
        time.sleep(0.02)
    assert decode.has_unfinished() and list(prefill.exporter.exports) == ["kept"] and prefill.exporter.expired == 1
    decode.abort("d")
    deadline = time.time() + 10
    while prefill.exporter.exports and time.time() < deadline:
        prefill.exporter.tick()
        time.sleep(0.05)
    assert prefill.exporter.released == 1 and prefill.allocator.num_free == prefill.allocator.num_blocks


class PausedSampler:
    """The engine's sampler, reading each step's tokens on the host (as the server's logprobs do): async scheduling
    pauses from the step it is set in."""

    reads_each_step = True

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run_with_a_lost_prefill(config, overlap) -> tuple[DecodeEngine, list[list[int]]]:
    """Two remote requests; the prefill instance of the first is lost after two steps."""
    sched = dataclasses.replace(config.scheduler, async_scheduling=bool(overlap))
    config = dataclasses.replace(config, scheduler=sched)
    ids_list = prompts(2)
    lost, kept = (PrefillEngine(config, DisaggConfig(role="prefill")) for _ in range(2))
    decode = DecodeEngine(config, DisaggConfig(role="decode", remote_cache_blocks=0))
    decode.add_request(ids_list[0], GREEDY, "lost", kv_transfer_params=prefilled(lost, "a", ids_list[0]))
    decode.add_request(ids_list[1], GREEDY, "kept", kv_transfer_params=prefilled(kept, "b", ids_list[1]))
    decode.step()
    decode.step()
    decode.remote.agent.forget(lost.exporter.agent.name)  # as after a disconnect: reads from it now fail
    if overlap == "paused":
        decode.sampler = PausedSampler(decode.sampler)
    run(decode)
    return decode, ids_list


@pytest.mark.parametrize("overlap", [False, True, "paused"])
def test_a_lost_prefill_fails_only_its_requests(config, overlap):
    """The failed request keeps the tokens of the steps that had its KV, the synchronous engine's: also with async
    scheduling, and where it pauses in the step that notices (that step lands the step before's token, then reads
    its own, which is dropped)."""
    decode, ids_list = run_with_a_lost_prefill(config, overlap)
    failed = decode.requests["lost"]
    assert failed.finish_reason == "abort" and "prefill instance" in failed.error and "gone" in failed.error
    want = single_instance(config, ids_list)
    assert failed.output_token_ids == want[0][:len(failed.output_token_ids)]  # right while it had the KV
    if overlap:
        sync, _ = run_with_a_lost_prefill(config, False)
        assert failed.output_token_ids == sync.requests["lost"].output_token_ids
    assert decode.requests["kept"].output_token_ids == want[1]
    assert decode.remote.chunks.entries_used == 0 and decode.allocator.num_free == decode.allocator.num_blocks


def test_a_prefill_of_other_weights_is_refused(config, tmp_path):
    """Same shapes, other random weights: the blocks have the right size, and would be decoded into nonsense."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    hf = LlamaConfig.from_pretrained(config.model)
    AutoModelForCausalLM.from_config(hf, dtype=torch.float32).save_pretrained(tmp_path, safe_serialization=True)
    other = PrefillEngine(dataclasses.replace(config, model=str(tmp_path)), DisaggConfig(role="prefill"))
    same = PrefillEngine(config, DisaggConfig(role="prefill"))
    decode = DecodeEngine(config, DisaggConfig(role="decode"))
    ids = prompts(1)[0]
    with pytest.raises(ValueError, match="runs other weights than this one .*serve the same model on both"):
        decode.add_request(ids, GREEDY, "other", kv_transfer_params=prefilled(other, "o", ids))
    released_soon(other, 1)  # told to free the prompt's KV
    decode.add_request(ids, GREEDY, "same", kv_transfer_params=prefilled(same, "s", ids))
    run(decode)
    assert decode.requests["same"].output_token_ids == single_instance(config, [ids])[0]


def test_bad_kv_transfer_params_are_refused(config):
    decode = DecodeEngine(config, DisaggConfig(role="decode"))
    ids = prompts(1)[0]
    with pytest.raises(ValueError, match="kv_transfer_params its prefill"):
        decode.add_request(ids, GREEDY, "plain")
    prefill = PrefillEngine(config, DisaggConfig(role="prefill"))
    params = {i: prefilled(prefill, f"p{i}", ids) for i in range(3)}  # each refusal frees its prefill's KV
    with pytest.raises(ValueError, match="KV layout"):
        decode.add_request(ids, GREEDY, "x",
                           kv_transfer_params={**params[0], "layout": {**params[0]["layout"], "head_dim": 8}})
    with pytest.raises(ValueError, match="lease"):
        decode.add_request(ids, GREEDY, "w", kv_transfer_params={**params[1], "lease_deadline": time.time() - 1})
    with pytest.raises(ValueError, match="prompt tokens"):
        decode.add_request(ids[:-1], GREEDY, "y", kv_transfer_params=params[2])
    with pytest.raises(ValueError, match="max_tokens 1"):
        prefill.add_request(ids, GREEDY, "z", kv_transfer_params={"do_remote_decode": True})
    assert not decode.requests and decode.allocator.num_free == decode.allocator.num_blocks
    released_soon(prefill, 3)
    with pytest.raises(ValueError, match="--kv-mode oasis"):
        DecodeEngine(config.replace(kv=KVConfig(mode="quest", budget=64)), DisaggConfig(role="decode"))


def released_soon(prefill: PrefillEngine, count: int) -> None:
    """The prefill has freed `count` exports on its decode instance's word (not at their lease's end)."""
    deadline = time.time() + 10
    while prefill.exporter.released < count and time.time() < deadline:
        prefill.exporter.tick()
        time.sleep(0.05)
    assert prefill.exporter.released == count and prefill.exporter.expired == 0


@pytest.mark.parametrize("key, value, message", [
    ("first_token_id", -1, "first_token_id must be an integer >= 0"),
    ("first_token_id", 256, "first_token_id must be below the vocabulary's 256"),
    ("num_tokens", None, "num_tokens must be an integer >= 0"),
    ("remote_block_ids", [0, -3], "remote_block_ids must be a list of integers >= 0"),
    ("kv_addr", "0x10", "kv_addr must be an integer >= 0"),
    ("lease_s", True, "lease_s must be a positive number"),
])
def test_malformed_params_fail_alone_and_free_the_prefills_kv(config, key, value, message):
    """A bad value refused up front (it reached the step before, which then failed every request), the decode
    instance goes on with the others, and the prefill is told to free the refused request's KV."""
    ids_list = prompts(2)
    prefill = PrefillEngine(config, DisaggConfig(role="prefill"))
    decode = DecodeEngine(config, DisaggConfig(role="decode", remote_cache_blocks=1, local_kv_blocks=48))
    good, bad = (prefilled(prefill, f"p{i}", ids) for i, ids in enumerate(ids_list))
    decode.add_request(ids_list[0], GREEDY, "0", kv_transfer_params=good)
    with pytest.raises(ValueError, match=message):
        decode.add_request(ids_list[1], GREEDY, "1", kv_transfer_params={**bad, key: value})
    run(decode)
    assert decode.requests["0"].output_token_ids == single_instance(config, ids_list[:1])[0]
    assert list(decode.requests) == ["0"]
    released_soon(prefill, 2)


def test_a_wrong_kv_address_fails_its_request_alone(config):
    """Found at admission by reading the request's first and last chunks: at a fetch, a failed read means the prefill
    is gone and fails every request it holds (the good one too, as "the prefill instance ... is gone")."""
    ids_list = prompts(2)
    prefill = PrefillEngine(config, DisaggConfig(role="prefill"))
    decode = DecodeEngine(config, DisaggConfig(role="decode", remote_cache_blocks=0))
    good, bad = (prefilled(prefill, f"p{i}", ids) for i, ids in enumerate(ids_list))
    decode.add_request(ids_list[0], GREEDY, "good", kv_transfer_params=good)
    with pytest.raises(ValueError, match="do not address the prefill's KV"):
        decode.add_request(ids_list[1], GREEDY, "bad",
                           kv_transfer_params={**bad, "kv_addr": bad["kv_addr"] + (1 << 40)})
    run(decode)
    assert decode.requests["good"].error is None
    assert decode.requests["good"].output_token_ids == single_instance(config, ids_list[:1])[0]
    released_soon(prefill, 2)


def test_no_room_on_the_decode_is_a_retry_later_refusal(config):
    """A decode instance full for now refuses with an error the server answers 503 (retry), not 400; the prefill
    keeps that prompt's KV, so the same request sent again once there is room gives the single instance's tokens."""
    from oasiskv.disagg.decode import NoRoomError

    ids_list = prompts(2)
    small = config.replace(cache=dataclasses.replace(config.cache, num_kv_blocks=10))  # one ~110-token prompt
    prefill = PrefillEngine(config, DisaggConfig(role="prefill"))
    decode = DecodeEngine(small, DisaggConfig(role="decode"))
    decode.add_request(ids_list[0], GREEDY, "0", kv_transfer_params=prefilled(prefill, "p0", ids_list[0]))
    later = prefilled(prefill, "p1", ids_list[1])
    with pytest.raises(NoRoomError, match="no room for .* KV blocks on the decode instance now") as refused:
        decode.add_request(ids_list[1], GREEDY, "1", kv_transfer_params=later)
    assert refused.value.retry_later and isinstance(refused.value, ValueError)
    run(decode)
    decode.add_request(ids_list[1], GREEDY, "1", kv_transfer_params=later)  # room again: the retry is taken
    run(decode)
    assert [decode.requests[r].output_token_ids for r in "01"] == single_instance(config, ids_list)
    released_soon(prefill, 2)


def test_used_params_are_refused(config):
    """A replay would read KV the prefill may have freed and reused for another prompt."""
    ids = prompts(1)[0]
    prefill = PrefillEngine(config, DisaggConfig(role="prefill"))
    decode = DecodeEngine(config, DisaggConfig(role="decode"))
    params = prefilled(prefill, "p", ids)
    decode.add_request(ids, GREEDY, "first", kv_transfer_params=params)
    with pytest.raises(ValueError, match="were used already"):
        decode.add_request(ids, GREEDY, "again", kv_transfer_params=params)
    run(decode)
    assert decode.requests["first"].output_token_ids == single_instance(config, [ids])[0]


def test_full_local_memory_fails_the_request_that_needs_more(config):
    """Local host memory for spilled tails and cached blocks runs out: the request that needed a chunk fails with
    the message, and the instance goes on (a MemoryError in the step stopped it for good)."""
    ids_list = prompts(2)
    prefill = PrefillEngine(config, DisaggConfig(role="prefill"))
    decode = DecodeEngine(config, DisaggConfig(role="decode", remote_cache_blocks=1, local_kv_blocks=6))
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i, ids in enumerate(ids_list):
        decode.add_request(ids, long, str(i), kv_transfer_params=prefilled(prefill, f"p{i}", ids))
    run(decode)
    failed = [r for r in decode.requests.values() if r.error]
    assert failed and all("local host KV memory is full" in r.error for r in failed)
    assert decode.remote.chunks.entries_used == 0 and decode.allocator.num_free == decode.allocator.num_blocks
    later = prompts(3)[2]
    decode.add_request(later, GREEDY, "later", kv_transfer_params=prefilled(prefill, "later", later))
    run(decode)
    assert len(decode.requests["later"].output_token_ids) == GREEDY.max_tokens


def test_a_decode_instance_keeps_no_gpu_room_for_prefill_chunks(config):
    chunked = config.replace(scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    assert LLMEngine(chunked).policy.keep.capacity > 0  # 512-token prompts in 64-token chunks
    assert DecodeEngine(chunked, DisaggConfig(role="decode")).policy.keep.capacity == 0  # it never prefills


@pytest.mark.parametrize("lengths", [[1], [65], [40, 25]])
def test_a_prompts_last_token_alone_is_exported_too(config, lengths):
    """In 64-token steps a 65-token prompt's last token comes alone, as does the second prompt's of 40 + 25 in one
    step, and a one-token prompt's only token: each reaches the prefill's host store (it stayed in the GPU tail
    block, and the decode instance read zeros or stale K/V), as a prefill of each prompt in one piece stores it; the
    decode instance gives the single instance's tokens."""
    chunked = config.replace(scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    g = torch.Generator().manual_seed(3)
    ids_list = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    prefill, whole = PrefillEngine(chunked, DisaggConfig(role="prefill")), PrefillEngine(config, DisaggConfig())
    for engine in (prefill, whole):
        for i, ids in enumerate(ids_list):  # all in one batch, as a server's concurrent requests
            engine.add_request(ids, FIRST, f"p{i}", kv_transfer_params={"do_remote_decode": True})
        run(engine)
    for i, ids in enumerate(ids_list):
        kv = [e.host.kv[:, e.exporter.params_of(f"p{i}")["remote_block_ids"]] for e in (prefill, whole)]
        kv = [x.transpose(2, 3).flatten(1, 2)[:, :len(ids)] for x in kv]  # [layers, tokens, 2, Hkv, D]
        assert kv[0][:, -1].abs().sum() > 0
        torch.testing.assert_close(kv[0], kv[1], rtol=1e-4, atol=1e-5)
    decode = DecodeEngine(chunked, DisaggConfig(role="decode", remote_cache_blocks=1, local_kv_blocks=48))
    for i, ids in enumerate(ids_list):
        decode.add_request(ids, GREEDY, str(i), kv_transfer_params=prefill.exporter.params_of(f"p{i}"))
    run(decode)
    got = [decode.requests[str(i)].output_token_ids for i in range(len(ids_list))]
    assert got == single_instance(chunked, ids_list)
