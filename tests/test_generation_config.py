"""--generation-config (vLLM's): the model directory's generation_config.json gives the default sampling params of
LLM.generate and of the server's requests, its max_new_tokens caps a request that names no max_tokens, and its
eos_token_id ends generation; `vllm` ignores the file, a directory names another, and a bad file is refused at
startup. Values are checked against the JSON file written here."""
from __future__ import annotations

import json

import httpx
import pytest

from oasiskv.api import LLM
from oasiskv.config import SamplingParams
from oasiskv.server.app import BackgroundServer, build_app
from oasiskv.server.job import sampling_params
from oasiskv.server.protocol import CompletionRequest
from tests.helpers import write_gguf, write_tiny_config

FILE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 5, "do_sample": True, "eos_token_id": [2, 9]}


def model_with(tmp_path, generation: dict | None) -> str:
    model = write_tiny_config(tmp_path / "model")
    if generation is not None:
        (tmp_path / "model" / "generation_config.json").write_text(json.dumps(generation))
    return model


def tiny_llm(model: str, **kwargs) -> LLM:
    return LLM(model=model, load_format="dummy", show_progress=False, kv_cache_gb=0.01, **kwargs)


def test_the_model_files_values_are_the_default_sampling_params(tmp_path):
    llm = tiny_llm(model_with(tmp_path, FILE))
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.95, 20, 5)
    assert {2, 9} <= llm.llm_engine.eos_token_ids
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0]  # no params: the model's (16 tokens otherwise)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"  # (these weights emit no EOS in 5 tokens)
    nine = SamplingParams(max_tokens=5, logit_bias={9: 100.0})  # token 9 each step: the file's EOS, not config.json's
    stopped = llm.generate([[5, 6, 7]], nine, use_tqdm=False)[0].outputs[0]
    assert (list(stopped.token_ids), stopped.finish_reason) == ([9], "stop")
    plain = tiny_llm(model_with(tmp_path / "plain", None)).generate([[5, 6, 7]], nine, use_tqdm=False)[0].outputs[0]
    assert (list(plain.token_ids), plain.finish_reason) == ([9] * 5, "length")


def test_vllm_ignores_the_file_and_a_directory_names_another(tmp_path):
    model = model_with(tmp_path, FILE)
    assert tiny_llm(model, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert tiny_llm(model, generation_config=str(other)).get_default_sampling_params().temperature == 0.3
    assert tiny_llm(model_with(tmp_path / "plain", None)).get_default_sampling_params() == SamplingParams()


def test_a_missing_or_bad_file_is_refused_before_any_weights(tmp_path, monkeypatch):
    from oasiskv.models import loader

    monkeypatch.setattr(loader, "empty_model", lambda *a: pytest.fail("built the model first"))
    model = model_with(tmp_path, {"temperature": -1.0})
    with pytest.raises(ValueError, match="generation_config.json: temperature must be >= 0"):
        tiny_llm(model)
    with pytest.raises(FileNotFoundError, match="--generation-config .*nowhere: no generation_config.json there"):
        tiny_llm(model, generation_config=str(tmp_path / "nowhere"))


def test_a_ggufs_recommended_sampler_settings_are_its_defaults(tmp_path, monkeypatch):
    """llama.cpp's general.sampling.* keys (written with gguf's own writer): temp, top_p, top_k and min_p are the
    defaults under auto; penalty_repeat is not (llama.cpp applies it to a window of the last tokens); vllm ignores
    them; a bad value is refused naming the file."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from oasiskv.models.generation_config import generation_defaults

    monkeypatch.setenv("OASISKV_GGUF_CACHE", str(tmp_path / "cache"))
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    keys = {"temp": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "penalty_repeat": 1.1}
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", sampling=keys)
    found = generation_defaults("auto", "gguf", path)
    assert found.sampling == pytest.approx({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05})
    assert found.eos_token_ids == () and "general.sampling" in found.source
    assert generation_defaults("vllm", "gguf", path).sampling == {}
    assert generation_defaults("auto", "gguf", write_gguf(tmp_path / "plain.gguf", hf, "llama")).sampling == {}
    bad = write_gguf(tmp_path / "bad.gguf", hf, "llama", sampling={"temp": -1.0})
    with pytest.raises(ValueError, match="bad.gguf .general.sampling.*temperature must be >= 0"):
        generation_defaults("auto", "gguf", bad)


def test_a_request_takes_the_models_defaults_for_what_it_leaves_out():
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 5}
    left_out = sampling_params(CompletionRequest(prompt="x"), 16, 0, defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.min_p) == (0.6, 0.95, 20, 0.0)
    given = sampling_params(CompletionRequest(prompt="x", temperature=0, top_k=0, top_p=0.5), 16, 0, defaults)
    assert (given.temperature, given.top_p, given.top_k) == (0, 0.5, -1)  # top_k 0: off, as vLLM reads it
    neutral = sampling_params(CompletionRequest(prompt="x"), 16, 0, {})
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.repetition_penalty) == (1.0, 1.0, -1, 1.0)


def test_the_server_caps_max_tokens_at_the_models_max_new_tokens(tmp_path):
    llm = tiny_llm(model_with(tmp_path, {**FILE, "eos_token_id": 2}))
    with BackgroundServer(build_app(llm.llm_engine)) as url:
        body = {"prompt": [5, 6, 7], "temperature": 0, "ignore_eos": True}
        for extra, expected in (({}, 5), ({"max_tokens": 8}, 5), ({"max_tokens": 3}, 3)):  # vLLM: the least of them
            done = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=60).json()
            assert done["usage"]["completion_tokens"] == expected and done["choices"][0]["finish_reason"] == "length"
        chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}
        done = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()  # no max_tokens: the room
        assert done["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("flags, expected", [([], 5), (["--max-tokens", "3"], 3), (["--generation-config", "vllm"], 16)])
def test_the_generate_command_takes_the_models_defaults_for_flags_left_out(tmp_path, capsys, flags, expected):
    from oasiskv.cli import main

    model = model_with(tmp_path, {"max_new_tokens": 5, "temperature": 0.0})
    main(["generate", "--model", model, "--load-format", "dummy", "--prompt", "hi", "--ignore-eos", "--json",
          "--kv-cache-gb", "0.01", *flags])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["stats"]["output_tokens"] == expected
