"""Flags (and LLM keyword arguments) a user can get wrong end in one clear error, not a traceback (flags checked
before the weights load do not wait for them)."""
from __future__ import annotations

import re

import pytest
import torch

from oasiskv.cli import main

GENERATE = ["generate", "--prompt", "hi", "--max-tokens", "2"]
BENCH = ["bench", "throughput", "--input-len", "64", "--output-len", "4"]
NOWHERE = "/proc/no-such-dir/out.json"  # (its directory cannot be made, by root either)
CASES = [
    (GENERATE + ["--num-kv-blocks", "-4"], "at least one block, got --num-kv-blocks -4"),
    (GENERATE + ["--device", "banana"], "--device must be auto, cpu or cuda"),
    (GENERATE + ["--kv-mode", "quest", "--kv-budget", "256", "--dense-layers", "-1"],
     "--dense-layers must be at least 0"),
    (GENERATE + ["--kv-mode", "retrieval", "--host-kv-gb", "-1"], "--host-kv-gb must be above 0"),
    (["generate", "--prompt", "hi", "--max-tokens", "-3"], "max_tokens must be >= 1, got -3"),
    (GENERATE + ["--stop", ""], "empty string"),
    (GENERATE + ["--max-model-len", "100000"], "--max-model-len 100000 is longer than the model's context of 8192"),
    (GENERATE + ["--kv-mode", "retrieval", "--kv-budget", "100000"],
     r"has room for \d+ KV blocks: .*\(--kv-budget 100000 is beyond --max-model-len 8192\); lower --kv-budget"),
    (["bench", "throughput", "--batch-sizes", "a,b"], "--batch-sizes takes comma-separated counts"),
    (["bench", "throughput", "--batch-sizes", "0"], "--batch-sizes must be at least 1"),
    (["bench", "throughput", "--input-len", "100000", "--output-len", "2", "--batch-sizes", "1"],
     r"--input-len \+ --output-len \(100002\) is longer than the model's 8192 tokens"),
    # found only after minutes of measuring (or after the weights loaded), which the run then lost
    (BENCH + ["--modes", "dense,quest", "--json", NOWHERE], f"--json {NOWHERE}: cannot write there"),
    (BENCH + ["--json", "/"], "--json /: cannot write there"),
    (["eval", "--quick", "--json", NOWHERE], f"--json {NOWHERE}: cannot write there"),
    (["bench", "kernels", "--json", NOWHERE], f"--json {NOWHERE}: cannot write there"),
    (BENCH + ["--modes", "dense,quest,oasis", "--kv-budget", "128"],
     r"^error: oasis: --fetch-cap 0.05 x --kv-budget 128"),
    (BENCH + ["--modes", "dense,quest", "--kv-budget", "32"], r"^error: quest: sink \(1\) \+ local \(4\) blocks"),
    (BENCH + ["--sweep-fetch-cap", "0.05,0"], r"^error: oasis: --fetch-cap must be in \(0, 1\], got 0.0"),
    (BENCH + ["--modes", "dense", "--compare-to", "/no-such-file.json"], "cannot read --compare-to /no-such-file.json"),
    (BENCH + ["--modes", "dense", "--prompt-corpus", "nosuch"], "--prompt-corpus must be one of"),
    (BENCH + ["--plot", "x.png"], "--plot applies to --modes or a sweep"),
    (BENCH + ["--model", "/no-such-dir/model.gguf"], "model '/no-such-dir/model.gguf' not found"),
    (BENCH + ["--sweep-concurrency", "0,-1"], "--sweep-concurrency takes counts of at least 1"),
    (BENCH + ["--warmup-steps", "-3"], "--warmup-steps must be at least 0"),
    (BENCH + ["--modes", "dense", "--hbm-gbps", "-5"], "--hbm-gbps must be above 0"),
    (["eval", "--quick", "--modes", "oasis", "--fetch-cap", "0"], r"--fetch-cap must be in \(0, 1\], got 0"),
    (["eval", "--quick", "--modes", "quest,bogus"], "--modes takes modes among .*, got 'bogus'"),
    (["eval", "--quick", "--modes", "dense", "--plot", "x.png"], "--plot draws each mode's drop against dense"),
    # tracebacks before
    (["bench", "kernels", "--batches", "foo"], "--batches takes comma-separated counts, got 'foo'"),
    (["bench", "kernels", "--batches", "0"], "--batches must be counts of at least 1"),
    (["bench", "kernels", "--chunks", "0"], "--chunks must be at least 1"),
    (["bench", "kernels", "--q-heads", "5", "--kv-heads", "2"], "--q-heads must be a positive multiple of --kv-heads"),
    (["bench", "kernels", "--shortlist", "-1"], r"--shortlist must be at least 1 \(times the budget\)"),
    (["bench", "hf-reference", "--model", "/no-such-dir", "--batch", "1"], "model '/no-such-dir' not found"),
    (["bench", "hf-reference", "--model", "qwen3-0.6b", "--batch", "0"], "--batch must be at least 1"),
    (["bench", "hf-reference", "--batch", "1", "--input-len", "-3"], "--input-len must be at least 1"),
    (["bench", "hf-reference", "--model", "qwen3-0.6b", "--batch", "1", "--input-len", "100000"],
     r"--input-len \+ --output-len \(100\d+\) is longer than the model's 40960 tokens"),
    # silently ignored before, a missing head directory too
    (GENERATE + ["--kv-mode", "quest", "--kv-budget", "256", "--draft", "eagle3", "--draft-model", "/tmp"],
     "--draft and --draft-model .* apply to --kv-mode oasis"),
    (GENERATE + ["--draft", "repeat"], "--kv-mode dense drafts nothing"),
    (GENERATE + ["--kv-mode", "oasis", "--speculative-config", '{"method": "eagle3", "model": "/nonexistent"}'],
     "the draft model /nonexistent is not a directory"),  # found once the target's weights had loaded
    (GENERATE + ["--speculative-config", '{"method": "ngram", "model": "/x"}'], "speculative_config must look like"),
    (["serve", "--role", "decode", "--kv-mode", "oasis", "-tp", "2"],
     "--role decode runs on one GPU: --tensor-parallel-size must be 1, got 2"),
    # ignored before: a setting of one role given to a single instance or to the other role
    (["serve", "--kv-release-timeout", "5"],
     "--kv-release-timeout is read only with --role prefill; it would be ignored without --role"),
    (["serve", "--role", "prefill", "--kv-mode", "oasis", "--remote-cache-blocks", "9"],
     "--remote-cache-blocks is read only with --role decode; it would be ignored with --role prefill"),
    (["serve", "--role", "decode", "--kv-mode", "oasis", "--kv-release-timeout", "5"],
     "--kv-release-timeout is read only with --role prefill; it would be ignored with --role decode"),
    # taken before: a NaN deadline never expired (the KV held for good) and its JSON failed every request
    (["serve", "--role", "prefill", "--kv-mode", "oasis", "--kv-release-timeout", "nan"],
     "--kv-release-timeout and --kv-read-timeout must be positive and finite, got nan"),
    (["serve", "--role", "decode", "--kv-mode", "oasis", "--kv-read-timeout", "inf"],
     "must be positive and finite, got 600.0 and inf"),
]
if not torch.cuda.is_available():
    CASES.append((GENERATE + ["--device", "cuda"], "no CUDA GPU is available here"))


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a[2:] if a[0] == "generate" else a[1:])
                                                      for a, _ in CASES])
def test_a_bad_flag_is_one_error_line(argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert str(e.value).startswith("error: ")
    assert re.search(message, str(e.value)), str(e.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_mode": "quest", "kv_budget": "256"}, "kv_budget takes int, got the string '256'"),
    ({"max_model_len": "256"}, "max_model_len takes int | None"),
    ({"no_such_flag": 1}, "unknown engine argument 'no_such_flag'"),
])
def test_llm_keyword_arguments_of_the_wrong_kind_are_named(kwargs, message):
    """LLM(**kwargs) sorts flat vLLM-style arguments into the configs; a string where a number belongs failed far
    away (`'<' not supported ...`)."""
    from oasiskv.api import split_kwargs

    with pytest.raises(TypeError, match=re.escape(message)):
        split_kwargs(kwargs)
    assert split_kwargs({"kv_mode": "quest", "kv_budget": 256, "model": "m"}).kv.budget == 256


def test_the_proxy_refuses_an_instance_url_without_a_scheme():
    """httpx takes no bare host:port: every request would have failed with a 502."""
    with pytest.raises(SystemExit, match="--prefill must be a URL such as http://127.0.0.1:8101, got '127.0.0.1:81'"):
        main(["proxy", "--prefill", "127.0.0.1:81", "--decode", "http://127.0.0.1:82", "--port", "0"])
