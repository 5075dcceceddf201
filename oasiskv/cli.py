"""oasiskv generate | chat | bench. Flag defaults come from the config dataclasses."""
from __future__ import annotations

import argparse
import json
import os
import sys

from oasiskv.config import (BLOCK_SCORES, DRAFTS, KV_MODES, KV_TRANSFERS, MISS_POLICIES, ROLES, SCHEDULE_POLICIES,
                            SELECT_PER, CacheConfig, DisaggConfig, EngineConfig, KVConfig, SamplingParams,
                            SchedulerConfig, draft_of_speculative_config)
from oasiskv.models.generation_config import DEFAULTED  # flags left out take the model's values, then these

ENGINE_DEFAULTS, CACHE_DEFAULTS, SCHED_DEFAULTS, KV_DEFAULTS = (EngineConfig(), CacheConfig(), SchedulerConfig(),
                                                                KVConfig())
DISAGG_DEFAULTS = DisaggConfig()
SAMPLING_DEFAULTS = SamplingParams()
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's, as vLLM lists them


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=ENGINE_DEFAULTS.model,
                   help="HF directory, .gguf file, or qwen3-8b | qwen3-0.6b | llama-3.1-8b (with --load-format dummy); "
                        "default: the embedded SmolLM2-135M-Instruct")
    g.add_argument("--load-format", default=ENGINE_DEFAULTS.load_format, choices=["auto", "dummy"])
    g.add_argument("--generation-config", default=ENGINE_DEFAULTS.generation_config,
                   help="default sampling params: auto (the model directory's generation_config.json, if any), "
                        "vllm (the neutral ones), or a directory holding a generation_config.json")
    g.add_argument("--tokenizer", default=ENGINE_DEFAULTS.tokenizer,
                   help="another tokenizer than the model's: an HF directory or a .gguf file (a random-weight "
                        "model has none of its own)")
    g.add_argument("--dtype", default=ENGINE_DEFAULTS.dtype)
    g.add_argument("--device", default=ENGINE_DEFAULTS.device)
    g.add_argument("--seed", type=int, default=ENGINE_DEFAULTS.seed)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=ENGINE_DEFAULTS.tensor_parallel_size,
                   help="ranks (one process and one GPU each) sharing the model's heads and the KV cache")
    g.add_argument("--block-size", type=int, default=CACHE_DEFAULTS.block_size, choices=[16])
    g.add_argument("--gpu-memory-utilization", type=float, default=CACHE_DEFAULTS.gpu_memory_utilization)
    g.add_argument("--gpu-memory-gb", type=float, default=CACHE_DEFAULTS.gpu_memory_gb)
    g.add_argument("--kv-cache-gb", type=float, default=CACHE_DEFAULTS.kv_cache_gb)
    g.add_argument("--num-kv-blocks", type=int, default=CACHE_DEFAULTS.num_kv_blocks)
    g.add_argument("--max-num-seqs", type=int, default=SCHED_DEFAULTS.max_num_seqs,
                   help="requests running at once; never more than --max-num-batched-tokens")
    g.add_argument("--max-num-batched-tokens", type=int, default=SCHED_DEFAULTS.max_num_batched_tokens)
    g.add_argument("--max-model-len", type=int, default=SCHED_DEFAULTS.max_model_len)
    g.add_argument("--schedule-policy", default=SCHED_DEFAULTS.schedule_policy, choices=SCHEDULE_POLICIES,
                   help="mixed: decodes run every step beside prefill chunks; prefill-first: decodes wait while "
                        "prompts can be admitted or prefills are unfinished (pure decode steps replay CUDA graphs)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=SCHED_DEFAULTS.async_scheduling,
                   help="plan and launch each step while the last runs on the GPU (the host's work per step is "
                        "then hidden behind the GPU's; a request stopped by a token runs one step more, dropped). "
                        "Default: on where it helps and can run (a GPU, no draft source that drafts on the host)")
    g.add_argument("--enforce-eager", action="store_true", default=ENGINE_DEFAULTS.enforce_eager,
                   help="never replay CUDA graphs (on the GPU, decode-only steps replay them by default)")
    k = p.add_argument_group("sparse KV")
    k.add_argument("--kv-mode", default=KV_DEFAULTS.mode, choices=KV_MODES,
                   help="oracle: exact attention mass picks the blocks (eval only: the upper bound)")
    k.add_argument("--kv-budget", type=int, default=KV_DEFAULTS.budget, help="KV tokens per request per layer")
    k.add_argument("--sink-blocks", type=int, default=KV_DEFAULTS.sink_blocks)
    k.add_argument("--local-blocks", type=int, default=KV_DEFAULTS.local_blocks, help="counted inside the budget")
    k.add_argument("--dense-layers", type=int, default=KV_DEFAULTS.dense_layers, help="first N layers stay dense")
    k.add_argument("--block-score", default=KV_DEFAULTS.block_score, choices=BLOCK_SCORES,
                   help="how blocks are ranked: bound (Quest: upper bounds of q.k summed over heads) or mass (each "
                        "head's bounds through a softmax over the blocks, an estimate of its attention, then combined)")
    k.add_argument("--select-per", default=KV_DEFAULTS.select_per, choices=SELECT_PER,
                   help="layer: one selection per request and layer, every KV head attends to it; kv-head: each KV "
                        "head selects its own blocks with its own --kv-budget (scored by its query heads only)")
    k.add_argument("--summary-tokens", type=int, default=KV_DEFAULTS.summary_tokens,
                   help="tokens per min/max summary, a divisor of --block-size (default: the block size). A block is "
                        "ranked by its sub-blocks (bound: the best one's; mass: their sum); block_size / N times the "
                        "summaries' memory, and the same blocks move")
    k.add_argument("--layer-weights", type=layer_weights, default=KV_DEFAULTS.layer_weights, metavar="L=W[,L=W...]",
                   help="share the tokens of --kv-budget in every layer among the layers by weight (1 where not "
                        "named), e.g. 7=2.5,18=2.5 gives layers 7 and 18 2.5 times the others' budget, each rounded "
                        "down to whole blocks; retrieval and oasis keep working sets of the largest budget")
    k.add_argument("--shortlist", type=float, default=KV_DEFAULTS.shortlist, metavar="F",
                   help="quest, retrieval, oasis: a second pass (0: none). The block scores keep F times the "
                        "budget, and the exact attention mass of those blocks, in a softmax over their keys alone, "
                        "picks the budget; reads the listed keys once more a step (retrieval fetches the list; oasis "
                        "prefetches the draft's list; both keep working sets of its size)")
    k.add_argument("--working-set", type=int, default=KV_DEFAULTS.working_set,
                   help="retrieval/oasis: KV tokens per request per layer kept on the GPU (default: --kv-budget); "
                        "more keeps recently used blocks resident, so fewer selected blocks miss")
    k.add_argument("--host-kv-gb", type=float, default=KV_DEFAULTS.host_kv_gb,
                   help="host store size (default: what the machine can spare)")
    k.add_argument("--prefill-keep-tokens", type=int, default=KV_DEFAULTS.prefill_keep_tokens,
                   help="retrieval/oasis: GPU room for one prompt's earlier chunks while it is prefilled in chunks, "
                        "so its later chunks do not read them back from host memory. Taken from the GPU's room "
                        "for working sets; default: --max-model-len where a prompt can be longer than "
                        "--max-num-batched-tokens, within a tenth of that room and never the last working set's room "
                        "(0: none)")
    o = p.add_argument_group("oasis lookahead (--kv-mode oasis)")
    o.add_argument("--fetch-cap", type=float, default=KV_DEFAULTS.fetch_cap,
                   help="at most this share of the budget prefetched per request per layer per step (1: fetch-all, "
                        "no cap, and the blocks a step selects that were not prefetched are fetched too, whatever "
                        "--miss-policy says)")
    o.add_argument("--draft", default=KV_DEFAULTS.draft, choices=DRAFTS,
                   help="where the lookahead token comes from: ngram (prompt lookup), repeat, eagle3 (an EAGLE-3 head: "
                        "--draft-model, shipped for the default model), ngram+eagle3 (prompt lookup when a "
                        "suffix of 2+ tokens occurred before, else the EAGLE-3 head), target (where the last draft "
                        "came true, the target's own argmax on its row; else prompt lookup) or target+eagle3 (the "
                        "same, else the EAGLE-3 head)")
    o.add_argument("--draft-model", default=KV_DEFAULTS.draft_model,
                   help="EAGLE-3 head directory (eagle3, ngram+eagle3, target+eagle3)")
    o.add_argument("--miss-policy", default=KV_DEFAULTS.miss_policy, choices=MISS_POLICIES,
                   help="selected blocks that were not prefetched: skip them, fetch them synchronously, or fill their "
                        "places with x_t's best resident blocks outside its selection")
    o.add_argument("--speculative-config", default=None,
                   help='vLLM-style alias: \'{"method": "eagle3", "model": DIR}\' = --draft eagle3 --draft-model DIR')


def layer_weights(text: str) -> tuple[tuple[int, float], ...]:
    """--layer-weights "7=2.5,18=2" -> ((7, 2.5), (18, 2.0)); "" or "none" -> ()."""
    if text in ("", "none"):
        return ()
    try:
        return tuple((int(layer), float(weight)) for layer, weight in (p.split("=") for p in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes LAYER=WEIGHT[,LAYER=WEIGHT...], e.g. 7=2.5,18=2.5; got {text!r}")


def draft_args(args: argparse.Namespace) -> tuple[str, str | None]:
    """(--draft, --draft-model), with a vLLM --speculative-config taking their place when given."""
    if not args.speculative_config:
        return args.draft, args.draft_model
    try:
        return draft_of_speculative_config(json.loads(args.speculative_config))
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: --speculative-config is not valid JSON: {e}")
    except ValueError as e:
        raise SystemExit(f"error: --{e}")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The flags as configs; a value a config refuses (its __post_init__) is a one-line error."""
    try:
        return build_engine_config(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    cache = CacheConfig(block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                        gpu_memory_gb=args.gpu_memory_gb, kv_cache_gb=args.kv_cache_gb,
                        num_kv_blocks=args.num_kv_blocks)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=args.max_model_len, schedule_policy=args.schedule_policy,
                            async_scheduling=args.async_scheduling)
    draft, draft_model = draft_args(args)
    kv = KVConfig(mode=args.kv_mode, budget=args.kv_budget, sink_blocks=args.sink_blocks,
                  local_blocks=args.local_blocks, dense_layers=args.dense_layers, block_score=args.block_score,
                  select_per=args.select_per, summary_tokens=args.summary_tokens, layer_weights=args.layer_weights,
                  shortlist=args.shortlist, host_kv_gb=args.host_kv_gb, prefill_keep_tokens=args.prefill_keep_tokens,
                  working_set=args.working_set,
                  fetch_cap=args.fetch_cap, draft=draft, draft_model=draft_model, miss_policy=args.miss_policy)
    return EngineConfig(model=args.model, load_format=args.load_format, tokenizer=getattr(args, "tokenizer", None),
                        generation_config=getattr(args, "generation_config", ENGINE_DEFAULTS.generation_config),
                        dtype=args.dtype, device=args.device,
                        seed=args.seed, tensor_parallel_size=args.tensor_parallel_size, cache=cache, kv=kv,
                        scheduler=sched, show_progress=True, enforce_eager=args.enforce_eager)


def model_default(name: str) -> str:
    return f"default: the model's generation config, else {getattr(SAMPLING_DEFAULTS, name)}"


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=None, help=model_default("max_tokens"))
    g.add_argument("--temperature", type=float, default=None, help=model_default("temperature"))
    g.add_argument("--top-p", type=float, default=None, help=model_default("top_p"))
    g.add_argument("--top-k", type=int, default=None, help=model_default("top_k"))
    g.add_argument("--sampling-seed", type=int, default=SAMPLING_DEFAULTS.seed,
                   help="seed of this request's sampler (default: drawn from the engine's --seed)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="above 1 discourages the prompt's and output's tokens (transformers' rule; "
                        f"{model_default('repetition_penalty')})")
    g.add_argument("--presence-penalty", type=float, default=SAMPLING_DEFAULTS.presence_penalty)
    g.add_argument("--frequency-penalty", type=float, default=SAMPLING_DEFAULTS.frequency_penalty)
    g.add_argument("--min-p", type=float, default=None,
                   help=f"drop tokens below this share of the top token's probability ({model_default('min_p')})")
    g.add_argument("--min-tokens", type=int, default=SAMPLING_DEFAULTS.min_tokens,
                   help="no EOS, stop token or stop string before this many tokens")


def sampling_params(args: argparse.Namespace, model_defaults: dict | None = None) -> SamplingParams:
    """The flags' params; those left out take model_defaults (LLMEngine.generation.sampling), else SamplingParams'
    own. Called once before the weights load (bad flags fail then), and again with the model's defaults."""
    given = {name: getattr(args, name) for name in DEFAULTED if getattr(args, name) is not None}
    try:
        return SamplingParams(**{**(model_defaults or {}), **given}, seed=args.sampling_seed, stop=args.stop,
                              ignore_eos=args.ignore_eos, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


def checked_engine_config(args: argparse.Namespace) -> EngineConfig:
    """engine_config, with the KV flags checked before any weights load (a bad flag should not cost
    minutes of loading). The layer count is not known yet: --dense-layers is checked at build."""
    config = engine_config(args)
    try:
        config.kv.validate(config.cache.block_size, num_layers=sys.maxsize)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    check_draft_model(config)
    return config


def check_draft_model(config: EngineConfig) -> None:
    """A head directory that does not exist: now, not once the target has loaded."""
    model = config.kv.draft_model
    if model is not None and not os.path.isdir(model):
        raise SystemExit(f"error: the draft model {model} is not a directory (an EAGLE-3 head: config.json and "
                         "its weights)")


def build_llm(args):
    from oasiskv.api import LLM

    config = checked_engine_config(args)
    try:
        return LLM.from_config(config)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")


def cmd_generate(args) -> None:
    sampling_params(args)  # the flags checked before the weights load
    prompt = args.prompt
    if args.prompt_file:  # read before the weights load: a wrong path should not wait for them
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompt = f.read() + "\n\n" + prompt
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"error: cannot read --prompt-file: {e}")
    llm = build_llm(args)
    params = sampling_params(args, llm.engine.generation.sampling)
    try:
        if args.chat:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        if not args.json:  # (a CPU takes minutes for a long prompt: say what is running)
            print(f"generating up to {params.max_tokens or 'the model length in'} tokens "
                  f"({llm.engine.kv_description}) ...", file=sys.stderr, flush=True)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    stats = {**llm.engine.stats_dict(), "request": out.metrics, "finish_reason": out.outputs[0].finish_reason,
             "prompt_tokens": len(out.prompt_token_ids), "output_tokens": len(out.outputs[0].token_ids)}
    if args.json:
        print(json.dumps({"text": out.outputs[0].text, "token_ids": out.outputs[0].token_ids, "stats": stats}))
        return
    print(out.outputs[0].text)
    print("\n--- stats ---")
    for k, v in stats.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")


def cmd_chat(args) -> None:
    sampling_params(args)
    llm = build_llm(args)
    params = sampling_params(args, llm.engine.generation.sampling)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat with the model; an empty line or Ctrl-D ends it", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        reply = chat_turn(llm, messages, params, first=1 if args.system else 0)
        if reply is None:
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})
        print(f"model> {reply}")


def chat_turn(llm, messages: list[dict], params, first: int) -> str | None:
    """The model's reply to the conversation. Where it no longer fits --max-model-len, the oldest exchanges after
    messages[:first] (the system prompt) go, with a note; a message that cannot fit even so is refused (None)."""
    limit = llm.engine.max_model_len

    def fits(conversation: list[dict]) -> bool:
        return len(llm.tokenizer.apply_chat_template(conversation)) < limit

    try:
        if not fits(messages[:first] + messages[-1:]):
            print(f"error: this message does not fit --max-model-len {limit}; it is left out", file=sys.stderr)
            return None
        while not fits(messages):
            del messages[first:first + 2]
            print("(the conversation outgrew --max-model-len: its oldest exchange is dropped)", file=sys.stderr)
        return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def cmd_eval(args) -> None:
    from oasiskv.evals.cli import main as eval_main

    eval_main(args)


def cmd_bench_throughput(args) -> None:
    from oasiskv.bench.throughput import run_from_args

    run_from_args(args, engine_config(args))


def cmd_bench_kernels(args) -> None:
    from oasiskv.bench.kernels import run

    run(args)


def cmd_bench_hf_reference(args) -> None:
    from oasiskv.bench.hf_reference import run

    run(args)


def cmd_bench_serve(args) -> None:
    from oasiskv.bench.serve import main as bench_serve_main

    bench_serve_main(args)


def cmd_train_draft(args) -> None:
    from oasiskv.lookahead.train_draft import main as train_draft_main

    train_draft_main(args)


def cmd_serve(args) -> None:
    from oasiskv.server.app import serve

    if args.model_tag is not None:
        args.model = args.model_tag
    try:
        serve(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (vLLM's endpoints, errors and metrics)")
    serve.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="the names clients may use, the first in responses (default: the model's)")
    serve.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    add_engine_args(serve)
    add_disagg_args(serve)
    serve.set_defaults(func=cmd_serve)


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("prefill/decode disaggregation (see `oasiskv proxy`)")
    d.add_argument("--role", default=DISAGG_DEFAULTS.role, choices=ROLES,
                   help="prefill: keep each prompt's KV for a decode instance; decode: fetch it block by block")
    d.add_argument("--kv-transfer", default=DISAGG_DEFAULTS.kv_transfer, choices=KV_TRANSFERS)
    d.add_argument("--kv-release-timeout", type=float, default=DISAGG_DEFAULTS.release_timeout_s,
                   help="prefill: seconds a prompt's KV waits for its decode instance to report it done")
    d.add_argument("--kv-read-timeout", type=float, default=DISAGG_DEFAULTS.read_timeout_s,
                   help="decode: seconds one remote read may take before its request fails")
    d.add_argument("--remote-cache-blocks", type=int, default=DISAGG_DEFAULTS.remote_cache_blocks,
                   help="decode: remote blocks kept in local host memory per request and layer after a fetch")
    d.add_argument("--local-kv-blocks", type=int, default=DISAGG_DEFAULTS.local_kv_blocks,
                   help="decode: local host KV blocks (spilled tails and cached remote blocks); default: as many as "
                        "--host-kv-gb, which on a decode instance sizes the block ids (the prompts' KV it can address)")


def disagg_config(args: argparse.Namespace) -> DisaggConfig:
    return DisaggConfig(role=args.role, kv_transfer=args.kv_transfer, release_timeout_s=args.kv_release_timeout,
                        read_timeout_s=args.kv_read_timeout, remote_cache_blocks=args.remote_cache_blocks,
                        local_kv_blocks=args.local_kv_blocks)


def cmd_proxy(args) -> None:
    from oasiskv.disagg.proxy import serve_proxy

    serve_proxy(args)


def add_proxy_parser(sub) -> None:
    proxy = sub.add_parser("proxy", help="disaggregated serving: prefill on one instance, decode on another")
    proxy.add_argument("--prefill", required=True, help="URL of an `oasiskv serve --role prefill` instance")
    proxy.add_argument("--decode", required=True, help="URL of an `oasiskv serve --role decode` instance")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    proxy.set_defaults(func=cmd_proxy)


def add_bench_parser(sub) -> None:
    from oasiskv.bench.hf_reference import add_args as add_hf_reference_args
    from oasiskv.bench.kernels import add_args as add_kernels_args
    from oasiskv.bench.serve import add_args as add_bench_serve_args
    from oasiskv.bench.throughput import add_bench_args

    bench = sub.add_parser("bench", help="benchmarks: throughput (engine, offline) | serve (a running server) | "
                                         "kernels | hf-reference")
    kinds = bench.add_subparsers(dest="bench", required=True)
    throughput = kinds.add_parser("throughput", help="decode throughput at a given context length")
    add_bench_args(throughput)
    add_engine_args(throughput)
    throughput.set_defaults(func=cmd_bench_throughput)
    serve = kinds.add_parser("serve",
                             help="latency and throughput of an OpenAI-compatible server, like vllm bench serve")
    add_bench_serve_args(serve)
    serve.set_defaults(func=cmd_bench_serve)
    kernels = kinds.add_parser("kernels", help="gather, sparse attention and scoring against the copy ceilings")
    add_kernels_args(kernels)
    kernels.set_defaults(func=cmd_bench_kernels)
    hf = kinds.add_parser("hf-reference", help="transformers' generate with a static cache on the same workload")
    add_hf_reference_args(hf)
    hf.set_defaults(func=cmd_bench_hf_reference)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oasiskv", description="OasisKV inference engine")
    sub = p.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--prompt-file", default=None, help="text placed before --prompt (a long document to ask about)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats) last")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat on stdin")
    chat.add_argument("--system", default=None)
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat, max_tokens=256)
    add_bench_parser(sub)
    evaluate = sub.add_parser("eval", help="accuracy of every KV mode against dense on long texts")
    from oasiskv.evals.cli import add_args as add_eval_args

    add_eval_args(evaluate)
    evaluate.set_defaults(func=cmd_eval)
    add_serve_parser(sub)
    add_proxy_parser(sub)
    train_draft = sub.add_parser("train-draft", help="train an EAGLE-3 draft head for the target model")
    from oasiskv.lookahead.train_draft import add_args as add_train_draft_args

    add_train_draft_args(train_draft)
    train_draft.set_defaults(func=cmd_train_draft)
    return p


OUTPUT_FLAGS = {"json": "--json", "plot": "--plot", "json_path": "--json"}  # (generate's --json is a switch)


def check_output_path(path: str, flag: str) -> None:
    """Fails at once where `path` cannot be written: results are written after minutes of measuring, and a wrong
    path found then loses them. The file is created and removed again (appended to where it exists)."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        existed = os.path.exists(path)
        with open(path, "a"):
            pass
        if not existed:
            os.remove(path)
    except OSError as e:
        raise SystemExit(f"error: {flag} {path}: cannot write there: {e.strerror or e}") from None


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    for name, flag in OUTPUT_FLAGS.items():
        if isinstance(getattr(args, name, None), str):
            check_output_path(getattr(args, name), flag)
    args.func(args)


if __name__ == "__main__":
    main()
