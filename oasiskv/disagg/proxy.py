"""`oasiskv proxy --prefill URL --decode URL`: one OpenAI-compatible endpoint over a prefill and a
decode instance, as vLLM's disaggregated-serving proxy does. A request goes first to the prefill
instance with max_tokens 1 and kv_transfer_params {"do_remote_decode": true}; its response carries
the kv_transfer_params the decode instance needs (where the prompt's KV is, and the first token),
and the request then goes to the decode instance, whose answer (or stream) is passed through."""
from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from oasiskv.server.protocol import error_body, sse

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its caller is still there


class Proxy:
    # a decode's 503 (no room now) is sent again, with the same kv_transfer_params, for this long: the prefill keeps
    # the prompt's KV for such a resend (without one it waited for its lease to end)
    decode_retry_s = 30.0

    def __init__(self, prefill_url: str, decode_url: str):
        self.prefill, self.decode = prefill_url.rstrip("/"), decode_url.rstrip("/")
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10))

    async def generate(self, path: str, body: dict, client: Request | None = None) -> Response:
        """`client`: the caller's request; when it disconnects, the instance's request is dropped too (closing that
        connection aborts the request there)."""
        if not isinstance(body, dict):
            return JSONResponse(error_body("the request body must be a JSON object", 400), status_code=400)
        if answered_by_prefill(body):
            return await until_gone(client, self.send(self.prefill + path, body))
        first = await until_gone(client, self.client.post(self.prefill + path, json=prefill_body(body)))
        if not isinstance(first, httpx.Response):  # the caller left
            return first
        if first.status_code != 200:
            return passthrough(first)
        first_json = first.json()
        params = first_json.get("kv_transfer_params")
        if params is None:  # the first token ended it (a stop): that is the whole answer
            return final_from_prefill(first_json, body, path)
        return await until_gone(client, self.send_to_decode(path, {**body, "kv_transfer_params": params}))

    async def send_to_decode(self, path: str, body: dict) -> Response:
        """The decode's answer; a 503 (no room for the prompt now) is sent again after a pause that doubles up to a
        second, for decode_retry_s; then the 503 is the answer."""
        pause, waited = 0.05, 0.0
        while True:
            response = await self.send(self.decode + path, body)
            if response.status_code != 503 or waited >= self.decode_retry_s:
                return response
            await asyncio.sleep(pause)
            waited, pause = waited + pause, min(2 * pause, 1.0)

    async def send(self, url: str, body: dict) -> Response:
        request = self.client.build_request("POST", url, json=body)
        response = await self.client.send(request, stream=bool(body.get("stream")))
        if not body.get("stream") or response.status_code != 200:
            await response.aread()
            return passthrough(response)
        return StreamingResponse(relay(response), media_type="text/event-stream",
                                 background=BackgroundTask(response.aclose))

    async def health(self) -> Response:
        for url in (self.prefill, self.decode):
            try:
                if (await self.client.get(url + "/health")).status_code != 200:
                    return Response(status_code=503)
            except httpx.HTTPError:
                return Response(status_code=503)
        return Response(status_code=200)


async def until_gone(client: Request | None, work):
    """`work`'s result, or a 499 once the client has disconnected (work is cancelled: its connection closes)."""
    task = asyncio.ensure_future(work)
    while client is not None and not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await client.is_disconnected():
            task.cancel()
            return Response(status_code=499)  # nobody reads it
    return await task


async def relay(response: httpx.Response):
    """The instance's SSE bytes; if it fails mid-stream, an error event and [DONE] (the caller saw a cut body)."""
    try:
        async for piece in response.aiter_raw():
            yield piece
    except httpx.HTTPError as e:
        yield "\n\n" + sse(error_body(f"the decode instance failed mid-stream: {e!r}", 502)) + sse("[DONE]")


def answered_by_prefill(body: dict) -> bool:
    """A request for at most one token needs no decode instance (for none, an echo's answer or an error is the
    prefill instance's to give; sent on, its prompt's KV would wait there for a decode that never comes)."""
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens") if limit is None else limit
    return isinstance(limit, int) and not isinstance(limit, bool) and limit <= 1


def prefill_body(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    if isinstance(out.get("min_tokens"), int) and out["min_tokens"] > 1:  # the one token it samples must not be EOS
        out["min_tokens"] = 1
    return {**out, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}


def passthrough(response: httpx.Response) -> Response:
    return Response(response.content, status_code=response.status_code,
                    media_type=response.headers.get("content-type", "application/json"))


def final_from_prefill(first: dict, body: dict, path: str) -> Response:
    first.pop("kv_transfer_params", None)
    if not body.get("stream"):
        return JSONResponse(first)
    chat = path.endswith("chat/completions")
    for choice in first["choices"]:
        if chat:
            choice["delta"] = {"role": "assistant", "content": choice.pop("message")["content"]}
    first["object"] = "chat.completion.chunk" if chat else "text_completion"
    usage = first.pop("usage", None)
    events = sse(first)
    if isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage"):
        events += sse({**first, "choices": [], "usage": usage})
    return Response(events + sse("[DONE]"), media_type="text/event-stream")


def build_proxy_app(prefill_url: str, decode_url: str) -> FastAPI:
    proxy = Proxy(prefill_url, decode_url)
    app = FastAPI(title="oasiskv proxy")

    @app.exception_handler(httpx.HTTPError)  # every route: an instance down or failing is a 502 in the API's form
    async def instance_failed(request: Request, e: httpx.HTTPError):
        return JSONResponse(error_body(f"an instance behind the proxy failed: {e!r}", 502), status_code=502)

    async def body_of(request: Request):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return e

    # routes are built by functions taking the path: a `path=path` default would make FastAPI read `path`
    # from the query string, so `?path=...` could send the request elsewhere
    def generation_route(path: str):
        async def route(request: Request):
            body = await body_of(request)
            if isinstance(body, Exception):
                return JSONResponse(error_body(f"the request body is not valid JSON: {body}", 400), status_code=400)
            return await proxy.generate(path, body, request)
        return route

    def decode_route(path: str):
        async def route(request: Request):
            return passthrough(await proxy.client.post(proxy.decode + path, content=await request.body(),
                                                       headers={"content-type": "application/json"}))
        return route

    for path in GENERATION_PATHS:
        app.post(path)(generation_route(path))

    @app.get("/health")
    async def health():
        return await proxy.health()

    @app.get("/v1/models")
    async def models():
        return passthrough(await proxy.client.get(proxy.decode + "/v1/models"))

    # the tokenizer endpoints of `oasiskv serve`: `bench serve` draws its random prompts from
    # /tokenizer_info's vocab_size, lm-eval's remote tokenizer uses all three
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return passthrough(await proxy.client.get(proxy.decode + "/tokenizer_info"))

    for path in ("/tokenize", "/detokenize"):
        app.post(path)(decode_route(path))

    return app


def check_url(flag: str, url: str) -> None:
    """An instance's URL as httpx takes it (without a scheme every request would fail with a 502)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SystemExit(f"oasiskv proxy: {flag} must be a URL such as http://127.0.0.1:8101, got {url!r}")


def serve_proxy(args) -> None:
    import uvicorn

    from oasiskv.server.app import check_listen

    check_listen(args.host, args.port, "proxy")
    for flag, url in (("--prefill", args.prefill), ("--decode", args.decode)):
        check_url(flag, url)
    app = build_proxy_app(args.prefill, args.decode)
    print(f"oasiskv proxy: prefill {args.prefill}, decode {args.decode}, on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
