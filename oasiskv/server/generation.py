"""What completions and chat share: sampling params from a request, the context-length check,
submitting choices to the engine loop, and turning their token outputs into text deltas."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

from oasiskv.config import SamplingParams
from oasiskv.server.engine_loop import EngineLoop, Output
from oasiskv.server.logprobs import TokenLogprob
from fastapi.responses import JSONResponse, Response, StreamingResponse

from oasiskv.server.protocol import APIError, SamplingFields, error_body, new_id, now, sse, usage


def sampling_params(body: SamplingFields, max_tokens: int, choice: int) -> SamplingParams:
    """vLLM's defaults and conventions: top_k 0 or -1 is off; choice i of n > 1 is seeded seed + i."""
    stop = [s for s in ([body.stop] if isinstance(body.stop, str) else body.stop or []) if s]
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=-1 if not body.top_k else body.top_k,
            seed=None if body.seed is None else body.seed + choice, stop=stop or None,
            stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos)
    except ValueError as e:
        raise APIError(str(e)) from e


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens + max_tokens > max_model_len or num_prompt_tokens >= max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} "
                       f"in the completion). Please reduce the length of the messages or completion.",
                       param="max_tokens")


class Submission:
    """The engine requests of one HTTP request (prompts x n choices) and their shared output queue.
    close() aborts whatever has not finished: call it in a finally block."""

    def __init__(self, loop: EngineLoop, request_ids: list[str], queue: asyncio.Queue):
        self.loop, self.request_ids, self.queue = loop, request_ids, queue
        self.pending = set(range(len(request_ids)))

    @classmethod
    async def start(cls, loop: EngineLoop, prompts: list[list[int]], params: list[SamplingParams],
                    top_logprobs: int | None) -> "Submission":
        try:
            ids, queue = await loop.add(prompts, params, top_logprobs)
        except ValueError as e:
            raise APIError(str(e), param="prompt") from e
        return cls(loop, ids, queue)

    async def outputs(self) -> AsyncIterator[tuple[int, Output]]:
        while self.pending:
            index, out = await self.queue.get()
            if out.error:
                self.pending.clear()
                raise APIError(out.error, status=500)
            if out.finished:
                self.pending.discard(index)
            yield index, out

    def close(self) -> None:
        if self.pending:
            self.loop.abort([self.request_ids[i] for i in self.pending])
            self.pending.clear()


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class TextStream:
    """Output token ids in, text deltas out. Holds back what may still change: an incomplete UTF-8
    character at the end, and the last len(stop) - 1 characters while stop strings are set (the
    engine cuts a stop string off only once it is complete)."""

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer, self.params = tokenizer, params
        self.holdback = max((len(s) for s in params.stop or ()), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0

    def push(self, token_ids: list[int]) -> str:
        self.ids += token_ids
        text = self.tokenizer.decode(self.ids)
        safe = len(text) - self.holdback - (1 if text.endswith("\ufffd") else 0)
        delta = text[self.sent:safe] if safe > self.sent else ""
        self.sent += len(delta)
        return delta

    def finish(self, token_ids: list[int], out: Output) -> tuple[str, str | int | None]:
        """The last delta (from the engine's final text) and vLLM's stop_reason."""
        self.ids += token_ids
        full = self.tokenizer.decode(self.ids)
        final = full if out.text is None or out.finish_reason == "abort" else out.text
        delta, self.sent = final[self.sent:], len(final)
        return delta, self.stop_reason(full, final, out.finish_reason)

    def stop_reason(self, full: str, final: str, finish_reason: str | None) -> str | int | None:
        if finish_reason != "stop":
            return None
        if self.ids and self.params.stop_token_ids and self.ids[-1] in self.params.stop_token_ids:
            return self.ids[-1]
        return next((s for s in self.params.stop or () if full[len(final):].startswith(s)), None)


@dataclass
class Choice:
    """A whole choice, for non-streaming responses."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


async def choice_deltas(sub: Submission, tokenizer, params: list[SamplingParams]) -> AsyncIterator[ChoiceDelta]:
    """Text deltas of every choice as the engine produces them; aborts the rest if abandoned."""
    streams = [TextStream(tokenizer, p) for p in params]
    try:
        async for index, out in sub.outputs():
            s = streams[index]
            if out.finished:
                text, stop_reason = s.finish(out.token_ids, out)
                yield ChoiceDelta(index, text, out.token_ids, out.logprobs, out.finish_reason, stop_reason)
            else:
                yield ChoiceDelta(index, s.push(out.token_ids), out.token_ids, out.logprobs)
    finally:
        sub.close()


async def collect_choices(sub: Submission, tokenizer, params: list[SamplingParams]) -> list[Choice]:
    choices = [Choice() for _ in params]
    async for d in choice_deltas(sub, tokenizer, params):
        c = choices[d.index]
        c.text += d.text
        c.token_ids += d.token_ids
        c.logprobs += d.logprobs
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
    return choices


async def until_disconnect(request, work, on_disconnect):
    """Runs the coroutine `work`; if the HTTP client disconnects first, cancels it, calls on_disconnect
    (which aborts the engine requests) and returns None. Listens for the ASGI disconnect message itself,
    as vLLM's with_cancellation does."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            on_disconnect()
    return task.result() if task in done else None


async def close_on_disconnect(request, sub: Submission) -> None:
    """For streams: aborts the submission as soon as the client goes, even between two chunks."""
    await wait_for_disconnect(request)
    sub.close()


async def wait_for_disconnect(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class GenerationJob:
    """One HTTP request of either endpoint: its engine submission and the response framing they share.
    Subclasses set `object_name` and `params`, and define num_prompt_tokens, chunks() and response()."""

    object_name = ""  # of a stream chunk
    id_prefix = ""

    def __init__(self, body: SamplingFields, state):
        state.check_model(body.model)
        if body.stream_options and not body.stream:
            raise APIError("Stream options can only be defined when `stream=True`.", param="stream_options")
        self.body, self.state = body, state
        self.id, self.created = new_id(self.id_prefix), now()
        self.params: list[SamplingParams] = []
        self.sub: Submission | None = None
        self.generated = 0  # tokens streamed so far

    num_prompt_tokens = 0

    def usage(self, generated: int) -> dict:
        return usage(self.num_prompt_tokens, generated)

    def chunk(self, choices: list[dict], usage_block: dict | None = None) -> dict:
        out = {"id": self.id, "object": self.object_name, "created": self.created, "model": self.state.model_name,
               "choices": choices}
        if usage_block is not None:
            out["usage"] = usage_block
        return out

    def deltas(self) -> AsyncIterator[ChoiceDelta]:
        return choice_deltas(self.sub, self.state.tokenizer, self.params)

    async def respond(self, request) -> Response:
        if self.body.stream:
            return StreamingResponse(self.stream(request), media_type="text/event-stream")
        choices = await until_disconnect(request, collect_choices(self.sub, self.state.tokenizer, self.params),
                                         self.sub.close)
        if choices is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(self.response(choices))

    async def stream(self, request):
        """SSE: the subclass's chunks, the usage chunk if asked for, `data: [DONE]`. An engine failure
        becomes an error event; a client that goes aborts the submission at once."""
        watcher = asyncio.ensure_future(close_on_disconnect(request, self.sub))
        options = self.body.stream_options
        try:
            async for payload in self.chunks():
                if options and options.continuous_usage_stats:
                    payload["usage"] = self.usage(self.generated)
                yield sse(payload)
            if options and options.include_usage:
                yield sse(self.chunk([], self.usage(self.generated)))
        except APIError as e:
            yield sse(error_body(e.message, e.status, e.param))
        finally:
            watcher.cancel()
            self.sub.close()
        yield "data: [DONE]\n\n"
