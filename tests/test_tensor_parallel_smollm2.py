"""Tensor parallelism on the real SmolLM2 (9 query heads, 3 KV heads): TP3 on the CPU (gloo), one KV
head per rank, against the same engine in one process, in dense, quest and oasis modes (fp32)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.models.loader import embedded_default_path, read_hf_config

PROMPTS = ["The numbers are " + ", ".join(str(i) for i in range(40)),
           "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to "
           "do: once or twice she had peeped into the book her sister was reading, but it had no pictures"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KV = {"dense": {}, "quest": {}, "oasis": {"fetch_cap": 0.25, "host_kv_gb": 0.05}}


@pytest.fixture(scope="module")
def smollm2(smollm_llm, tmp_path_factory) -> tuple[str, list[list[int]]]:
    """The embedded model as a Hugging Face directory (weights only: every rank loads it in a second,
    not the GGUF), and the prompts as token ids."""
    path = tmp_path_factory.mktemp("smollm2")
    (path / "config.json").write_text(json.dumps(read_hf_config("gguf", embedded_default_path())))
    save_file({k: v.contiguous() for k, v in smollm_llm.engine.model.state_dict().items()},
              str(path / "model.safetensors"))
    return str(path), [smollm_llm.tokenizer.encode(p) for p in PROMPTS]


def generate(model: str, prompts: list[list[int]], mode: str, tp: int) -> tuple[list[list[int]], int]:
    kv = KVConfig(mode=mode, budget=64, sink_blocks=1, local_blocks=1, **KV[mode])
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", show_progress=False, tensor_parallel_size=tp,
                                    kv=kv, cache=CacheConfig(kv_cache_gb=0.1),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=256)))
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({r.request_id: r.output_token_ids for r in engine.step()})
    selected = engine.stats_dict().get("kv_selected_blocks", 0)
    engine.close()
    return [done[i] for i in ids], selected


@pytest.mark.filterwarnings("ignore:.*has no tokenizer files")
@pytest.mark.parametrize("mode", ["dense", "quest", "oasis"])
def test_tp3_equals_one_process(smollm2, mode):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # three ranks share the CPU cores
    try:
        want, want_selected = generate(*smollm2, mode, 1)
        got, got_selected = generate(*smollm2, mode, 3)
    finally:
        torch.set_num_threads(threads)
    assert got == want
    assert got_selected == want_selected and (mode == "dense" or got_selected > 0)
