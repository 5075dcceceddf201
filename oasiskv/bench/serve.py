"""`oasiskv bench serve`: an online serving benchmark against an OpenAI-compatible server, shaped like
`vllm bench serve` (random dataset, request rate, max concurrency; TTFT, TPOT, ITL in ms)."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from tqdm.auto import tqdm


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--dataset", "--dataset-name", dest="dataset", default="random", choices=["random"])
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths drawn from len * [1-r, 1+r]")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids are drawn below it (default: the server's /tokenizer_info vocab_size)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps; 1 = Poisson")
    p.add_argument("--ignore-eos", action="store_true", help="always generate the full output length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--json", dest="json_path", default=None, help="save the result as JSON here")


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def random_prompts(num: int, input_len: int, output_len: int, ratio: float, vocab: int, seed: int):
    """Token-id prompts drawn uniformly from the upper part of the vocabulary (special tokens live low)."""
    rng = random.Random(seed)
    low = min(1000, vocab // 2)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - ratio)), int(n * (1 + ratio))))

    return [([rng.randrange(low, vocab) for _ in range(length(input_len))], length(output_len)) for _ in range(num)]


async def send_one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                   ignore_eos: bool) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
    result, chunks = RequestResult(len(prompt)), 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:500]
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data, now = json.loads(line[6:]), time.perf_counter()
                if data.get("error"):
                    result.error = data["error"].get("message", "error")
                    return result
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                if data.get("choices"):
                    chunks += 1
                    if chunks == 1:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.success = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = repr(e)
    return result


async def arrivals(n: int, rate: float, burstiness: float, seed: int):
    """Yields 0..n-1 with gamma-distributed gaps of mean 1/rate (no gaps when rate is inf)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if rate != float("inf"):
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


async def run_benchmark(args) -> dict:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(6 * 3600.0),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        vocab = args.vocab_size or await server_vocab_size(client)
        prompts = random_prompts(args.num_prompts, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, vocab, args.seed)
        gate = asyncio.Semaphore(args.max_concurrency or len(prompts) or 1)

        async def limited(prompt, max_tokens):
            async with gate:
                return await send_one(client, args.endpoint, model, prompt, max_tokens, args.ignore_eos)

        bar = tqdm(total=len(prompts), desc="requests", unit="req")

        async def counted(prompt, max_tokens):
            result = await limited(prompt, max_tokens)
            bar.update(1)
            return result

        start, tasks = time.perf_counter(), []
        async for i in arrivals(len(prompts), args.request_rate, args.burstiness, args.seed):
            tasks.append(asyncio.create_task(counted(*prompts[i])))
        try:
            results = await asyncio.gather(*tasks)
        finally:
            bar.close()
        duration = time.perf_counter() - start
    return {**summarize(results, duration, args, model), "vocab_size": vocab}


async def server_vocab_size(client: httpx.AsyncClient) -> int:
    """The model's vocabulary size from the server's /tokenizer_info. No silent default: prompts drawn
    from another range are other prompts (a proxy without this endpoint once gave [128, 256) tokens)."""
    info = await client.get("/tokenizer_info")
    size = info.json().get("vocab_size") if info.status_code == 200 else None
    if not size:
        raise SystemExit(f"error: {client.base_url}/tokenizer_info gave no vocab_size (HTTP {info.status_code}): "
                         "pass --vocab-size")
    return int(size)


def summarize(results: list[RequestResult], duration: float, args, model: str) -> dict:
    ok = [r for r in results if r.success]
    percentiles = percentiles_of(args)
    out_tokens, in_tokens = sum(r.output_tokens for r in ok), sum(r.prompt_len for r in ok)
    summary = {"model_id": model, "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
               "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
               "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
               "total_token_throughput": (in_tokens + out_tokens) / duration,
               # JSON has no infinity (json.dump's Infinity is refused by strict readers): "inf", as vLLM writes it
               "max_concurrency": args.max_concurrency,
               "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
               "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
               "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
               "errors": [r.error for r in results]}
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    series = {"ttft": [r.ttft for r in ok], "tpot": tpots, "itl": [x for r in ok for x in r.itl],
              "e2el": [r.latency for r in ok]}
    for name, values in series.items():
        ms = np.asarray(values or [0.0]) * 1000
        summary[f"mean_{name}_ms"] = float(ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(ms))
        summary[f"std_{name}_ms"] = float(ms.std())
        summary[f"percentiles_{name}_ms"] = [(p, float(np.percentile(ms, p))) for p in percentiles]
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return summary


def print_summary(s: dict) -> None:
    def row(label, value, fmt="{:<10}"):
        print(("{:<40} " + fmt).format(label, value))

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    if s["max_concurrency"] is not None:
        row("Maximum request concurrency:", s["max_concurrency"])
    row("Request rate configured (RPS):", float(s["request_rate"]), "{:<10.2f}")
    row("Benchmark duration (s):", s["duration"], "{:<10.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", s["output_throughput"], "{:<10.2f}")
    row("Total Token throughput (tok/s):", s["total_token_throughput"], "{:<10.2f}")
    titles = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
              "itl": ("Inter-token Latency", "ITL")}
    for name, (title, short) in titles.items():
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", s[f"mean_{name}_ms"], "{:<10.2f}")
        row(f"Median {short} (ms):", s[f"median_{name}_ms"], "{:<10.2f}")
        for p, value in s[f"percentiles_{name}_ms"]:
            row(f"P{p:g} {short} (ms):", value, "{:<10.2f}")
    print("=" * 50)


def check_args(args) -> None:
    """The numbers that would fail or hang late (an empty run, a negative rate), before any request."""
    rules = [("--num-prompts", args.num_prompts, args.num_prompts >= 1, "at least 1"),
             ("--random-input-len", args.random_input_len, args.random_input_len >= 1, "at least 1"),
             ("--random-output-len", args.random_output_len, args.random_output_len >= 1, "at least 1"),
             ("--random-range-ratio", args.random_range_ratio, 0 <= args.random_range_ratio < 1, "in [0, 1)"),
             ("--max-concurrency", args.max_concurrency, args.max_concurrency is None or args.max_concurrency >= 1,
              "at least 1"),
             ("--request-rate", args.request_rate, args.request_rate > 0, "above 0 (inf: all at once)"),
             ("--burstiness", args.burstiness, args.burstiness > 0, "above 0"),
             ("--vocab-size", args.vocab_size, args.vocab_size is None or args.vocab_size >= 1, "at least 1")]
    for flag, value, ok, rule in rules:
        if not ok:
            raise SystemExit(f"error: {flag} must be {rule}, got {value}")
    try:
        percentiles = percentiles_of(args)
    except ValueError:
        percentiles = []
    if not percentiles or not all(0 < p <= 100 for p in percentiles):
        raise SystemExit(f"error: --metric-percentiles must be numbers in (0, 100], got {args.metric_percentiles!r}")


def percentiles_of(args) -> list[float]:
    return [float(p) for p in str(args.metric_percentiles).split(",") if p]


def main(args) -> dict:
    check_args(args)
    try:
        summary = asyncio.run(run_benchmark(args))
    except httpx.TransportError as e:  # nothing listening, a wrong host: before any result
        base = args.base_url or f"http://{args.host}:{args.port}"
        raise SystemExit(f"error: cannot reach the server at {base} ({e}); is `oasiskv serve` running there?")
    print_summary(summary)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(summary, f, indent=1)
    report_failures(summary)
    return summary


def report_failures(summary: dict) -> None:
    """The failed requests' distinct errors (the table counts them only); a run where none succeeded measured
    nothing (its latencies read 0) and exits non-zero."""
    errors = list(dict.fromkeys(e for e in summary["errors"] if e))
    for error in errors[:3]:
        print(f"failed request: {error}", file=sys.stderr)
    if summary["completed"] == 0:
        first = errors[0] if errors else "?"
        raise SystemExit(f"error: all {summary['failed']} requests failed; the first error: {first}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="oasiskv bench serve")
    add_args(parser)
    main(parser.parse_args())
