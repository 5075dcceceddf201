"""Shared test helpers: drive our runner by hand to read logits at every position."""
from __future__ import annotations

import torch

from oasiskv.engine.runner import ModelRunner
from oasiskv.engine.scheduler import ScheduledChunk, SchedulerOutput
from oasiskv.kv.gpu_pool import KVPool
from oasiskv.models.llama import CausalLM
from oasiskv.policies.dense import DensePolicy

BLOCK = 16


def engine_logits(model: CausalLM, token_ids: list[int], prefill_chunks: list[int]) -> torch.Tensor:
    """Logits at every position of token_ids, computed by our engine path: the prompt prefix is
    prefilled in the given chunk sizes (chunked prefill), every later token is a decode step through
    the paged KV cache. Returns [len(token_ids), vocab]."""
    cfg = model.config
    num_blocks = -(-len(token_ids) // BLOCK) + 2
    pool = KVPool(cfg, num_blocks, BLOCK, next(model.parameters()).dtype, torch.device("cpu"))
    # blocks handed out in reverse order so the block table is not the identity
    block_ids = list(range(num_blocks - 1, -1, -1))
    runner = ModelRunner(model, DensePolicy(pool, cfg.head_dim ** -0.5), BLOCK, torch.device("cpu"))
    rows, pos = [], 0
    sizes = list(prefill_chunks) + [1] * (len(token_ids) - sum(prefill_chunks))
    for n in sizes:
        chunk = ScheduledChunk("r", token_ids[pos:pos + n], pos, block_ids, sample=True)
        rows.append(runner_logits_all(runner, chunk))
        pos += n
    return torch.cat(rows)


def runner_logits_all(runner: ModelRunner, chunk: ScheduledChunk) -> torch.Tensor:
    """Logits of every token of one chunk (the engine only keeps the last; tests want all)."""
    ids, positions, meta = runner.prepare([chunk])
    runner.policy.begin_step(meta)
    with torch.inference_mode():
        hidden, _ = runner.model(ids, positions, runner.policy)
        return runner.model.logits(hidden)


def plan(chunks: list[ScheduledChunk]) -> SchedulerOutput:
    return SchedulerOutput(chunks=chunks)


def write_tiny_config(directory, model_type: str = "llama", num_layers: int = 2) -> str:
    """A random-weight model's config.json (2 layers unless told; vocab 512, hidden 64, 4 query / 2 KV heads of 16)
    in `directory`, for --model DIR --load-format dummy. Returns the directory as a string."""
    import json
    import os

    cfg = {"model_type": model_type, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
           "tie_word_embeddings": True, "eos_token_id": 2}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(directory)


def write_gguf(path, hf_model, arch: str, rope_factors: list[float] | None = None, sampling: dict | None = None,
               rope_scaling: tuple[str, float] | None = None, extra_tensors: dict | None = None) -> str:
    """A transformers model's fp32 weights as a GGUF the way llama.cpp's converter writes one: its metadata keys
    (key_length / value_length as it writes them for a config with head_dim), llama.cpp's tensor names, the q / k
    rows permuted for the llama architecture, `rope_factors` (if any) as the rope_freqs tensor, and `sampling` (if any:
    {"temp": 0.6, "top_k": 20, ...}) as general.sampling.* keys with gguf's writers, and `rope_scaling` (if any:
    ("linear", 4.0)) as the <arch>.rope.scaling.type / .factor keys; `extra_tensors` ({gguf name: tensor}) are written
    too. Returns the path."""
    import gguf

    from oasiskv.models.loader import GGUF_NAMES

    cfg, names = hf_model.config, {hf: ours for ours, hf in GGUF_NAMES.items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for name, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{name}")(value)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        writer.add_rope_scaling_factor(rope_scaling[1])
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", torch.tensor(rope_factors, dtype=torch.float32).numpy())
    for name, w in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = llama_cpp_permute(w, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if name.startswith("model.layers."):
            layer, part = name.removeprefix("model.layers.").split(".", 1)
            part, kind = part.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{names[part]}.{kind}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        writer.add_tensor(gguf_name, w.detach().float().contiguous().numpy())
    for name, w in (extra_tensors or {}).items():
        writer.add_tensor(name, w.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved (GGML's RoPE is pairwise)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
