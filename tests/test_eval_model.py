"""The eval harness on the embedded SmolLM2: teacher forcing through the engine's decode path gives
transformers' log-probs in dense mode; sparse modes really select at small budgets and equal dense
at budgets above the context; `oasiskv eval` runs end to end with sane dense scores."""
from __future__ import annotations

import json
import math

import pytest
import torch

from oasiskv.config import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig
from oasiskv.evals.forced import teacher_forced
from oasiskv.evals.harness import DENSE, Variant, build_llm, shared_weights, variant_config
from oasiskv.evals.texts import load_corpus

SCORED = 12


@pytest.fixture(scope="module")
def window(smollm_hf_tokenizer):
    return smollm_hf_tokenizer.encode(load_corpus("sample")[0])[:512]


@pytest.fixture(scope="module")
def engines():
    base = EngineConfig(show_progress=False, cache=CacheConfig(num_kv_blocks=80),
                        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=2))
    with shared_weights():
        yield {v: build_llm(variant_config(base, v)) for v in
               (DENSE, Variant("quest", 128), Variant("quest", 1024), Variant("retrieval", 128),
                Variant("oracle", 128), Variant("oracle", 1024))}


@pytest.fixture(scope="module")
def dense_scores(engines, window):
    return teacher_forced(engines[DENSE], [window], SCORED, keep_rows=True)[0]


def test_dense_teacher_forcing_equals_transformers(dense_scores, window, smollm_hf):
    with torch.inference_mode():
        logits = smollm_hf(torch.tensor([window])).logits[0].float()
    logp = torch.log_softmax(logits[len(window) - SCORED - 1: -1], dim=-1)  # rows predicting the last SCORED
    targets = torch.tensor(window[-SCORED:])
    ref = logp.gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(dense_scores.logprobs), ref, atol=2e-3, rtol=1e-3)
    assert dense_scores.top1 == logp.argmax(-1).tolist()
    ppl = math.exp(-sum(dense_scores.logprobs) / SCORED)
    assert 1 < ppl < 100


def test_budget_above_context_equals_dense(engines, window, dense_scores):
    got = teacher_forced(engines[Variant("quest", 1024)], [window], SCORED, reference=[dense_scores.rows])[0]
    assert got.top1 == dense_scores.top1
    assert max(got.kl) < 1e-6


def test_oracle_budget_above_context_generates_dense_tokens(engines, window):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    dense, oracle = (engines[v].generate([window[:200]], params, use_tqdm=False)[0].outputs[0].token_ids
                     for v in (DENSE, Variant("oracle", 1024)))
    assert oracle == dense


@pytest.fixture(scope="module")
def small_budget(engines, window, dense_scores):
    """Teacher-forced scores at 8 of 32 blocks, per mode."""
    return {mode: teacher_forced(engines[Variant(mode, 128)], [window], SCORED, reference=[dense_scores.rows])[0]
            for mode in ("quest", "retrieval", "oracle")}


def test_small_budget_really_selects_and_quest_equals_retrieval(small_budget):
    quest, retrieval = small_budget["quest"], small_budget["retrieval"]
    assert sum(quest.kl) / SCORED > 1e-3  # 8 of 32 blocks: the distribution moves
    assert quest.top1 == retrieval.top1
    torch.testing.assert_close(torch.tensor(quest.kl), torch.tensor(retrieval.kl), atol=1e-4, rtol=1e-3)


def test_oracle_is_the_upper_bound_of_selection(small_budget):
    """At the same budget the exact attention mass picks blocks better than Quest's bound: a lower
    KL from dense, while still really sparse."""
    assert 0 < sum(small_budget["oracle"].kl) < sum(small_budget["quest"].kl)


def test_eval_command_end_to_end(tmp_path, capsys):
    from oasiskv.cli import main

    out_json, out_png = tmp_path / "eval.json", tmp_path / "eval.png"
    with shared_weights():
        main(["eval", "--quick", "--corpus", "sample", "--context", "384", "--kv-budget", "96", "--modes",
              "dense,quest,oasis", "--fetch-cap", "0.05,0.1", "--tasks", "ppl,copy,niah_single,long_output",
              "--samples", "1", "--windows", "2", "--scored", "8", "--gen-tokens", "8", "--json", str(out_json),
              "--plot", str(out_png), "--save-outputs", str(tmp_path / "outputs.jsonl")])
    printed = capsys.readouterr().out
    assert "niah_single.score" in printed and "budget 96" in printed
    # 4.8 and 9.6 tokens: below one block, so the sweep skips them (and says so) instead of failing
    assert "not run (fetch cap x budget below one block): oasis@0.05 budget=96, oasis@0.1 budget=96" in printed
    results = json.loads(out_json.read_text())["results"]
    assert {r["series"] for r in results} == {"dense", "quest"}
    dense = {(r["task"], r["metric"]): r["value"] for r in results if r["mode"] == "dense"}
    assert 1 < dense[("ppl", "ppl")] < 100
    assert dense[("copy", "copy_acc")] > 80  # the second copy of a passage is predictable
    assert dense[("niah_single", "score")] == 100
    quest = [r for r in results if r["mode"] == "quest" and r["task"] == "ppl" and r["metric"] == "kl"]
    assert quest and quest[0]["value"] > 0 and quest[0]["drop"] > 0
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    check_saved_outputs(tmp_path / "outputs.jsonl", results)


def check_saved_outputs(path, results):
    """Every generated output saved once a configuration; the scores and agreements in the JSON follow from them."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted((x["variant"], x["task"]) for x in lines) == [
        ("dense", "long_output"), ("dense", "niah_single"),
        ("quest budget=96", "long_output"), ("quest budget=96", "niah_single")]
    saved = {(x["variant"], x["task"]): x for x in lines}
    value = {(r["variant"], r["task"], r["metric"]): r["value"] for r in results}
    for variant in ("dense", "quest budget=96"):
        needle = saved[(variant, "niah_single")]
        found = sum(a.lower() in needle["output"].lower() for a in needle["answers"]) / len(needle["answers"])
        assert needle["score"] == found and value[(variant, "niah_single", "score")] == 100 * found
        assert len(saved[(variant, "long_output")]["tokens"]) == 8
    dense, quest = saved[("dense", "long_output")]["tokens"], saved[("quest budget=96", "long_output")]["tokens"]
    same = [a == b for a, b in zip(quest, dense)]
    assert value[("quest budget=96", "long_output", "same_tokens")] == 100 * sum(same) / 8
    assert saved[("quest budget=96", "long_output")]["first_divergence"] == (same + [False]).index(False)


def test_oasis_with_a_budget_at_the_context_has_no_agreement_row(tmp_path):
    """Every block attended: no prediction, no agreement (None). The eval multiplied it and stopped after dense."""
    from oasiskv.cli import main

    out_json = tmp_path / "eval.json"
    with shared_weights():
        main(["eval", "--quick", "--corpus", "sample", "--context", "256", "--kv-budget", "512", "--modes", "oasis",
              "--tasks", "ppl", "--windows", "1", "--scored", "8", "--json", str(out_json)])
    results = json.loads(out_json.read_text())["results"]
    oasis = {(r["task"], r["metric"]): r["value"] for r in results if r["mode"] == "oasis"}
    assert oasis[("ppl", "top1_agree")] == 100 and ("lookahead", "agreement") not in oasis


def test_eval_rejects_an_outputs_file_in_a_missing_folder_before_loading(monkeypatch, tmp_path):
    from oasiskv.cli import main
    from oasiskv.evals import harness

    monkeypatch.setattr(harness, "build_llm", lambda *a: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit, match="--save-outputs: the folder .*missing does not exist"):
        main(["eval", "--quick", "--corpus", "sample", "--modes", "dense",
              "--save-outputs", str(tmp_path / "missing" / "out.jsonl")])


def test_eval_rejects_a_context_beyond_the_model_before_loading_it(monkeypatch):
    """A context past the model's 8192 tokens would size a pool for it (terabytes at 10^8): a clear error first."""
    from oasiskv.cli import main
    from oasiskv.engine import engine

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the contexts were checked")

    monkeypatch.setattr(engine, "load_model", no_loading)
    with pytest.raises(SystemExit, match="--context 99999999 is longer than the model's 8192 tokens"):
        main(["eval", "--quick", "--corpus", "sample", "--context", "1024,99999999", "--modes", "dense"])


def test_eval_rejects_a_layer_beyond_the_model_before_loading_it(monkeypatch):
    """--layer-weights was checked against 10^9 layers up front, so a layer past the model's was refused only after
    the dense anchor had run (minutes), its results lost."""
    from oasiskv.cli import main
    from oasiskv.engine import engine

    monkeypatch.setattr(engine, "load_model", lambda *a, **k: pytest.fail("weights loaded before the layers' check"))
    with pytest.raises(SystemExit, match=r"--layer-weights names each layer once, each in \[0, 29\]"):
        main(["eval", "--quick", "--corpus", "sample", "--modes", "quest", "--layer-weights", "99=2"])


@pytest.mark.parametrize("flags, message", [
    (["--modes", "oasis", "--draft", "eagle3", "--draft-model", "/no/such/head"], "the draft model /no/such/head"),
    # every oasis row skipped (the cap fetches no block of the budget): it ran dense alone, exited 0, no plot
    (["--modes", "oasis", "--kv-budget", "256", "--fetch-cap", "0.01"], "no configuration but dense can run: oasis"),
])
def test_eval_refuses_what_it_found_only_after_the_dense_anchor(monkeypatch, flags, message):
    from oasiskv.cli import main
    from oasiskv.engine import engine

    monkeypatch.setattr(engine, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(SystemExit, match=message):
        main(["eval", "--quick", "--corpus", "sample", *flags])


@pytest.mark.parametrize("flag, value", [("--samples", "0"), ("--windows", "0"), ("--context", "1024,0"),
                                         ("--scored", "-1")])
def test_eval_rejects_empty_sizes_before_loading(monkeypatch, flag, value):
    """A size of 0 divided by zero late in a run (a traceback after minutes of work): a clear error first."""
    from oasiskv.cli import main
    from oasiskv.engine import engine

    monkeypatch.setattr(engine, "load_model", lambda *a, **k: pytest.fail("weights loaded before the sizes' check"))
    with pytest.raises(SystemExit, match=f"{flag} must be at least 1"):
        main(["eval", "--quick", "--corpus", "sample", "--modes", "dense", flag, value])


@pytest.mark.parametrize("flags, message", [
    (["--kv-budget", ","], "--kv-budget lists nothing"),  # an IndexError before
    (["--context", ","], "--context lists nothing"),  # ran nothing and reported 0 contexts
    (["--tasks", "ppl,nosuch"], "--tasks takes tasks among ppl, copy, .*, got 'ppl,nosuch'"),  # after the corpus
    (["--tasks", "long_output", "--context", "512", "--gen-tokens", "600"],  # once the model had loaded
     "--gen-tokens 600 must be below the context 512"),
])
def test_eval_rejects_empty_lists_and_unknown_tasks_before_any_work(monkeypatch, flags, message):
    from oasiskv.cli import main
    from oasiskv.engine import engine
    from oasiskv.evals import texts

    monkeypatch.setattr(engine, "load_model", lambda *a, **k: pytest.fail("weights loaded before the flags' check"))
    monkeypatch.setattr(texts, "load_corpus", lambda *a, **k: pytest.fail("corpus read before the flags' check"))
    with pytest.raises(SystemExit, match=message):
        main(["eval", "--quick", "--corpus", "sample", "--modes", "dense", *flags])


def test_eval_runs_a_value_listed_twice_once():
    import argparse

    from oasiskv.evals import cli

    parser = argparse.ArgumentParser()
    cli.add_args(parser)
    args = parser.parse_args(["--kv-budget", "512,512,1024", "--context", "1024,1024", "--tasks", "ppl,ppl"])
    cli.fill_sizes(args)
    cli.check_lists(args)
    assert (args.kv_budget, args.context, args.tasks) == ([512, 1024], [1024], ["ppl"])


def test_common_words_are_one_token_of_the_model(smollm_hf_tokenizer):
    """cwe's words are each one token of SmolLM2's tokenizer, as the special sentences write them (after a space) and
    as the answer does (after its opening quote): nouns of several tokens were begun right and ended wrong."""
    from oasiskv.evals.synthetic import CWE_WORDS

    for word in CWE_WORDS:
        assert len(smollm_hf_tokenizer.encode(word, add_special_tokens=False)) == 1, word
        assert len(smollm_hf_tokenizer.encode(" " + word, add_special_tokens=False)) == 1, word
        assert len(smollm_hf_tokenizer.encode('"' + word, add_special_tokens=False)) == 2, word
    assert not [a for a in CWE_WORDS for b in CWE_WORDS if a != b and a in b]
