"""`oasiskv bench throughput`: every mode in one invocation, the two sweeps, the single-mode path, on a tiny
random model on the CPU. Throughputs are checked against the token counts and times they come from, and
the concurrency each mode holds against the KV memory worked out by hand."""
from __future__ import annotations

import json

import pytest

from oasiskv.bench.workload import max_concurrency
from oasiskv.cli import main
from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SchedulerConfig
from oasiskv.engine.engine import LLMEngine
from tests.helpers import write_tiny_config

IN, OUT = 128, 4
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x block x kv heads x head dim x fp32
WEIGHTS = 4 * (512 * 64 + 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64)  # fp32, tied
MODES = ("dense", "quest", "retrieval", "oasis")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_config(tmp_path_factory.mktemp("tiny"))


def bench(tiny: str, *extra: str) -> None:
    main(["bench", "throughput", "--model", tiny, "--load-format", "dummy", "--input-len", str(IN), "--output-len",
          str(OUT), "--kv-budget", "64", "--sink-blocks", "1", "--local-blocks", "1", "--fetch-cap", "0.5",
          "--kv-cache-gb", "0.002", "--host-kv-gb", "0.002", "--max-num-batched-tokens", "512",
          "--warmup-steps", "1", *extra])


def test_every_mode_holds_what_its_kv_memory_allows(tiny):
    blocks = int(0.002 * 2**30) // BLOCK_BYTES  # 262, in the GPU pool (dense, quest) or the host store
    per_request = -(-(IN + OUT) // 16)
    expected = {"dense": blocks // per_request, "quest": blocks * 16 // 17 // per_request,  # quest: summaries
                "retrieval": blocks // per_request, "oasis": blocks // per_request}
    for mode in MODES:
        cfg = EngineConfig(model=tiny, load_format="dummy", show_progress=False,
                           kv=KVConfig(mode=mode, budget=64, sink_blocks=1, local_blocks=1, host_kv_gb=0.002,
                                       fetch_cap=0.5),
                           cache=CacheConfig(kv_cache_gb=0.002), scheduler=SchedulerConfig(max_model_len=1024))
        assert max_concurrency(LLMEngine(cfg), IN, OUT) == expected[mode], mode


def test_modes_side_by_side(tiny, tmp_path, capsys):
    out = tmp_path / "modes.json"
    bench(tiny, "--modes", ",".join(MODES), "--max-num-seqs", "3", "--num-prompts", "5", "--profile-step",
          "--profile-steps", "2", "--json", str(out), "--plot", str(tmp_path / "modes.png"))
    result = json.loads(out.read_text())
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == list(MODES) and result["kind"] == "modes"
    assert (tmp_path / "modes.png").stat().st_size > 10_000
    for mode, r in rows.items():
        assert r["num_prompts"] == 5 and r["output_len"] == OUT and r["preemptions"] == 0
        assert r["max_concurrency"] == 3 and r["max_concurrency_held"] == 3  # --max-num-seqs caps every mode
        assert r["requests_per_s"] == pytest.approx(5 / r["elapsed_s"], rel=1e-3)
        assert r["output_tok_s"] == pytest.approx(5 * OUT / r["elapsed_s"], rel=1e-3)
        assert r["total_tok_s"] == pytest.approx(5 * (IN + OUT) / r["elapsed_s"], rel=1e-3)
        assert r["output_vs_dense"] == pytest.approx(r["output_tok_s"] / rows["dense"]["output_tok_s"], rel=1e-3)
        assert r["mean_tpot_ms"] > 0 and r["decode_tok_s"] > 0 and r["pure_decode_steps"] > 0
        # the time split: prefill steps, pure decode steps and the rest add up to the run
        assert r["prefill_steps"] >= 1 and r["prefill_time_s"] > 0 and r["other_time_s"] >= 0
        parts = r["prefill_time_s"] + r["pure_decode_time_s"] + r["other_time_s"]
        assert parts == pytest.approx(r["elapsed_s"], rel=1e-2)
        assert r["prefill_s_per_prompt"] == pytest.approx(r["prefill_time_s"] / 5, rel=1e-3)
        # the roofline's bytes: every weight plus at least the KV of one request, at most all of it
        weights = r["weights_gb"] * 1e9
        assert weights == pytest.approx(WEIGHTS, rel=1e-3)
        kv_most = 3 * (IN + OUT) * BLOCK_BYTES / 16  # three requests, every token
        assert weights < r["hbm_gb_per_step"] * 1e9 <= (weights + kv_most) * 1.001
        assert r["roofline_tok_s"] == pytest.approx(r["decode_batch"] * r["hbm_gbps"] / r["hbm_gb_per_step"], rel=2e-2)
        assert 0 < r["roofline_fraction"] < 1
        assert set(r["step_profile"]["phases_ms"]) >= {"attention", "scheduling", "engine loop (Python)"}
    assert rows["dense"]["pcie_gb_per_step"] == rows["quest"]["pcie_gb_per_step"] == 0
    for mode in ("retrieval", "oasis"):
        assert rows[mode]["pcie_gb_per_step"] > 0 and 0 < rows[mode]["hit_rate"] <= 1
    assert 0 <= rows["oasis"]["agreement"] <= 1 and rows["retrieval"]["agreement"] is None
    assert 0 <= rows["oasis"]["draft_accuracy"] <= 1 and rows["retrieval"]["draft_accuracy"] is None
    assert "draft: prediction + prefetch issue" in rows["oasis"]["step_profile"]["phases_ms"]
    printed = capsys.readouterr().out
    assert "Throughput:" in printed and printed.count(" steps that prefilled (") == len(MODES)


def test_compare_to_joins_an_earlier_run(tiny, tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    bench(tiny, "--modes", "dense", "--max-num-seqs", "2", "--json", str(first))
    bench(tiny, "--modes", "quest", "--max-num-seqs", "2", "--compare-to", str(first), "--json", str(second))
    rows = json.loads(second.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["dense", "quest"] and rows[0]["from"] == str(first)
    for r in rows:  # vllm bench throughput's keys as well
        assert (r["num_requests"], r["elapsed_time"], r["requests_per_second"]) == (2, r["elapsed_s"],
                                                                                   r["requests_per_s"])
        assert r["tokens_per_second"] == pytest.approx(r["total_num_tokens"] / r["elapsed_time"], rel=1e-3)
        assert r["total_num_tokens"] == 2 * (IN + OUT)
    assert rows[1]["output_vs_dense"] == pytest.approx(rows[1]["output_tok_s"] / rows[0]["output_tok_s"], rel=1e-3)


def test_modes_without_json_write_the_default_file_and_compare_to_refuses_another_workload(tiny, tmp_path,
                                                                                             monkeypatch):
    """--modes wrote no JSON without --json (a single mode wrote --out's default); --compare-to joined a run of
    another input length and divided the two runs' throughputs."""
    monkeypatch.chdir(tmp_path)
    bench(tiny, "--modes", "dense", "--max-num-seqs", "2")
    first = tmp_path / "results" / "bench_throughput.json"
    assert [r["mode"] for r in json.loads(first.read_text())["rows"]] == ["dense"]
    with pytest.raises(SystemExit, match="--compare-to .* measured another run .input_len 128 there, 64 here"):
        bench(tiny, "--modes", "quest", "--input-len", "64", "--compare-to", str(first), "--json", "b.json")


@pytest.mark.parametrize("flags, message", [
    (["--modes", "dense", "--num-prompts", "-1"], "--num-prompts must be at least 1"),
    (["--modes", "dense", "--profile-step", "--profile-steps", "0"], "--profile-steps must be at least 1"),
    (["--modes", "dense", "--max-model-len", "32"], r"--input-len \+ --output-len \(132\) is longer than the model's 32"),
    (["--modes", "dense", "--device", "bogus"], "--device must be auto, cpu or cuda"),
    (["--modes", "oasis", "--draft", "eagle3", "--draft-model", "/no/such/head"], "the draft model /no/such/head is not"),
    (["--batch-sizes", "1", "--prompt-corpus", "austen"], "--prompt-corpus applies to --modes or a sweep"),
    (["--batch-sizes", "1", "--profile-step"], "--profile-step applies to --modes or a sweep"),
    (["--modes", "dense", "--sweep-concurrency", "1", "--num-prompts", "3"], "--num-prompts does not apply to"),
])
def test_bad_flags_are_refused_before_the_weights_load(tiny, flags, message, monkeypatch):
    """Each was a traceback after the weights loaded (a ZeroDivisionError after a mode's whole workload for
    --profile-steps 0), or taken and ignored (a single mode's --prompt-corpus, --profile-step)."""
    from oasiskv.engine import engine

    monkeypatch.setattr(engine, "load_model", lambda *a, **k: pytest.fail("weights loaded before the flags' check"))
    with pytest.raises(SystemExit, match=message):
        bench(tiny, *flags)


def test_concurrency_sweep(tiny, tmp_path):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    bench(tiny, "--modes", "dense,oasis", "--max-num-seqs", "4", "--sweep-concurrency", "1,2,8", "--json", str(out),
          "--plot", str(png))
    rows = json.loads(out.read_text())["rows"]
    measured = [(r["mode"], r["concurrency"]) for r in rows if "skipped" not in r]
    assert measured == [("dense", 1), ("dense", 2), ("dense", 4), ("oasis", 1), ("oasis", 2), ("oasis", 4)]
    assert [(r["mode"], r["concurrency"]) for r in rows if "skipped" in r] == [("dense", 8), ("oasis", 8)]
    for r in rows:
        if "skipped" not in r:
            assert r["num_prompts"] == r["concurrency"] == r["max_concurrency_held"]
            assert r["output_tok_s"] == pytest.approx(r["concurrency"] * OUT / r["elapsed_s"], rel=1e-3)
    assert png.stat().st_size > 10_000


def test_fetch_cap_sweep(tiny, tmp_path):
    out = tmp_path / "caps.json"
    bench(tiny, "--sweep-fetch-cap", "0.25,1", "--max-num-seqs", "2", "--json", str(out), "--plot",
          str(tmp_path / "caps.png"))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["fetch_cap"], r["mode"]) for r in rows] == [(0.25, "oasis"), (1.0, "oasis")]
    for r in rows:
        assert r["pcie_gb_per_step"] >= r["prefetch_gb_per_step"] > 0 and 0 <= r["agreement"] <= 1
        assert r["pcie_gbps"] == pytest.approx(r["pcie_gb_per_step"] / r["decode_step_ms"] * 1000, rel=1e-3)
        # no CUDA graphs on the CPU: every step is eager, and every prefetch is waited for on the critical path
        assert r["eager_steps"] >= r["pure_decode_steps"] and r["prefetch_exposed_ms_per_eager_step"] > 0
    assert (tmp_path / "caps.png").stat().st_size > 10_000


def test_single_mode_batches_still_work(tiny, tmp_path):
    out = tmp_path / "single.json"
    bench(tiny, "--kv-mode", "quest", "--batch-sizes", "1,2", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["batch"], r["decode_steps"]) for r in rows] == [("quest", 1, OUT), ("quest", 2, OUT)]
    assert all(r["replay_steps"] == 0 and r["replay_step_ms"] is None for r in rows)  # no CUDA graphs on the CPU


def test_bad_lists_get_clear_errors(tiny):
    with pytest.raises(SystemExit, match="--modes takes distinct modes"):
        bench(tiny, "--modes", "dense,fast")
    with pytest.raises(SystemExit, match="--sweep-concurrency must be a comma-separated list of ints"):
        bench(tiny, "--sweep-concurrency", "1,many")
    with pytest.raises(SystemExit, match="--input-len and --output-len must be at least 1, got 0 and"):
        bench(tiny, "--modes", "dense", "--input-len", "0")
    with pytest.raises(SystemExit, match="must be at least 1, got 64 and -2"):
        bench(tiny, "--input-len", "64", "--output-len", "-2")


def test_async_scheduling_runs_every_mode(tiny, tmp_path):
    """--async-scheduling reaches the engine through the bench's flags and is recorded with the result."""
    out = tmp_path / "async.json"
    bench(tiny, "--modes", ",".join(MODES), "--max-num-seqs", "3", "--num-prompts", "4", "--async-scheduling",
          "--json", str(out))
    result = json.loads(out.read_text())
    assert result["config"]["scheduler"]["async_scheduling"] is True
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == list(MODES)
    for r in rows.values():
        assert r["num_prompts"] == 4 and r["output_tok_s"] == pytest.approx(4 * OUT / r["elapsed_s"], rel=1e-3)
    assert 0 <= rows["oasis"]["draft_accuracy"] <= 1


def test_corpus_prompts_are_seeded_windows_of_the_text():
    from oasiskv.bench.workload import workload_prompts
    from oasiskv.evals.texts import builtin_sample
    from oasiskv.models.tokenizer import ByteTokenizer

    class Engine:  # what workload_prompts reads: the tokenizer (bytes: a window is a substring of the text)
        tokenizer = ByteTokenizer()

    text = builtin_sample()
    first = workload_prompts(Engine, 3, 200, seed=7, corpus="sample")
    assert first == workload_prompts(Engine, 3, 200, seed=7, corpus="sample")
    assert first != workload_prompts(Engine, 3, 200, seed=8, corpus="sample")
    for ids in first:
        assert len(ids) == 200 and bytes(ids).decode("utf-8", errors="ignore")[8:-8] in text
    with pytest.raises(ValueError, match="unknown corpus"):
        workload_prompts(Engine, 1, 200, seed=0, corpus="nonesuch")


def test_prompt_corpus_and_fill_reach_the_rows(tiny, tmp_path):
    out = tmp_path / "fill.json"
    bench(tiny, "--modes", "dense,oasis", "--max-num-seqs", "2", "--prompt-corpus", "sample", "--miss-policy", "fill",
          "--output-len", "24", "--json", str(out))  # beyond the cold first step: misses left out, to fill
    result = json.loads(out.read_text())
    rows = {r["mode"]: r for r in result["rows"]}
    assert result["workload"]["prompt_corpus"] == "sample" and "partial" not in result
    assert rows["oasis"]["miss_policy"] == "fill" and "miss_policy" not in rows["dense"]
    assert 0 < rows["oasis"]["fill_rate"] <= 1 and rows["dense"]["fill_rate"] is None
    with pytest.raises(SystemExit, match="--prompt-corpus must be one of .*got 'nonesuch'"):  # before any measuring
        bench(tiny, "--modes", "dense", "--prompt-corpus", "nonesuch")


def test_a_run_cut_short_keeps_the_modes_it_finished(tiny, tmp_path, monkeypatch):
    """Each engine's row is written as soon as it is measured (a device call's time limit can end the run)."""
    from oasiskv.bench import modes

    measure = modes.measure_mode

    def fail_on_quest(engine, *args, **kwargs):
        if engine.policy.name == "quest":
            raise KeyboardInterrupt  # what a time limit's signal looks like from inside the run
        return measure(engine, *args, **kwargs)

    monkeypatch.setattr(modes, "measure_mode", fail_on_quest)
    out = tmp_path / "cut.json"
    with pytest.raises(KeyboardInterrupt):
        bench(tiny, "--modes", "dense,quest", "--max-num-seqs", "2", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["partial"] is True and [r["mode"] for r in result["rows"]] == ["dense"]


def test_a_shortlist_runs_with_every_mode_that_takes_one(tiny, tmp_path):
    """--shortlist 2: quest, retrieval and oasis take it, dense runs without (for_mode drops it)."""
    out = tmp_path / "listed.json"
    bench(tiny, "--modes", ",".join(MODES), "--max-num-seqs", "2", "--shortlist", "2", "--json", str(out))
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(MODES) and all(r["output_tok_s"] > 0 for r in rows.values())
    assert "working sets of 9 blocks" in rows["oasis"]["kv"]  # the list of 8 and the block a draft opens
    assert "working sets of 8 blocks" in rows["retrieval"]["kv"]  # the list of 8


@pytest.mark.parametrize("mode", ["dense", "oasis"])
def test_the_warm_up_prefills_every_chunk_shape_the_run_will(tiny, mode):
    """A long prompt's later chunks attend to prefixes of new lengths; whatever a shape costs the first time
    (cuDNN plans one per shape and process) must fall in the untimed warm-up, not on the first mode's first prompt."""
    from oasiskv.bench.workload import random_prompts, run_workload, warm_up

    cfg = EngineConfig(model=tiny, load_format="dummy", show_progress=False,
                       kv=KVConfig(mode=mode, budget=64, sink_blocks=1, local_blocks=1, host_kv_gb=0.002,
                                   fetch_cap=0.5),
                       cache=CacheConfig(kv_cache_gb=0.002),
                       scheduler=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=128,
                                                 schedule_policy="prefill-first"))
    engine = LLMEngine(cfg)
    shapes, schedule = [], engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        shapes.append({(c.start, len(c.token_ids)) for c in out.chunks if len(c.token_ids) > 1})
        return out

    engine.scheduler.schedule = recording_schedule
    warm_up(engine, input_len=512, steps=1, seed=0, batch=2)
    warmed = set().union(*shapes)
    shapes.clear()
    run_workload(engine, random_prompts(2, 512, 512, seed=0), output_len=2, concurrency=2)
    run = set().union(*shapes)
    assert {(384, 128), (256, 128), (128, 128)} <= run  # the run's prompts are chunked
    assert run <= warmed, sorted(run - warmed)
