"""`oasiskv serve` flags and `oasiskv bench serve` against a real server."""
from __future__ import annotations

import argparse
import json

import pytest

from oasiskv.bench import serve as bench_serve
from oasiskv.cli import engine_config, parser
from oasiskv.server.app import BackgroundServer, build_app


def test_serve_takes_the_model_and_every_engine_flag():
    args = parser().parse_args(["serve", "qwen3-0.6b", "--port", "8123", "--load-format", "dummy",
                                "--max-model-len", "512", "--max-num-seqs", "8", "--kv-mode", "quest"])
    assert args.func.__name__ == "cmd_serve" and args.model_tag == "qwen3-0.6b" and args.port == 8123
    cfg = engine_config(args)
    assert cfg.scheduler.max_model_len == 512 and cfg.scheduler.max_num_seqs == 8 and cfg.kv.mode == "quest"


@pytest.fixture(scope="module")
def url(smollm_llm):
    with BackgroundServer(build_app(smollm_llm.engine)) as base:
        yield base


def test_bench_serve_prints_and_saves_vllm_style_results(url, tmp_path, capsys):
    p = argparse.ArgumentParser()
    bench_serve.add_args(p)
    out = tmp_path / "result.json"
    args = p.parse_args(["--base-url", url, "--dataset", "random", "--random-input-len", "24",
                         "--random-output-len", "4", "--num-prompts", "8", "--max-concurrency", "4",
                         "--request-rate", "100", "--ignore-eos", "--json", str(out)])
    bench_serve.main(args)
    printed = capsys.readouterr().out
    for line in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):"):
        assert line in printed
    saved = json.loads(out.read_text())
    assert saved["completed"] == 8 and saved["failed"] == 0
    assert saved["total_input_tokens"] == 8 * 24 and saved["total_output_tokens"] == 8 * 4
    assert all(len(itl) == 3 for itl in saved["itls"])
    assert 0 < saved["mean_ttft_ms"] and 0 < saved["median_tpot_ms"] and saved["p99_itl_ms"] > 0
