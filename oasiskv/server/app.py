"""The FastAPI app of `oasiskv serve`: routes, vLLM's error shapes, and the entry point."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from oasiskv.server.chat import chat_prompt, create_chat_completion
from oasiskv.server.completions import create_completion
from oasiskv.server.engine_loop import EngineDeadError, EngineLoop
from oasiskv.server.job import check_token_ids, encode_text
from oasiskv.server.metrics import ServerMetrics
from oasiskv.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest, error_response)

log = logging.getLogger("oasiskv.server")


class ServerState:
    """What every route needs: the engine loop, the tokenizer, the model's names and limits."""

    def __init__(self, engine, served_model_name: str | list[str] | None = None, disagg=None):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.disagg = disagg  # a prefill or decode role (disagg/server.py), or None
        # vLLM's --served-model-name: any of the names is served, the first names the responses; without it, the
        # model's short name, and --model as given (vLLM's default name) is taken too
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        self.model_names = names or [default_model_name(engine)]
        self.model_name = self.model_names[0]
        self.accepted_names = set(self.model_names) | ({engine.config.model} if not names and engine.config.model
                                                      else set())
        self.max_model_len = engine.max_model_len
        self.sampling_defaults = engine.generation.sampling  # the model's generation_config.json values
        self.metrics = ServerMetrics(self.model_name)
        self.loop = EngineLoop(engine, self.metrics)
        self.created = int(time.time())
        self.token_strs: dict[int, str] = {}

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.accepted_names:
            raise APIError(f"The model `{name}` does not exist.", status=404, param="model")

    def token_str(self, token_id: int) -> str:
        """One token as text, special tokens included (the strings logprobs and /tokenize show)."""
        if token_id not in self.token_strs:
            self.token_strs[token_id] = self.decode_with_specials([token_id])
        return self.token_strs[token_id]

    def vocabulary_strs(self, ids: list[int]) -> list[str]:
        """The tokens as the vocabulary spells them (byte-level BPE's "Ġ" for a space), as vLLM's /tokenize gives
        them; a tokenizer without a vocabulary (bytes) gives each token's text."""
        hf = getattr(self.tokenizer, "hf", None)
        return hf.convert_ids_to_tokens(ids) if hf is not None else [self.token_str(t) for t in ids]

    def decode_with_specials(self, ids: list[int]) -> str:
        """The text of `ids` with special tokens kept (the engine's decode drops them from generated text)."""
        hf = getattr(self.tokenizer, "hf", None)
        return hf.decode(ids) if hf is not None else self.tokenizer.decode(ids)


def default_model_name(engine) -> str:
    model = engine.config.model
    if model is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model))


def build_app(engine, served_model_name: str | list[str] | None = None, disagg=None) -> FastAPI:
    state = ServerState(engine, served_model_name, disagg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start()
        if disagg is not None:
            disagg.start(state.loop)
        yield
        if disagg is not None:
            disagg.stop()
        state.loop.stop()

    app = FastAPI(title="oasiskv", lifespan=lifespan)
    app.state.server = state
    add_error_handlers(app)
    add_routes(app, state)
    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return error_response(e.message, e.status, e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, e: RequestValidationError):  # FastAPI's 422 becomes vLLM's 400
        release_refused_kv(request.app.state.server, e.body)
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return error_response(f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}")
        parts = [f"{'.'.join(str(x) for x in err.get('loc', ())[1:]) or 'body'}: {err.get('msg')}" for err in errors]
        param = next((str(err["loc"][1]) for err in errors if len(err.get("loc", ())) > 1), None)
        return error_response("; ".join(parts) or "invalid request", 400, param)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):  # e.g. a body that is not UTF-8
        message = "the request body could not be parsed as JSON (is it UTF-8?)" if e.status_code == 400 else e.detail
        return error_response(str(message), e.status_code)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_, e: EngineDeadError):
        return error_response(str(e), 500)

    @app.exception_handler(Exception)
    async def unexpected(_, e: Exception):  # a bug: still vLLM's error shape; starlette logs the traceback
        return error_response(f"internal error: {type(e).__name__}: {e}", 500)


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await refusing(state, body, create_completion(body, state, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await refusing(state, body, create_chat_completion(body, state, request))

    @app.get("/v1/models")
    async def models():
        cards = [{"id": name, "object": "model", "created": state.created, "owned_by": "oasiskv",
                  "root": state.engine.model_source, "parent": None, "max_model_len": state.max_model_len,
                  "permission": []} for name in state.model_names]
        return {"object": "list", "data": cards}

    @app.get("/health")
    async def health():
        return Response(status_code=503 if state.loop.error else 200)

    @app.get("/metrics")
    async def metrics():
        try:
            snapshot = await state.loop.snapshot()
        except EngineDeadError:  # the request series still tell what happened; no engine gauges from a dead engine
            snapshot = {}
        body = state.metrics.render(snapshot)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        tokens = tokenize_request(body, state.tokenizer)
        strs = state.vocabulary_strs(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        check_token_ids(body.tokens, state.engine.model_config.vocab_size, "tokens")
        return {"prompt": state.decode_with_specials(body.tokens)}  # as vLLM's: /tokenize's ids round-trip

    @app.get("/version")
    async def version():
        return {"version": package_version()}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenizer_info_of(state)


def release_refused_kv(state: ServerState, body) -> None:
    """A body refused before it was a request (its fields' types): its kv_transfer_params go back to the role as
    `refusing` sends a refused request's (a decode instance held the prefill's KV until its lease ended)."""
    if state.disagg is not None and isinstance(body, dict) and isinstance(body.get("kv_transfer_params"), dict):
        state.disagg.refused(body["kv_transfer_params"], state.loop)


async def refusing(state: ServerState, body, response):
    """The response; a refused request's kv_transfer_params go back to the role (a decode instance tells the
    prefill instance to free the prompt's KV now, not at its lease's end), unless it may be sent again (503)."""
    try:
        return await response
    except APIError as e:
        if state.disagg is not None and body.kv_transfer_params is not None and e.status != 503:  # 503: sent again
            state.disagg.refused(body.kv_transfer_params, state.loop)
        raise


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("oasiskv")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def tokenize_request(body: TokenizeRequest, tokenizer) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of `prompt` and `messages`", param="prompt")
    if body.messages is not None:
        return chat_prompt(body, tokenizer)  # the prompt /v1/chat/completions would run
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return encode_text(hf, body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
    return encode_text(tokenizer, body.prompt, "prompt")


def tokenizer_info_of(state: ServerState) -> dict:
    """The fields lm-eval's remote-tokenizer probe reads (eos_token) and a few more."""
    hf = getattr(state.tokenizer, "hf", None)
    info = {"tokenizer_class": type(hf or state.tokenizer).__name__, "model_max_length": state.max_model_len,
            "vocab_size": state.engine.model_config.vocab_size, "eos_token": None, "bos_token": None,
            "pad_token": None, "chat_template": None}
    if hf is not None:
        info.update(eos_token=hf.eos_token, bos_token=hf.bos_token, pad_token=hf.pad_token,
                    chat_template=getattr(hf, "chat_template", None))
    return info


class BackgroundServer:
    """uvicorn in a thread: for tests and in-process benchmarks."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="oasiskv-http", daemon=True)

    def start(self, timeout_s: float = 60) -> str:
        self.thread.start()
        deadline = time.time() + timeout_s
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def check_listen(host: str, port: int, command: str) -> None:
    """Fails at once, before any weights load, where uvicorn could not listen: a port in use or out of range, a
    host that is not this machine's. uvicorn binds with SO_REUSEADDR; so does this check."""
    if not 0 <= port <= 65535:
        raise SystemExit(f"oasiskv {command}: --port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        raise SystemExit(f"oasiskv {command}: cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve(args) -> None:
    """`oasiskv serve`: builds the engine from the engine flags and serves it."""
    import uvicorn

    from oasiskv.cli import checked_engine_config, disagg_config
    from oasiskv.disagg.server import build_engine

    check_listen(args.host, args.port, "serve")
    engine, role = build_engine(checked_engine_config(args), disagg_config(args))
    app = build_app(engine, args.served_model_name, role)
    print(f"oasiskv: serving {app.state.server.model_name} ({engine.kv_description}) on "
          f"http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
