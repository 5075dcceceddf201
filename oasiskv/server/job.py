"""The HTTP side of a generation request, shared by completions and chat: sampling params from the
request body, the context-length check, the response framing (JSON or SSE) and cancellation when
the client disconnects."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from oasiskv.config import SamplingParams
from oasiskv.sampling_params import bias_pairs, left_truncated
from oasiskv.models.generation_config import DEFAULTED
from oasiskv.server.generation import ChoiceDelta, Submission, choice_deltas, collect_choices
from oasiskv.server.protocol import (UNSUPPORTED_FIELDS, APIError, SamplingFields, error_body, new_id, now, sse,
                                     usage)


# what a request leaves out: the model's default (its generation_config.json), else SamplingParams' own
NEUTRAL = {name: getattr(SamplingParams(), name) for name in DEFAULTED if name != "max_tokens"}


def sampling_params(body: SamplingFields, max_tokens: int, choice: int, defaults: dict | None = None) -> SamplingParams:
    """vLLM's defaults and conventions: a field the request leaves out takes the model's default (its
    generation_config.json: `defaults`), else the neutral value; top_k 0 or -1 is off; seed -1 is no seed;
    choice i of n > 1 is seeded seed + i."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    given = {name: getattr(body, name) for name in NEUTRAL if getattr(body, name) is not None}
    chosen = {**NEUTRAL, **{k: v for k, v in (defaults or {}).items() if k in NEUTRAL}, **given}
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=chosen["temperature"], top_p=chosen["top_p"],
            top_k=chosen["top_k"] or -1, min_p=chosen["min_p"], repetition_penalty=chosen["repetition_penalty"],
            seed=None if body.seed in (None, -1) else body.seed + choice, stop=stop or None,
            stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, min_tokens=body.min_tokens, logit_bias=body.logit_bias or None,
            include_stop_str_in_output=body.include_stop_str_in_output, allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words, skip_special_tokens=body.skip_special_tokens)
    except ValueError as e:
        raise APIError(str(e), param=field_named(str(e))) from e


def max_tokens_of(state, num_prompt_tokens: int, requested: int | None) -> int:
    """vLLM's: the least of what the context leaves, the request's max_tokens and the model's max_new_tokens (its
    generation_config.json), each where given."""
    limits = (state.max_model_len - num_prompt_tokens, requested, state.sampling_defaults.get("max_tokens"))
    return min(n for n in limits if n is not None)


def field_named(message: str) -> str | None:
    """The request field a SamplingParams error names first (its messages start with or quote the field)."""
    found = [(at, name) for name in SAMPLING_FIELDS if (at := message.find(name)) >= 0]
    return min(found, key=lambda f: (f[0], -len(f[1])))[1] if found else None  # stop_token_ids before stop


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop", "min_tokens",
                   "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "allowed_token_ids", "bad_words")


def truncated_prompt(body: SamplingFields, ids: list[int], max_model_len: int) -> list[int]:
    """The prompt as the request's truncate_prompt_tokens leaves it (before its length is checked, as vLLM does)."""
    try:
        return left_truncated(ids, body.truncate_prompt_tokens, max_model_len)
    except ValueError as e:
        raise APIError(str(e), param="truncate_prompt_tokens") from e


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(f"token ids out of range [0, {vocab_size}): {bad[:5]}", param=param)


def encode_text(tokenizer, text: str, param: str, **kwargs) -> list[int]:
    """Token ids of a request's text; a string JSON can carry but UTF-8 cannot (a lone surrogate escape such as
    \\ud800) is the client's error, not the tokenizer's."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"{param} is not valid Unicode: {e.reason} at character {e.start}", param=param) from None
    return list(tokenizer.encode(text, **kwargs))


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_param: str) -> None:
    """vLLM's two messages: a prompt that leaves no room for one token names the prompt; a max_tokens (None: unset,
    up to the model length) that passes the model length names max_tokens."""
    if num_prompt_tokens >= max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                       f"{num_prompt_tokens} input tokens. Please reduce the length of the input messages.",
                       param=prompt_param)
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} "
                       f"in the completion). Please reduce the length of the messages or completion.",
                       param="max_tokens")


def refuse_unsupported(body: SamplingFields) -> None:
    """A field vLLM honours and this server does not is refused by name at another value than its neutral ones;
    other unknown fields are ignored, as vLLM ignores them."""
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED_FIELDS and value not in UNSUPPORTED_FIELDS[name]:
            raise APIError(f"{name} is not supported by this server; leave it unset", param=name)
    if body.best_of not in (None, body.n):
        raise APIError(f"best_of other than n is not supported by this server (best_of {body.best_of}, n {body.n}); "
                       f"leave it unset", param="best_of")


class GenerationJob:
    """One HTTP request of either endpoint: its engine submission and the response framing they share.
    Subclasses set `object_name` and `params`, and define num_prompt_tokens, chunks() and response()."""

    object_name = ""  # of a stream chunk
    id_prefix = ""

    def __init__(self, body: SamplingFields, state):
        state.check_model(body.model)
        refuse_unsupported(body)
        if body.stream_options and not body.stream:
            raise APIError("Stream options can only be defined when `stream=True`.", param="stream_options")
        if body.kv_transfer_params is not None and state.disagg is None:
            raise APIError("kv_transfer_params need a server started with --role prefill or decode",
                           param="kv_transfer_params")
        if state.disagg is not None and body.n != 1:
            raise APIError("a prefill or decode instance takes n = 1 only", param="n")
        if state.disagg is not None and state.disagg.name == "prefill" and body.stream and body.kv_transfer_params:
            raise APIError("a prefill for remote decode cannot stream: its kv_transfer_params come in the JSON "
                           "response", param="stream")
        if body.logit_bias:  # the ids as SamplingParams reads them (" 7" is 7), checked before the engine sees them
            try:
                ids = [token for token, _ in bias_pairs(body.logit_bias)]
            except ValueError as e:
                raise APIError(str(e), param="logit_bias") from e
            check_token_ids(ids, state.engine.model_config.vocab_size, "logit_bias")
        if body.allowed_token_ids:
            check_token_ids(body.allowed_token_ids, state.engine.model_config.vocab_size, "allowed_token_ids")
        self.body, self.state = body, state
        if state.disagg is not None and state.disagg.name == "decode" and self.wants_logprobs:
            raise APIError("a decode instance gives no logprobs: the prefill instance sampled the first token, and "
                           "its logprobs do not travel with the KV", param="logprobs")
        self.id, self.created = new_id(self.id_prefix), now()
        self.params: list[SamplingParams] = []
        self.sub: Submission | None = None
        self.generated: dict[int, int] = {}  # tokens streamed so far, per choice index

    num_prompt_tokens = 0

    @property
    def wants_logprobs(self) -> bool:
        """completions: logprobs N (0 too); chat: logprobs true."""
        return self.body.logprobs is not None and self.body.logprobs is not False

    def token_str(self, token_id: int) -> str:
        """A token as its logprobs show it: its text, or vLLM's `token_id:N` with return_tokens_as_token_ids."""
        return f"token_id:{token_id}" if self.body.return_tokens_as_token_ids else self.state.token_str(token_id)

    def usage(self, generated: int) -> dict:
        return usage(self.num_prompt_tokens, generated)

    def prompt_tokens_of(self, index: int) -> int:
        """The prompt tokens of choice `index` (chat: one prompt for every choice)."""
        return self.num_prompt_tokens

    def choice_usage(self, index: int) -> dict:
        """vLLM's continuous usage stats: choice `index`'s own prompt and its tokens so far."""
        return usage(self.prompt_tokens_of(index), self.generated.get(index, 0))

    def count_streamed(self, index: int, token_ids: list[int]) -> None:
        self.generated[index] = self.generated.get(index, 0) + len(token_ids)

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
        payload = self.response(choices)
        if self.state.disagg is not None:  # kv_transfer_params (prefill), transfer statistics (decode)
            self.state.disagg.annotate(payload, self.sub.request_ids[0])
        return JSONResponse(payload)

    async def stream(self, request):
        """SSE: the subclass's chunks, the usage chunk if asked for, `data: [DONE]`. An engine failure
        becomes an error event; a client that goes aborts the submission at once."""
        watcher = asyncio.ensure_future(close_on_disconnect(request, self.sub))
        options = self.body.stream_options
        try:
            async for payload in self.chunks():
                if options and options.include_usage and options.continuous_usage_stats:  # vLLM needs both
                    payload["usage"] = self.choice_usage(payload["choices"][0]["index"])
                yield sse(payload)
            if options and options.include_usage:
                yield sse(self.chunk([], self.usage(sum(self.generated.values()))))
        except APIError as e:
            yield sse(error_body(e.message, e.status, e.param))
        finally:
            watcher.cancel()
            self.sub.close()
        yield "data: [DONE]\n\n"


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
