"""`oasiskv bench hf-reference`: dense decoding outside our engine, to show that our dense is no strawman.

transformers' `generate` with its static KV cache (`cache_implementation="static"`), greedy, on a model with
random weights built from the same config (as --load-format dummy does), on the same workload: B random-token
prompts (the same seed as `bench throughput`) of input_len tokens, exactly output_len new tokens each. B is
the largest batch that fits the memory cap (--gpu-memory-gb; found by trying, halving on out-of-memory)
unless --batch is given. Printed in the units of `bench throughput`: requests/s, output and total tok/s over
the whole generate call (prefill included), and decode tok/s from the time the decode steps took (the
whole call minus a prefill-only call at the same batch).
"""
from __future__ import annotations

import argparse
import time

import torch

from oasiskv.bench.report import print_table, sig, write_json
from oasiskv.bench.workload import random_prompts
from oasiskv.config import BenchConfig, CacheConfig
from oasiskv.engine.engine import pick_device, pick_dtype
from oasiskv.kv.host_store import spare_host_bytes
from oasiskv.models.loader import model_config_of, read_hf_config, resolve_source

GiB = 1 << 30


def add_args(p: argparse.ArgumentParser) -> None:
    d, c = BenchConfig(), CacheConfig()
    p.add_argument("--model", default="qwen3-8b", help="a shipped config name or an HF directory (its config only)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    p.add_argument("--prompt-seed", type=int, default=d.prompt_seed)
    p.add_argument("--input-len", type=int, default=d.input_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--batch", type=int, default=None, help="default: the largest that fits (GPU only)")
    p.add_argument("--gpu-memory-gb", type=float, default=c.gpu_memory_gb, help="cap on the GPU memory used")
    p.add_argument("--json", default=None)


def build_model(model: str, device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = read_hf_config(*resolve_source(model))
    cfg = AutoConfig.for_model(**hf)
    check_room(model, cfg, device, dtype)
    torch.manual_seed(seed)
    with torch.device(device):
        net = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return net.eval(), cfg


def check_room(model: str, cfg, device: torch.device, dtype: torch.dtype) -> None:
    """Refuses a model whose weights alone do not fit the device's free memory (the kernel would kill the process
    without a word on the CPU)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        weights = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters()) * dtype.itemsize
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else spare_host_bytes(reserve_gb=1.0)
    if weights > free:
        raise SystemExit(f"error: {model}'s weights take {weights / GiB:.1f} GiB in {str(dtype).removeprefix('torch.')}"
                         f"; this {device.type} has {free / GiB:.1f} GiB free. Pick a smaller --model "
                         "(e.g. qwen3-0.6b) or another device")


def kv_bytes_per_request(cfg, tokens: int, dtype: torch.dtype) -> int:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * tokens * dtype.itemsize


def generate(net, prompts: torch.Tensor, new_tokens: int) -> float:
    """Seconds of one greedy generate call that makes exactly new_tokens tokens per prompt."""
    sync = torch.cuda.synchronize if prompts.is_cuda else (lambda: None)
    sync()
    t = time.perf_counter()
    with torch.inference_mode():
        out = net.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                           pad_token_id=0)
    sync()
    if out.shape[1] != prompts.shape[1] + new_tokens:
        raise RuntimeError(f"generate made {out.shape[1] - prompts.shape[1]} tokens, not {new_tokens}")
    return time.perf_counter() - t


def largest_batch(net, cfg, args, device, dtype) -> int:
    """Starts from what the KV memory alone allows and halves on out-of-memory (a short generate each)."""
    free = args.gpu_memory_gb * GiB - torch.cuda.memory_allocated(device)
    batch = max(1, int(free // kv_bytes_per_request(cfg, args.input_len + args.output_len, dtype)))
    while True:
        try:
            generate(net, prompt_tensor(batch, args, cfg, device), 2)
            return batch
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise SystemExit("error: not one request fits the memory cap; raise --gpu-memory-gb")
            batch //= 2
            torch.cuda.empty_cache()


def prompt_tensor(batch: int, args, cfg, device) -> torch.Tensor:
    return torch.tensor(random_prompts(batch, args.input_len, cfg.vocab_size, args.prompt_seed), device=device)


def check_args(args, device: torch.device) -> None:
    """Sizes and the model's context, before any weights are made."""
    if args.input_len < 1:
        raise SystemExit(f"error: --input-len must be at least 1, got {args.input_len}")
    if args.output_len < 2:
        raise SystemExit("error: --output-len must be at least 2 (decode time is whole minus prefill)")
    if args.batch is None and device.type != "cuda":
        raise SystemExit("error: give --batch on the CPU (the largest batch that fits is found on the GPU)")
    if args.batch is not None and args.batch < 1:
        raise SystemExit(f"error: --batch must be at least 1, got {args.batch}")
    try:
        context = model_config_of(args.model).max_position_embeddings
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if args.input_len + args.output_len > context:
        raise SystemExit(f"error: --input-len + --output-len ({args.input_len + args.output_len}) is longer than the "
                         f"model's {context} tokens")


def run(args) -> dict:
    try:
        device = pick_device(args.device)
        dtype = pick_dtype(args.dtype, device)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    check_args(args, device)
    net, cfg = build_model(args.model, device, dtype, args.seed)
    if device.type == "cuda" and args.gpu_memory_gb:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gb * GiB / total),
                                                  torch.cuda.current_device())
    batch = args.batch or largest_batch(net, cfg, args, device, dtype)
    prompts = prompt_tensor(batch, args, cfg, device)
    generate(net, prompts, 2)  # warm-up at this batch
    prefill_s = generate(net, prompts, 1)
    total_s = generate(net, prompts, args.output_len)
    decode_s = total_s - prefill_s
    n_out, n_in = batch * args.output_len, batch * args.input_len
    row = {"mode": "hf-generate-static", "batch": batch, "input_len": args.input_len, "output_len": args.output_len,
           "elapsed_s": sig(total_s, 6), "requests_per_s": sig(batch / total_s, 6),
           "output_tok_s": sig(n_out / total_s, 6), "total_tok_s": sig((n_in + n_out) / total_s, 6),
           "prefill_s": sig(prefill_s, 6), "mean_tpot_ms": sig(1000 * decode_s / (args.output_len - 1), 6),
           "decode_tok_s": sig(batch * (args.output_len - 1) / decode_s, 6)}
    print_table([row], tuple(row))
    result = {"kind": "hf_reference", "model": args.model, "dtype": str(dtype), "gpu_memory_gb": args.gpu_memory_gb,
              "prompt_seed": args.prompt_seed, "rows": [row]}
    if args.json:
        write_json(args.json, result, device)
    return result
