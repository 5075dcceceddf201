"""One offline workload through one engine, measured like `vllm bench throughput`.

N random-token prompts (seeded: every mode gets the same ones) of input_len tokens each generate exactly
output_len tokens, greedily. At most `concurrency` requests are in the engine at once (a new one is added as
one finishes), so a mode runs at the concurrency it can hold and never preempts. Reported, as vLLM does:
requests/s, output tokens/s and total (prompt + output) tokens/s over the whole run, prefill included; and
beside it the steady state: pure decode steps (no prefill chunk in them), their time per step, the HBM bytes
they must read (weights + KV, the memory roofline), PCIe bytes per step and the policy's hit rate and
agreement.
"""
from __future__ import annotations

import collections
import functools
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from oasiskv.bench.report import sig
from oasiskv.config import SamplingParams

KV_COUNTERS = ("kv_bytes_gathered", "kv_prefetch_bytes", "kv_agree_hits", "kv_agree_total", "kv_hits",
               "kv_selected_blocks", "kv_misses", "kv_misses_to_fill", "kv_filled_blocks", "kv_time_prefetch_s",
               "kv_time_prefetch_exposed_s")


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    vocab = min(vocab_size, 32000)
    return torch.randint(0, vocab, (num, input_len), generator=gen).tolist()


def corpus_prompts(num: int, input_len: int, tokenizer, corpus: str, seed: int) -> list[list[int]]:
    """num windows of input_len tokens from an evals corpus, each from a seeded random sentence start."""
    import random

    from oasiskv.evals.haystack import Haystack
    from oasiskv.evals.texts import load_corpus

    if tokenizer is None:
        raise ValueError("--prompt-corpus needs the model's tokenizer")
    hay = Haystack(load_corpus(corpus), tokenizer)
    rng = random.Random(seed)
    return [hay.window_ids(input_len, rng) for _ in range(num)]


def workload_prompts(engine, num: int, input_len: int, seed: int, corpus: str | None = None) -> list[list[int]]:
    """The prompts every mode gets: random tokens, or windows of real text (--prompt-corpus)."""
    if corpus:
        return corpus_prompts(num, input_len, engine.tokenizer, corpus, seed)
    return random_prompts(num, input_len, engine.model_config.vocab_size, seed)


def kv_bytes_read(engine, tokens: int) -> int:
    """HBM bytes one decode step reads for one request's KV, summed over the layers: every token (dense, quest's
    --dense-layers, a layer whose budget holds the whole context), else the layer's budget, its block summaries (one
    per --summary-tokens, each the size of one token's K and V) and, with --shortlist, the listed blocks' keys again.
    Oasis under --miss-policy skip attends to the resident part of its selection only: an upper bound there."""
    per_token = engine.kv_bytes_per_token
    if engine.policy.name == "dense":
        return tokens * per_token
    kv, bs, layers = engine.config.kv, engine.block_size, engine.model_config.num_layers
    blocks = -(-tokens // bs)
    summaries = blocks * (bs // (kv.summary_tokens or bs))
    read = 0.0
    for budget, dense, count in sparse_layers(kv, layers, bs):
        if dense or blocks <= budget // bs:
            read += count * tokens
        else:
            listed = kv.shortlist_blocks(budget // bs) * bs if kv.shortlist else 0
            read += count * (budget + summaries + listed / 2)  # (keys only: half a token's K and V)
    return int(read * per_token / layers)


@functools.lru_cache(maxsize=16)
def sparse_layers(kv, layers: int, block_size: int) -> tuple[tuple[int, bool, int], ...]:
    """(budget, attends densely (--dense-layers), number of such layers): kv_bytes_read runs for every request in
    every step, so the layers' budgets are worked out once."""
    kinds = collections.Counter((kv.layer_budget(layer, layers, block_size), layer < kv.dense_layers)
                                for layer in range(layers))
    return tuple((budget, dense, count) for (budget, dense), count in kinds.items())


def decode_weight_bytes(engine) -> int:
    """Weight bytes a decode step reads on each rank: every weight but an untied embedding table, of which a step
    gathers only its tokens' rows (a tied one is read whole as the output head)."""
    table, head = engine.model.model.embed_tokens.weight, engine.model.lm_head
    if head is None or head.weight is table:  # tied (the vocab-parallel head of tensor parallelism may share it)
        return engine.weights_bytes()
    return engine.weights_bytes() - table.numel() * table.element_size()


def kv_deltas(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in KV_COUNTERS if k in after}


def max_concurrency(engine, input_len: int, output_len: int) -> int:
    """Requests of this length the mode holds at once: its KV memory (GPU pool for dense and quest, host
    store for retrieval and oasis) and its running limit (working-set rows, --max-num-seqs)."""
    fit = engine.max_concurrency(input_len + output_len)
    if fit < 1:
        raise ValueError(f"{engine.policy.name}: not one request of {input_len + output_len} tokens fits the KV "
                         "memory; raise --gpu-memory-gb / --host-kv-gb or shorten the request")
    return fit


def warm_up(engine, input_len: int, steps: int, seed: int, batch: int = 1) -> None:
    """`batch` requests through prefill and decode steps together, untimed: the kernels compile here for
    the batch the run will decode (Triton specialises on its integer arguments). At least two blocks'
    worth of steps, so that steps in which drafts open blocks run too. The prompts are shorter than
    the run's, just long enough for sparse modes to select in every layer (twice the largest layer budget):
    steps where some layer attends densely run eagerly and would leave the run's graphs uncaptured.
    Before them one prompt of the run's length, prefilled alone: the later chunks of a long prompt attend to prefixes
    of new lengths, and what those shapes cost the first time (cuDNN builds a plan per shape, once per
    process) would otherwise fall on the first prompt of the first mode measured."""
    if steps < 1:
        return
    steps = max(steps, 2 * engine.block_size)
    budget = engine.config.kv.largest_budget(engine.model_config.num_layers, engine.block_size)
    length = min(input_len, 2 * budget + engine.block_size + 1)
    if input_len > length:
        prompt = random_prompts(1, input_len, engine.model_config.vocab_size, seed + 20_000)
        run_to_end(engine, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    prompts = random_prompts(batch, length, engine.model_config.vocab_size, seed + 10_000)
    run_to_end(engine, prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))


def run_to_end(engine, prompts: list[list[int]], params: SamplingParams) -> None:
    ids = [engine.add_request(p, params) for p in prompts]
    while not all(engine.requests[rid].finished for rid in ids):
        engine.step()
    for rid in ids:
        engine.pop_finished(rid)


@dataclass
class StepLog:
    """What the run saw, step by step (pure decode steps only for the byte counts)."""

    decode_steps: int = 0  # steps with only decodes in them
    decode_time_s: float = 0.0
    decode_tokens: int = 0
    hbm_bytes: int = 0  # weights + KV the pure decode steps must read
    steps_with_decodes: int = 0
    max_held: int = 0  # most requests decoding in one step
    replay_steps: int = 0  # pure decode steps replayed from a CUDA graph (no eager run, no capture)
    replay_time_s: float = 0.0
    replay_tokens: int = 0
    prefill_steps: int = 0  # steps with prompt tokens in them (and any decodes beside them)
    prefill_time_s: float = 0.0


def run_workload(engine, prompts: list[list[int]], output_len: int, concurrency: int, desc: str = "") -> dict:
    """Runs every prompt to output_len tokens with at most `concurrency` in flight. Returns the metrics."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    queue, live, done = list(prompts), [], []
    # every rank reads its weights, and KV bytes count all KV heads: the step's bytes over all GPUs
    log, weights = StepLog(), decode_weight_bytes(engine) * engine.config.tensor_parallel_size
    stats0, before = dict(engine.stats.as_dict()), engine.kv_stats()
    bar = tqdm(total=len(prompts) * output_len, desc=desc or engine.policy.name, unit="tok", leave=False)
    in_flight = None  # async scheduling: what the step launched by the last call holds (its time comes next call)
    t_start = time.perf_counter()
    while queue or live:
        while queue and len(live) < concurrency:
            live.append(engine.add_request(queue.pop(0), params))
        decoding = [engine.requests[r] for r in live
                    if engine.requests[r].num_computed_tokens >= len(engine.requests[r].prompt_token_ids)]
        kv = sum(kv_bytes_read(engine, r.num_tokens) for r in decoding)
        prefill0, decode0 = engine.stats.prefill_tokens, engine.stats.decode_tokens
        out0 = sum(len(engine.requests[r].output_token_ids) for r in live)
        replays0 = graph_replays(engine)
        t = time.perf_counter()
        finished = engine.step()
        dt = time.perf_counter() - t
        launched = StepKind(engine.stats.decode_tokens - decode0, engine.stats.prefill_tokens - prefill0,
                            weights + kv, graph_replays(engine) > replays0)
        in_flight = book_step(log, dt, launched, in_flight, overlapped=engine.in_flight is not None)
        bar.update(sum(len(engine.requests[r].output_token_ids) for r in live) - out0)
        for req in finished:
            live.remove(req.request_id)
            done.append(engine.pop_finished(req.request_id))
    elapsed = time.perf_counter() - t_start
    bar.close()
    return summarize(engine, done, log, elapsed, stats0, kv_deltas(before, engine.kv_stats()), concurrency)


def graph_replays(engine) -> int:
    graphs = engine.runner.graphs
    return graphs.counts["cuda_graph_replays"] if graphs is not None else 0


@dataclass
class StepKind:
    """What one launched step held: its decode and prefill tokens, the HBM bytes it must read, a graph replay."""

    decodes: int
    prefills: int
    step_bytes: int
    replayed: bool


def book_step(log: StepLog, dt: float, launched: StepKind, in_flight: StepKind | None,
              overlapped: bool) -> StepKind | None:
    """Books one engine.step() call's time; returns the step left in flight. With async scheduling a call launches
    step k and then waits for step k-1 on the device, so its time is step k-1's (the first call's, a launch alone,
    stays in the run's other time), and a last call that launches nothing waits for the last step."""
    if overlapped:
        if in_flight is not None:
            record_step(log, dt, in_flight)
        return launched
    if in_flight is not None:  # it landed the step in flight; anything it launched also ran in it
        record_step(log, dt, in_flight)
        dt = 0.0
    if launched.decodes or launched.prefills:
        record_step(log, dt, launched)
    return None


def record_step(log: StepLog, dt: float, step: StepKind) -> None:
    decodes, prefills, step_bytes, replayed = step.decodes, step.prefills, step.step_bytes, step.replayed
    log.max_held = max(log.max_held, decodes)
    log.steps_with_decodes += decodes > 0
    if prefills:
        log.prefill_steps += 1
        log.prefill_time_s += dt
    if decodes and not prefills:
        log.decode_steps += 1
        log.decode_time_s += dt
        log.decode_tokens += decodes
        log.hbm_bytes += step_bytes
    if replayed:
        log.replay_steps += 1
        log.replay_time_s += dt
        log.replay_tokens += decodes


def summarize(engine, done, log: StepLog, elapsed: float, stats0: dict, kv: dict, concurrency: int) -> dict:
    n_in = sum(len(r.prompt_token_ids) for r in done)
    n_out = sum(len(r.output_token_ids) for r in done)
    tpots = [(r.finish_time - r.first_token_time) / (len(r.output_token_ids) - 1)
             for r in done if len(r.output_token_ids) > 1]
    ttfts = [r.first_token_time - r.arrival_time for r in done]
    steps = max(log.steps_with_decodes, 1)
    row = {
        "mode": engine.policy.name, "num_prompts": len(done), "concurrency": concurrency,
        "max_concurrency_held": log.max_held, "input_len": len(done[0].prompt_token_ids) if done else 0,
        "output_len": max((len(r.output_token_ids) for r in done), default=0),
        "elapsed_s": sig(elapsed, 6), "requests_per_s": sig(len(done) / elapsed, 6),
        "output_tok_s": sig(n_out / elapsed, 6), "total_tok_s": sig((n_in + n_out) / elapsed, 6),
        "mean_ttft_s": round(sum(ttfts) / len(ttfts), 4) if ttfts else None,
        "mean_tpot_ms": round(1000 * sum(tpots) / len(tpots), 3) if tpots else None,
        "preemptions": engine.stats.preemptions - stats0["preemptions"],
        "pure_decode_steps": log.decode_steps,
        **time_split(log, elapsed, len(done)),
        "pcie_gb_per_step": sig(kv.get("kv_bytes_gathered", 0) / steps / 1e9),
        "prefetch_gb_per_step": sig(kv["kv_prefetch_bytes"] / steps / 1e9) if "kv_prefetch_bytes" in kv else None,
        "hit_rate": ratio(kv.get("kv_hits"), kv.get("kv_selected_blocks")),
        "agreement": ratio(kv.get("kv_agree_hits"), kv.get("kv_agree_total")),
        "fill_rate": ratio(kv.get("kv_filled_blocks"), kv.get("kv_misses_to_fill")),
        "draft_accuracy": ratio(engine.stats.draft_tokens_right - stats0["draft_tokens_right"],
                                engine.stats.draft_tokens - stats0["draft_tokens"]),
        **exposed_wait(kv, log.steps_with_decodes - log.replay_steps),
    }
    # `vllm bench throughput --output-json`'s keys too, so that scripts reading vLLM's files read these
    row.update(elapsed_time=row["elapsed_s"], num_requests=len(done), total_num_tokens=n_in + n_out,
               requests_per_second=row["requests_per_s"], tokens_per_second=row["total_tok_s"])
    row.update(steady_state(log))
    if row["decode_step_ms"]:  # the link's rate in the steady state, against the 55 GB/s pinned copy of DESIGN.md
        row["pcie_gbps"] = sig(row["pcie_gb_per_step"] / row["decode_step_ms"] * 1000)
    return row


def time_split(log: StepLog, elapsed: float, prompts: int) -> dict:
    """Where the run's time went: steps that prefilled (with any decodes beside them), pure decode steps, and the
    rest (the loop between steps, steps with neither)."""
    return {"prefill_steps": log.prefill_steps, "prefill_time_s": sig(log.prefill_time_s, 6),
            "prefill_s_per_prompt": sig(log.prefill_time_s / prompts, 4) if prompts else None,
            "pure_decode_time_s": sig(log.decode_time_s, 6),
            "other_time_s": sig(max(elapsed - log.prefill_time_s - log.decode_time_s, 0.0), 4)}


def exposed_wait(kv: dict, eager_steps: int) -> dict:
    """Time the compute stream waited for prefetches, per eager step. Only eager steps are timed: a step
    replayed from a CUDA graph waits inside the graph, where no timing event is recorded, so a
    PCIe-bound steady state shows as a replayed step time near its PCIe bytes over the link's rate
    (`pcie_gbps`), not here."""
    if "kv_prefetch_bytes" not in kv:  # not a prefetching mode
        return {}
    per_step = round(1000 * kv.get("kv_time_prefetch_exposed_s", 0.0) / eager_steps, 3) if eager_steps else None
    return {"eager_steps": eager_steps, "prefetch_exposed_ms_per_eager_step": per_step}


def steady_state(log: StepLog) -> dict:
    """Pure decode steps; and apart, those replayed from a CUDA graph (the steady state on the GPU: a new
    batch size first runs eagerly, then is captured)."""
    replays = {"replay_steps": log.replay_steps,
               "replay_step_ms": round(1000 * log.replay_time_s / log.replay_steps, 3) if log.replay_steps else None,
               "replay_tok_s": round(log.replay_tokens / log.replay_time_s, 2) if log.replay_steps else None}
    if not log.decode_steps:
        return {"decode_step_ms": None, "decode_tok_s": None, "hbm_gb_per_step": None, **replays}
    return {**replays, "decode_step_ms": round(1000 * log.decode_time_s / log.decode_steps, 3),
            "decode_tok_s": round(log.decode_tokens / log.decode_time_s, 2),
            "hbm_gb_per_step": sig(log.hbm_bytes / log.decode_steps / 1e9),
            "decode_batch": round(log.decode_tokens / log.decode_steps, 2),
            "_hbm_bytes": log.hbm_bytes, "_decode_time_s": log.decode_time_s, "_decode_tokens": log.decode_tokens}


def add_roofline(row: dict, hbm_gbps: float) -> dict:
    """Memory roofline of the pure decode steps: the bytes they must read at `hbm_gbps`, against the time
    they took. Removes the raw totals it used from the row."""
    total, secs, tokens = row.pop("_hbm_bytes", 0), row.pop("_decode_time_s", 0), row.pop("_decode_tokens", 0)
    if not secs:
        return row
    floor_s = total / (hbm_gbps * 1e9)
    row.update(hbm_gbps=sig(hbm_gbps), achieved_gbps=sig(total / secs / 1e9),
               roofline_tok_s=sig(tokens / floor_s), roofline_fraction=sig(floor_s / secs))
    return row


def ratio(a, b):
    return round(a / b, 6) if a is not None and b else None
