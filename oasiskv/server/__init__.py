"""OpenAI-compatible HTTP server: `oasiskv serve`.

app.py          FastAPI app: routes, error shapes, `serve` entry point
protocol.py     pydantic request models, errors, response pieces
engine_loop.py  the engine in one background thread; asyncio side talks to it by commands
logprobs.py     per-token logprobs (a sampler wrapper) and prompt logprobs (a cache-free forward)
generation.py   engine outputs to choices: a Submission of engine requests, incremental detokenization
job.py          what both endpoints share: sampling params, context check, JSON/SSE framing, disconnects
completions.py  /v1/completions;  chat.py  /v1/chat/completions
metrics.py      Prometheus /metrics, names prefixed `oasiskv:`
"""
