"""add_request's checks on a random-weight model with a byte tokenizer: a refused request leaves the running ones
alone, and the message says what would fit."""
from __future__ import annotations

import json

import pytest

from oasiskv.config import CacheConfig, EngineConfig, SamplingParams as SP, SchedulerConfig
from oasiskv.engine.engine import LLMEngine


def byte_model_engine(tmp_path, vocab_size: int, max_model_len: int | None = None) -> LLMEngine:
    config = {"model_type": "llama", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", show_progress=False,
                                  cache=CacheConfig(kv_cache_gb=0.01),
                                  scheduler=SchedulerConfig(max_model_len=max_model_len)))


def test_a_text_prompt_beyond_the_vocabulary_is_refused_and_the_others_run(tmp_path):
    """The bytes of "café" (195, 169) lie beyond a 128-token vocabulary: only id-list prompts were range-checked, so
    the text was queued and the next step raised an IndexError, leaving the running request stuck (found by a
    helper's audit of the engine)."""
    engine = byte_model_engine(tmp_path, vocab_size=128)
    greedy = SP(temperature=0, max_tokens=6, ignore_eos=True)
    good = engine.add_request([5, 6, 7, 8], greedy)
    engine.step()
    with pytest.raises(ValueError, match=r"the prompt's text encodes to token ids out of range \[0, 128\): \[195, 169\]"):
        engine.add_request("caf\u00e9", greedy)
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop_finished(good).output_token_ids) == 6 and not engine.requests


def test_a_prompt_of_max_model_len_tokens_is_told_the_length_that_fits(tmp_path):
    """vLLM refuses a prompt as long as max_model_len (no room for an output token), truncate_prompt_tokens -1's
    cut included; the message says the longest prompt that runs, which does."""
    engine = byte_model_engine(tmp_path, vocab_size=256, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt has 64 tokens; max_model_len is 64, .* at most 63"):
        engine.add_request(list(range(100)), SP(temperature=0, max_tokens=1, truncate_prompt_tokens=-1))
    rid = engine.add_request(list(range(100)), SP(temperature=0, max_tokens=1, truncate_prompt_tokens=63))
    while engine.has_unfinished():
        engine.step()
    assert len(engine.requests[rid].output_token_ids) == 1
