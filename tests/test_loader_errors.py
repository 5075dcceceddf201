"""A model the loader cannot run is one clear error, given before any memory is taken for its weights (found by a
helper's audit of the loader: tracebacks, a damaged-file message for a sound file, errors naming no file)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from oasiskv.models import loader
from oasiskv.models.loader import load_model
from tests.helpers import write_gguf

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


@pytest.fixture(scope="module")
def tiny_hf():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).eval()


@pytest.fixture
def no_allocation(monkeypatch, tmp_path):
    """The GGUF cache in tmp_path; taking memory for the weights fails the test."""
    monkeypatch.setenv("OASISKV_GGUF_CACHE", str(tmp_path / "cache"))

    def allocated(*args):
        raise AssertionError("the weights' memory was taken before the error")

    monkeypatch.setattr(loader, "empty_model", allocated)


def load(path, load_format="auto", with_tokenizer=False):
    return load_model(str(path), load_format, torch.device("cpu"), torch.float32, show_progress=False,
                      with_tokenizer=with_tokenizer)


def test_a_mixture_of_experts_tensor_is_refused_by_name(tiny_hf, tmp_path, no_allocation):
    """Mixtral-style GGUFs use the llama architecture with expert tensors: a KeyError traceback after allocating."""
    path = write_gguf(tmp_path / "moe.gguf", tiny_hf, "llama", extra_tensors={"blk.0.ffn_gate_inp.weight":
                                                                                 torch.zeros(4, 64)})
    with pytest.raises(ValueError, match=r"GGUF tensor blk.0.ffn_gate_inp.weight has no place in the model "
                                         r"\(a mixture-of-experts tensor"):
        load(path)


def test_an_architecture_we_do_not_run_is_named_not_called_damaged(tiny_hf, tmp_path, no_allocation):
    path = write_gguf(tmp_path / "other.gguf", tiny_hf, "command-r")
    with pytest.raises(ValueError, match=r"GGUF architecture 'command-r' is not supported \(supported: llama"):
        load(path)


def test_a_malformed_config_names_its_file(tmp_path, no_allocation):
    (tmp_path / "config.json").write_text("{model_type: llama}")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        load(tmp_path, load_format="dummy")


def test_a_broken_tokenizer_is_refused_before_the_weights_load(tiny_hf, tmp_path, no_allocation):
    tiny_hf.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"the tokenizer files in .* cannot be read"):
        load(tmp_path, with_tokenizer=True)


def test_a_weights_file_is_told_to_give_its_directory(tiny_hf, tmp_path):
    tiny_hf.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"is a file but not a .gguf: give .* the Hugging Face directory"):
        load(tmp_path / "model.safetensors")
