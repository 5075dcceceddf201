"""Our model code and engine path compute what transformers computes for the same weights."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from oasiskv.models.loader import load_model
from tests.helpers import engine_logits, write_gguf

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6)

CONFIGS = {
    "llama3-rope-scaling": lambda: LlamaConfig(
        **TINY, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
    "llama-tied-mha": lambda: LlamaConfig(**{**TINY, "num_key_value_heads": 4}, tie_word_embeddings=True),
    "qwen2-bias": lambda: Qwen2Config(**TINY, rope_theta=1e6, tie_word_embeddings=False),
    "qwen3-qknorm": lambda: Qwen3Config(**{**TINY, "num_key_value_heads": 1}, rope_theta=1e6,
                                        tie_word_embeddings=True),
}


def random_hf(config):
    """A transformers model of the config, random weights (seed 0), norms included."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # make the norm weights non-trivial so a missed norm shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny_pair(request, tmp_path_factory):
    """A random transformers model saved as safetensors, and ours loaded from that directory."""
    hf = random_hf(CONFIGS[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    ours = load_model(str(path), "auto", torch.device("cpu"), torch.float32, show_progress=False)
    return hf, ours.model


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("chunks", [[70], [16, 30, 24], [1]], ids=["one-prefill", "chunked", "all-decode"])
def test_tiny_models_match_transformers(tiny_pair, chunks):
    hf, ours = tiny_pair
    ids = torch.randint(0, 300, (101,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, ids)
    got = engine_logits(ours, ids, chunks)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_tiny_greedy_generation_matches_transformers(tiny_pair):
    from oasiskv.engine.engine import LLMEngine  # noqa: F401  (engine path covered in test_generate)

    hf, ours = tiny_pair
    prompt = [5, 17, 42, 99, 3, 250, 7]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    ids = list(prompt)
    for _ in range(20):
        logits = engine_logits(ours, ids, [len(prompt)])
        ids.append(int(logits[-1].argmax()))
    assert ids[len(prompt):] == ref


def test_smollm2_gguf_logits_match_transformers(smollm_hf, smollm_llm):
    """The embedded default: our GGUF loader (dequantize + un-permute) against transformers' own."""
    tok = smollm_llm.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three rivers of Europe."}])
    ids = ids + tok.encode(" The Danube, the Rhine and the")
    ref = hf_logits(smollm_hf, ids)
    got = engine_logits(smollm_llm.engine.model, ids, [len(ids) - 8])  # prefill, then 8 decode steps
    assert (got - ref).abs().max().item() < 2e-3 * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_captured_hidden_states_match_transformers(tiny_pair):
    """The EAGLE-3 hook: hidden states after chosen layers equal transformers' hidden_states."""
    import torch.nn.functional as F

    class Causal:
        def attend(self, layer, q, k, v):
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 is_causal=True)
            return out.transpose(0, 1)

    hf, ours = tiny_pair
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True).hidden_states
        _, captured = ours(ids, torch.arange(40), Causal(), capture_layers=(0, 1))
    # hidden_states[i + 1] is the output of layer i (the last entry comes after the final norm)
    assert len(captured) == 2
    torch.testing.assert_close(captured[0], ref[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(captured[1], ref[2][0], atol=1e-4, rtol=1e-4)


def test_a_sharded_checkpoint_loads_the_files_its_index_names(tmp_path):
    """A Mistral directory holds consolidated.safetensors beside the index's shards: the same weights under other
    names, which failed the load ("has no place in the model")."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS["qwen2-bias"](), dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    save_file({"layers.0.attention.wk.weight": torch.zeros(4, 4)}, str(tmp_path / "consolidated.safetensors"))
    ours = load_model(str(tmp_path), "auto", torch.device("cpu"), torch.float32, show_progress=False)
    ids = [5, 17, 42, 99, 3]
    torch.testing.assert_close(engine_logits(ours.model, ids, [5]), hf_logits(hf, ids), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("changes, message", [
    ({"num_hidden_layers": None}, "the model's config has no num_hidden_layers"),  # a bare KeyError before
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),  # SiLU was used silently
])
def test_configs_we_cannot_run_are_clear_errors(changes, message):
    from oasiskv.config import ModelConfig

    hf = {**Qwen2Config(**TINY).to_dict(), **changes}
    hf = {k: v for k, v in hf.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(hf)


def test_a_sliding_window_shorter_than_the_context_is_refused(tmp_path):
    """Mistral 7B v0.1 attends to its last 4096 tokens; full attention past them gives other tokens (a helper saw
    logits 0.36 apart at a window of 16). Qwen2's configs name a window they do not use."""
    import json

    from oasiskv.config import CacheConfig, EngineConfig, SchedulerConfig
    from oasiskv.engine.engine import LLMEngine

    config = {**Qwen2Config(**TINY).to_dict(), "model_type": "mistral", "sliding_window": 64}
    del config["use_sliding_window"]  # Mistral's configs have none: a window named is a window used
    (tmp_path / "config.json").write_text(json.dumps(config))
    build = lambda n: LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", show_progress=False,  # noqa
                                             cache=CacheConfig(kv_cache_gb=0.01),
                                             scheduler=SchedulerConfig(max_model_len=n)))
    with pytest.raises(ValueError, match="sliding window of 64 tokens.*set --max-model-len 64 or less"):
        build(512)
    assert build(64).max_model_len == 64
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen2", "use_sliding_window": False}))
    assert build(512).max_model_len == 512


def test_a_qwen3_config_without_head_dim_takes_transformers_default():
    """transformers' Qwen3 head_dim defaults to 128, not hidden / heads (Qwen3-0.6B: 1024 / 16 = 64). (A Qwen3 GGUF's
    config has its head_dim from key_length: test_a_qwen3_gguf_takes_head_dim_from_key_length.)"""
    from oasiskv.config import ModelConfig

    sizes = {k: v for k, v in TINY.items() if k != "head_dim"}
    hf = {**sizes, "model_type": "qwen3"}
    assert ModelConfig.from_hf(hf).head_dim == Qwen3Config(**sizes).head_dim == 128


def llama3_rope_factors(cfg) -> list[float]:
    """What llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel) writes as the rope_freqs tensor for a llama3
    rope scaling: one divisor per rotary frequency."""
    s, dim = cfg.rope_parameters, cfg.head_dim
    freqs = 1.0 / (s["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old_len, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"],
                                  s["factor"])
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def assert_gguf_matches_transformers(hf, path: str) -> None:
    """Ours loaded from the GGUF at `path` gives transformers' logits (prefill, then decode steps)."""
    ours = load_model(path, "auto", torch.device("cpu"), torch.float32, show_progress=False, with_tokenizer=False)
    ids = torch.randint(0, 300, (101,), generator=torch.Generator().manual_seed(1)).tolist()
    torch.testing.assert_close(engine_logits(ours.model, ids, [70]), hf_logits(hf, ids), atol=2e-4, rtol=1e-4)


def test_a_llama3_gguf_applies_its_rope_freqs_factors(tmp_path, monkeypatch):
    """llama.cpp writes Llama 3.1 / 3.2's llama3 RoPE scaling as a rope_freqs tensor of per-frequency divisors (and no
    rope scaling key): refused before; now each inverse frequency is divided by its factor, as transformers' llama3
    scaling of the original model computes it."""
    monkeypatch.setenv("OASISKV_GGUF_CACHE", str(tmp_path / "cache"))
    hf = random_hf(CONFIGS["llama3-rope-scaling"]())
    factors = llama3_rope_factors(hf.config)
    assert factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[1] < 8.0  # each of the three kinds of band
    assert_gguf_matches_transformers(hf, write_gguf(tmp_path / "llama3.gguf", hf, "llama", factors))


def test_a_gguf_applies_its_linear_rope_scaling_and_refuses_yarn(tmp_path, monkeypatch):
    """llama.cpp's converter writes a linear RoPE scaling as llama.rope.scaling.type / .factor keys, which
    transformers' GGUF reader does not map: such a GGUF ran unscaled (found by a helper's audit of the models). YaRN,
    which OasisKV does not implement, is refused rather than run unscaled."""
    monkeypatch.setenv("OASISKV_GGUF_CACHE", str(tmp_path / "cache"))
    hf = random_hf(LlamaConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 4.0}))
    assert_gguf_matches_transformers(hf, write_gguf(tmp_path / "linear.gguf", hf, "llama", rope_scaling=("linear", 4.0)))
    yarn = write_gguf(tmp_path / "yarn.gguf", hf, "llama", rope_scaling=("yarn", 4.0))
    with pytest.raises(ValueError, match="llama.rope.scaling.type 'yarn' .* is not supported"):
        load_model(yarn, "auto", torch.device("cpu"), torch.float32, show_progress=False, with_tokenizer=False)


def test_a_qwen3_gguf_takes_head_dim_from_key_length(tmp_path, monkeypatch):
    """transformers' GGUF reader drops qwen3.attention.key_length, and Qwen3's head_dim is neither hidden / heads nor
    always the default 128: a head_dim of 32 loaded as 128 before (q_proj's shape did not fit)."""
    monkeypatch.setenv("OASISKV_GGUF_CACHE", str(tmp_path / "cache"))
    hf = random_hf(Qwen3Config(**{**TINY, "head_dim": 32}, rope_theta=1e6, tie_word_embeddings=False))
    assert hf.config.head_dim not in (TINY["hidden_size"] // TINY["num_attention_heads"], 128)
    assert_gguf_matches_transformers(hf, write_gguf(tmp_path / "qwen3.gguf", hf, "qwen3"))
