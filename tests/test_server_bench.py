"""`oasiskv serve` flags, engine stats as Prometheus series, and `oasiskv bench serve` against a real server."""
from __future__ import annotations

import argparse
import json

import pytest
from fastapi import FastAPI

from oasiskv.bench import serve as bench_serve
from oasiskv.cli import engine_config, parser
from oasiskv.server.app import BackgroundServer, build_app
from oasiskv.server.metrics import ServerMetrics


def test_serve_takes_the_model_and_every_engine_flag():
    args = parser().parse_args(["serve", "qwen3-0.6b", "--port", "8123", "--load-format", "dummy",
                                "--max-model-len", "512", "--max-num-seqs", "8", "--kv-mode", "quest"])
    assert args.func.__name__ == "cmd_serve" and args.model_tag == "qwen3-0.6b" and args.port == 8123
    cfg = engine_config(args)
    assert cfg.scheduler.max_model_len == 512 and cfg.scheduler.max_num_seqs == 8 and cfg.kv.mode == "quest"


def test_engine_stats_become_prometheus_series():
    snapshot = {"running": 2, "waiting": 1, "gpu_kv_usage": 0.5, "host_kv_usage": 0.25, "host_kv_bytes_used": 4096,
                "kv_blocks_used": 3,
                "stats": {"kv_mode": "oasis", "preemptions": 1, "step_time_s": 1.5, "kv_hits": 6, "kv_misses": 2,
                          "kv_agreement": 0.9, "kv_agreement_per_layer": [0.8, None], "kv_prefetch_bytes": 100,
                          "kv_fetch_cap_blocks": 6, "kv_time_gather_s": 0.25}}
    text = ServerMetrics("m").render(snapshot).decode()
    for line in ('oasiskv:num_requests_running{model_name="m"} 2.0',
                 'oasiskv:host_kv_cache_used_bytes{model_name="m"} 4096.0',
                 'oasiskv:kv_cache_usage_perc{model_name="m"} 0.5', 'oasiskv:num_preemptions_total{model_name="m"} 1.0',
                 'oasiskv:kv_hit_rate{model_name="m"} 0.75', 'oasiskv:kv_agreement{model_name="m"} 0.9',
                 'oasiskv:kv_agreement_per_layer{layer="0",model_name="m"} 0.8',
                 'oasiskv:kv_prefetch_bytes_total{model_name="m"} 100.0',
                 'oasiskv:kv_fetch_cap_blocks{model_name="m"} 6.0',
                 'oasiskv:kv_time_gather_seconds_total{model_name="m"} 0.25',
                 'oasiskv:cache_config_info{kv_mode="oasis",model_name="m"} 1.0'):
        assert line in text.splitlines(), line
    assert "# TYPE oasiskv:kv_prefetch_bytes_total counter" in text and "_created" not in text


@pytest.fixture(scope="module")
def url(smollm_llm):
    with BackgroundServer(build_app(smollm_llm.engine)) as base:
        yield base


def test_bench_serve_prints_and_saves_vllm_style_results(url, smollm_llm, tmp_path, capsys):
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
    assert saved["vocab_size"] == smollm_llm.engine.model_config.vocab_size  # prompts drawn from the model's


def test_bench_serve_says_why_when_every_request_failed(url, smollm_llm, tmp_path, capsys):
    """Prompts past the model's length: the run measured nothing, so it says the server's reason and fails (it
    printed 0.00 ms latencies and exited 0); the JSON keeps the errors."""
    p = argparse.ArgumentParser()
    bench_serve.add_args(p)
    out = tmp_path / "failed.json"
    too_long = str(smollm_llm.engine.max_model_len + 1)
    args = p.parse_args(["--base-url", url, "--random-input-len", too_long, "--random-output-len", "2",
                         "--num-prompts", "2", "--json", str(out)])
    with pytest.raises(SystemExit, match="^error: all 2 requests failed; the first error: .*maximum context length"):
        bench_serve.main(args)
    assert "failed request: " in capsys.readouterr().err
    # strict JSON: the default rate (all at once) was written as Infinity, which strict readers refuse
    saved = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert saved["failed"] == 2 and saved["request_rate"] == "inf"


def test_bench_serve_refuses_to_guess_the_vocabulary(tmp_path):
    """A server without /tokenizer_info: no silent default vocabulary (other prompts), a clear error."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "m"}]}

    p = argparse.ArgumentParser()
    bench_serve.add_args(p)
    with BackgroundServer(app) as base:
        args = p.parse_args(["--base-url", base, "--num-prompts", "1", "--random-input-len", "4",
                             "--random-output-len", "2", "--json", str(tmp_path / "r.json")])
        with pytest.raises(SystemExit, match="--vocab-size"):
            bench_serve.main(args)
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("flags, message", [
    (["--num-prompts", "0"], "--num-prompts must be at least 1, got 0"),
    (["--random-input-len", "-5"], "--random-input-len must be at least 1"),
    (["--request-rate", "-1"], "--request-rate must be above 0"),
    (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
    (["--metric-percentiles", "50,200"], "--metric-percentiles must be numbers in"),
    (["--vocab-size", "-5"], "--vocab-size must be at least 1, got -5"),
    ([], "cannot reach the server at http://127.0.0.1:1 .*is `oasiskv serve` running there"),
])
def test_bench_serve_bad_flags_and_no_server_are_clear_errors(flags, message):
    """Port 1: nothing listens there, so the flags are checked before a request, and a missing server is said."""
    p = argparse.ArgumentParser()
    bench_serve.add_args(p)
    with pytest.raises(SystemExit, match=message):
        bench_serve.main(p.parse_args(["--port", "1", *flags]))
