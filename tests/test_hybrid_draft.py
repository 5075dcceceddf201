"""The ngram+eagle3 draft: prompt lookup when a suffix of min_n+ tokens occurred before, else the EAGLE-3
head. Its proposals equal a brute-force reading of that rule; in the engine the outputs come from the
target alone; the places that refuse an EAGLE-3 head refuse it too."""
from __future__ import annotations

import os

import pytest
import torch

from oasiskv.cli import engine_config, parser
from oasiskv.config import CacheConfig, DisaggConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.lookahead.eagle3 import Eagle3Draft
from oasiskv.lookahead.factory import build_draft_source, shipped_head
from oasiskv.lookahead.hybrid import NgramEagle3Draft
from oasiskv.lookahead.ngram import NgramDraft

from tests.test_eagle3 import one_thread, random_weights, run_draft, target, write_head  # noqa: F401 (fixtures)
from tests.test_oasis import RecordingSampler

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("head")
    write_head(path, "eagle", random_weights("eagle", seed=11))
    return path


def repetitive(seed: int, n: int, alphabet: int = 6) -> list[int]:
    """Few distinct tokens: many suffixes of 2 and 3 tokens recur, some do not."""
    ids = torch.randint(0, alphabet, (n,), generator=torch.Generator().manual_seed(seed))
    return (ids * 23 % 300).tolist()


def brute_force(context: list[int], head_token: int, min_n: int, max_n: int = 3) -> tuple[int, str]:
    """The token after the latest earlier occurrence of the longest suffix of min_n..max_n tokens."""
    for n in range(max_n, min_n - 1, -1):
        for start in range(len(context) - n - 1, -1, -1):  # an earlier occurrence, some token after it
            if context[start:start + n] == context[-n:]:
                return context[start + n], "lookup"
    return head_token, "head"


@pytest.mark.parametrize("min_n", [2, 3])
def test_proposals_equal_brute_force(target, head_dir, min_n):
    _, ours = target
    requests = {"a": (repetitive(1, 48), [11, 9, 5]), "b": (repetitive(2, 40), [20])}
    head_only = run_draft(Eagle3Draft.from_dir(str(head_dir), ours), ours, requests)
    hybrid = NgramEagle3Draft(Eagle3Draft.from_dir(str(head_dir), ours), min_n=min_n)
    assert hybrid.capture_layers == hybrid.head.capture_layers
    got = run_draft(hybrid, ours, requests)
    sources = []
    for rid, (ids, sizes) in requests.items():
        first = sum(sizes) + 1  # the context of the first draft: the prompt and the token it sampled
        expected = [brute_force(ids[:first + k], h, min_n) for k, h in enumerate(head_only[rid])]
        assert got[rid] == [token for token, _ in expected], rid
        sources += [source for _, source in expected]
    assert sources.count("lookup") >= 5 and sources.count("head") >= 5, sources  # both paths are exercised
    hybrid.release("a")
    assert "a" not in hybrid.head.caches and "a" not in hybrid.ngram.tables
    assert "b" in hybrid.head.caches and "b" in hybrid.ngram.tables


def test_ngram_draft_keeps_its_fallbacks():
    """NgramDraft (what the hybrid's lookup is built from): a unigram match, else the last token."""
    assert NgramDraft().lookup("r", [4, 9, 5, 4]) == 9
    assert NgramDraft().lookup("r", [4, 9, 5, 6]) == 6
    assert NgramDraft(min_n=2).match("r", [4, 9, 5, 4]) is None


def test_min_n_is_checked(target, head_dir):
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramEagle3Draft(Eagle3Draft.from_dir(str(head_dir), target[1]), min_n=4)


# -- in the engine --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    target[0].save_pretrained(path, safe_serialization=True)
    return path


def tiny_engine(target_dir, **kv) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(target_dir), dtype="float32", device="cpu", show_progress=False,
                                  kv=KVConfig(sink_blocks=1, local_blocks=1, **kv), cache=CacheConfig(num_kv_blocks=64),
                                  scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512)))


def generate(engine: LLMEngine) -> list[list[int]]:
    prompts = [repetitive(10 + i, 90 + 17 * i, alphabet=40) for i in range(3)]
    for i, ids in enumerate(prompts):
        engine.add_request(ids, GREEDY, request_id=str(i))
    while engine.has_unfinished():
        engine.step()
    return [engine.requests[str(i)].output_token_ids for i in range(len(prompts))]


def test_engine_outputs_come_from_the_target(target_dir, head_dir):
    hybrid = dict(mode="oasis", draft="ngram+eagle3", draft_model=str(head_dir), host_kv_gb=0.01)
    dense = generate(tiny_engine(target_dir, mode="dense", budget=256))
    roomy = tiny_engine(target_dir, budget=256, fetch_cap=1.0, **hybrid)  # the budget holds every prompt
    assert isinstance(roomy.drafter, NgramEagle3Draft)
    assert roomy.runner.capture_layers == roomy.drafter.head.capture_layers == (1, 3, 4)
    assert generate(roomy) == dense
    sparse = tiny_engine(target_dir, budget=64, fetch_cap=0.25, **hybrid)  # 4 blocks of 6 to 9: blocks move
    recorder = sparse.sampler = RecordingSampler(sparse.sampler)
    generate(sparse)
    assert all(n == rows for n, rows in recorder.rows)  # one logits row per sampling request, none for drafts
    assert all(argmax == tokens for argmax, tokens in recorder.tokens)  # greedy tokens are the target's argmax
    stats = sparse.stats_dict()
    assert stats["kv_prefetched_blocks"] > 0 and stats["kv_max_prefetched_blocks"] <= stats["kv_fetch_cap_blocks"] == 1
    assert not sparse.drafter.head.caches and not sparse.drafter.ngram.tables  # finished requests were released


# -- errors -----------------------------------------------------------------------------------------------


def test_cli_takes_the_hybrid_with_a_head():
    args = parser().parse_args(["generate", "--prompt", "x", "--kv-mode", "oasis", "--draft", "ngram+eagle3",
                                "--draft-model", "/some/head"])
    kv = engine_config(args).kv
    assert (kv.draft, kv.draft_model) == ("ngram+eagle3", "/some/head")
    kv.validate(16, 30)
    with pytest.raises(ValueError, match=r"--draft-model needs --draft eagle3, ngram\+eagle3 or target\+eagle3, "
                                         r"got --draft repeat"):
        KVConfig(mode="oasis", draft="repeat", draft_model="/some/head").validate(16, 30)


def test_a_model_without_a_shipped_head_needs_draft_model(target):
    with pytest.raises(ValueError, match=r"--draft ngram\+eagle3 needs --draft-model DIR"):
        build_draft_source(KVConfig(mode="oasis", draft="ngram+eagle3"), target[1], torch.device("cpu"),
                           torch.float32, model="qwen3-0.6b")


def test_tensor_parallel_refuses_the_hybrid():
    with pytest.raises(ValueError, match=r"--draft ngram\+eagle3 is not supported with --tensor-parallel-size"):
        LLMEngine(EngineConfig(tensor_parallel_size=2, kv=KVConfig(mode="oasis", draft="ngram+eagle3")))


def test_disaggregated_decode_refuses_the_hybrid():
    pytest.importorskip("nixl_cu12")
    from oasiskv.disagg.decode import DecodeEngine

    with pytest.raises(ValueError, match=r"--role decode supports --draft ngram, repeat or target, not ngram\+eagle3"):
        DecodeEngine(EngineConfig(kv=KVConfig(mode="oasis", draft="ngram+eagle3")), DisaggConfig(role="decode"))


def test_the_embedded_model_given_by_path_gets_its_shipped_head(tmp_path):
    default = shipped_head(None)
    assert shipped_head(str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"), "ngram+eagle3") == default
    assert os.path.isfile(os.path.join(default, "config.json"))
    with pytest.raises(ValueError, match="needs --draft-model DIR"):
        shipped_head(str(tmp_path / "other.gguf"))
