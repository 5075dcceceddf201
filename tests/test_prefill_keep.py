import pytest
import torch

from oasiskv.config import KVConfig
from oasiskv.kv.prefill_keep import EXTEND, LAST, TAKE, PrefillKeep
from oasiskv.policies.base import PrefillSpan
from oasiskv.policies.factory import prefill_keep_blocks


def span(request_id: str, start: int, n: int, completes: bool, token_start: int = 0) -> PrefillSpan:
    return PrefillSpan(token_start, token_start + n, start, torch.zeros(0, dtype=torch.long), [], request_id, completes)


def keep(capacity: int = 64) -> PrefillKeep:
    return PrefillKeep(2, capacity, 1, 4, torch.float32, torch.device("cpu"))


def test_one_prompt_in_chunks_is_taken_extended_and_let_go():
    k = keep()
    assert k.plan([span("a", 0, 16, False)]) == [TAKE]
    assert k.plan([span("a", 16, 16, False)]) == [EXTEND]
    assert k.plan([span("a", 32, 10, True)]) == [LAST]
    assert (k.holder, k.held) == (None, 0)
    assert k.served == {"kept": 48, "host": 0}


def test_whole_prompts_and_second_prefills_are_not_kept():
    k = keep()
    assert k.plan([span("a", 0, 20, True)]) == [None]  # one chunk: nothing to keep
    # a's last chunk reads the keep in the step where b starts: b is not taken in that step, so b reads the host
    assert k.plan([span("a", 0, 16, False)]) == [TAKE]
    assert k.plan([span("a", 16, 4, True), span("b", 0, 12, False, 4)]) == [LAST, None]
    assert k.plan([span("b", 12, 16, False)]) == [None]
    assert k.plan([span("b", 28, 2, True)]) == [None]
    assert k.served == {"kept": 16, "host": 40}


def test_capacity_bounds_what_is_taken_and_the_last_chunk_may_pass_it():
    k = keep(32)
    assert k.plan([span("a", 0, 40, False)]) == [None]
    assert k.plan([span("b", 0, 16, False)]) == [TAKE]
    assert k.plan([span("b", 16, 24, False)]) == [LAST]  # past 32: read the keep once, store nothing more
    assert k.holder is None


def test_a_holder_starting_again_or_released_gives_the_keep_back():
    k = keep()
    k.plan([span("a", 0, 16, False)])
    assert k.plan([span("b", 0, 16, False)]) == [None]
    assert k.plan([span("a", 0, 16, False)]) == [TAKE]  # a was preempted: its first chunk again
    assert k.plan([span("a", 20, 8, True)]) == [None]  # not where the keep stopped: the host has it
    k.release("a")
    assert k.plan([span("c", 0, 8, False)]) == [TAKE]


def test_keys_and_values_put_the_prefix_before_the_chunk():
    k = keep()
    first, second = torch.randn(16, 1, 4), torch.randn(8, 1, 4)
    k.store(1, 0, first, -first)
    want = torch.cat([first, second])
    got = k.keys_and_values(1, 16, second, -second, LAST)
    torch.testing.assert_close(got[0], want, rtol=0, atol=0)
    torch.testing.assert_close(got[1], -want, rtol=0, atol=0)
    k.store(1, 16, second, -second)
    torch.testing.assert_close(k.keys_and_values(1, 16, second, -second, EXTEND)[0], want, rtol=0, atol=0)


def test_the_default_keep_is_max_model_len_where_prompts_can_be_chunked_within_a_tenth_of_the_room():
    oasis = KVConfig(mode="oasis")
    assert prefill_keep_blocks(oasis, 8192, 4096, room_blocks=10_000, width=129, bs=16) == 512
    assert prefill_keep_blocks(oasis, 4096, 4096, room_blocks=10_000, width=129, bs=16) == 0  # one chunk a prompt
    assert prefill_keep_blocks(oasis, 8192, 4096, room_blocks=1000, width=129, bs=16) == 100
    assert prefill_keep_blocks(oasis, 8192, 4096, room_blocks=140, width=129, bs=16) == 11  # one working set stays
    assert prefill_keep_blocks(oasis, 8192, 4096, room_blocks=100, width=129, bs=16) == 0
    chosen = KVConfig(mode="oasis", prefill_keep_tokens=100)
    assert prefill_keep_blocks(chosen, 8192, 4096, room_blocks=140, width=129, bs=16) == 7  # as asked, in blocks
    with pytest.raises(ValueError, match="--prefill-keep-tokens must be >= 0"):
        KVConfig(mode="oasis", prefill_keep_tokens=-1).validate(16, 2)
    with pytest.raises(ValueError, match="--prefill-keep-tokens applies to the retrieval and oasis modes"):
        KVConfig(mode="quest", prefill_keep_tokens=4096).validate(16, 2)
    KVConfig(mode="quest", prefill_keep_tokens=0).validate(16, 2)  # none: nothing to refuse
    # a bench's flags for every mode: the keep stays with the host modes
    flags = KVConfig(mode="oasis", prefill_keep_tokens=4096)
    assert flags.for_mode("dense").prefill_keep_tokens is None
    assert flags.for_mode("retrieval").prefill_keep_tokens == 4096


@pytest.mark.parametrize("mode,per,host_blocks", [("retrieval", "layer", None), ("oasis", "layer", None),
                                                  ("oasis", "kv-head", None), ("oasis", "layer", 14)])
def test_chunks_attend_to_the_keep_as_to_the_host_store(mode, per, host_blocks, tmp_path):
    """Prompts prefilled in chunks give the same tokens and logprobs, to the bit, whether later chunks read their
    prefix from the keep or from the host store; the statistics say which was read. With a host store of 14 blocks
    requests are preempted (prefills among them) and start again."""
    from oasiskv.api import LLM, SamplingParams
    from tests.helpers import write_tiny_config

    tiny = write_tiny_config(tmp_path / "tiny")
    prompts = [[(7 * i + 3 * j) % 500 + 5 for i in range(length)] for j, length in enumerate((150, 113, 40))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)

    host = {"num_kv_blocks": host_blocks} if host_blocks else {"host_kv_gb": 0.01}

    def run(keep_tokens):
        llm = LLM(tiny, load_format="dummy", show_progress=False, kv_mode=mode, kv_budget=64, sink_blocks=1,
                  local_blocks=1, fetch_cap=0.25, kv_cache_gb=0.01, max_num_batched_tokens=48, select_per=per,
                  schedule_policy="mixed", prefill_keep_tokens=keep_tokens, **host)
        outs = llm.generate(prompts, params, use_tqdm=False)
        found = [[(t, {i: lp.logprob for i, lp in row.items()}) for t, row in zip(o.outputs[0].token_ids,
                                                                               o.outputs[0].logprobs)] for o in outs]
        assert (llm.engine.stats_dict()["preemptions"] > 0) == bool(host_blocks)
        return found, llm.engine.policy.stats()

    from_host, host_stats = run(0)
    kept, keep_stats = run(None)
    assert kept == from_host
    assert host_stats["kv_prefill_prefix_tokens_kept"] == 0 and host_stats["kv_prefill_prefix_tokens_from_host"] > 0
    assert keep_stats["kv_prefill_prefix_tokens_kept"] > 0
    total = sum(host_stats[f"kv_prefill_prefix_tokens_{w}"] for w in ("kept", "from_host"))
    assert sum(keep_stats[f"kv_prefill_prefix_tokens_{w}"] for w in ("kept", "from_host")) == total


@pytest.mark.parametrize("flags, want", [([], None), (["--prefill-keep-tokens", "0"], 0),
                                         (["--prefill-keep-tokens", "8192"], 8192)])
def test_the_cli_flag_reaches_the_config(flags, want):
    import argparse

    from oasiskv.cli import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(["--kv-mode", "oasis", *flags])).kv.prefill_keep_tokens == want
