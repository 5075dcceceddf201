"""POST /v1/completions: prompts as text, token ids or lists of either; n choices each; echo with
prompt logprobs (what lm-eval's local-completions scores multiple choice with); streaming."""
from __future__ import annotations

from fastapi.responses import JSONResponse, Response, StreamingResponse

from oasiskv.server.generation import Choice, Submission
from oasiskv.server.job import (GenerationJob, check_context, check_token_ids, encode_text, max_tokens_of,
                               sampling_params, truncated_prompt)
from oasiskv.server.logprobs import CompletionLogprobs
from oasiskv.server.protocol import APIError, CompletionRequest, sse


def prompt_inputs(prompt, tokenizer, vocab_size: int) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt; ids checked against the vocabulary before anything reads them (an
    echo's prompt logprobs run the model on them before the engine sees the request)."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError("prompt must not be empty", param="prompt")
    out = [(p, encode_text(tokenizer, p, "prompt")) if isinstance(p, str) else (None, list(p)) for p in prompts]
    if any(not ids for _, ids in out):
        raise APIError("prompt must not be empty", param="prompt")
    for _, ids in out:
        check_token_ids(ids, vocab_size, "prompt")
    return out


class CompletionJob(GenerationJob):
    """One /v1/completions request: prompts x n choices, and the echoed prompts."""

    object_name, id_prefix = "text_completion", "cmpl"

    def __init__(self, body: CompletionRequest, state):
        super().__init__(body, state)
        if body.max_tokens == 0 and not body.echo:
            raise APIError("max_tokens must be at least 1 (0 is allowed only with echo)", param="max_tokens")
        if body.echo and self.wants_logprobs and getattr(state.engine, "tp", None):
            # (the prompt's logprobs are a forward of rank 0's shard alone: its collectives would wait on the
            # other ranks, which wait for the next plan, and every request would hang until the timeout)
            raise APIError("echo with logprobs (the prompt's logprobs) is not served with tensor parallelism "
                           "(--tensor-parallel-size > 1); ask without logprobs or without echo", param="echo")
        self.n = body.n
        self.prompts = []
        for text, ids in prompt_inputs(body.prompt, state.tokenizer, state.engine.model_config.vocab_size):
            kept = truncated_prompt(body, ids, state.max_model_len)
            self.prompts.append((text if len(kept) == len(ids) else None, kept))  # echo: a truncated one's text
        if state.disagg is not None and len(self.prompts) > 1:
            raise APIError("a prefill or decode instance takes one prompt a request (kv_transfer_params name one "
                           "prompt's KV)", param="prompt")
        if state.disagg is not None and state.disagg.name == "decode" and body.max_tokens == 0:
            raise APIError("a decode instance needs max_tokens >= 1 (the proxy sends an echo with max_tokens 0 to "
                           "the prefill instance alone)", param="max_tokens")
        self.num_prompt_tokens = sum(len(ids) for _, ids in self.prompts)
        for _, ids in self.prompts:
            check_context(len(ids), body.max_tokens, state.max_model_len, "prompt")
            max_tokens = max_tokens_of(state, len(ids), body.max_tokens)
            self.params += [sampling_params(body, max(max_tokens, 1), i, state.sampling_defaults)
                            for i in range(self.n)]
        self.formatters = [CompletionLogprobs(self.token_str) for _ in self.params]
        self.echoes: list[tuple[str, list]] | None = None

    async def start(self) -> None:
        if self.body.echo:
            self.echoes = [await self.echo_of(text, ids) for text, ids in self.prompts]
        if self.body.max_tokens != 0:
            prompts = [ids for _, ids in self.prompts for _ in range(self.n)]
            self.sub = await Submission.start(self.state.loop, prompts, self.params, self.body.logprobs,
                                              self.body.kv_transfer_params)

    def prompt_tokens_of(self, index: int) -> int:
        return len(self.prompts[index // self.n][1])

    async def echo_of(self, text: str | None, ids: list[int]) -> tuple[str, list]:
        # ids alone (or cut by truncate_prompt_tokens): their text with special tokens, as vLLM's echo decodes them
        text = self.state.decode_with_specials(ids) if text is None else text
        logprobs = await self.state.loop.prompt_logprobs(ids, self.body.logprobs) if self.wants_logprobs else []
        return text, logprobs

    def choice_json(self, index: int, text: str, token_ids: list[int], logprobs: list, finish_reason, stop_reason,
                    first: bool) -> dict:
        if first and self.echoes is not None:  # the prompt leads the choice's first piece
            echo_text, echo_logprobs = self.echoes[index // self.n]
            text = echo_text + text
            token_ids, logprobs = self.prompts[index // self.n][1] + token_ids, echo_logprobs + logprobs
        lp = self.formatters[index].format(token_ids, logprobs) if self.wants_logprobs else None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def response(self, choices: list[Choice]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.state.model_name,
                "choices": [self.choice_json(i, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, True)
                            for i, c in enumerate(choices)],
                "usage": self.usage(sum(len(c.token_ids) for c in choices))}

    def echo_events(self, payload: dict):
        """The answer of an echo with max_tokens 0, streamed: its choices in one chunk, the usage chunk if asked."""
        options, chunk = self.body.stream_options, self.chunk(payload["choices"])
        if options and options.include_usage and options.continuous_usage_stats:
            chunk["usage"] = payload["usage"]
        yield sse(chunk)
        if options and options.include_usage:
            yield sse(self.chunk([], payload["usage"]))
        yield "data: [DONE]\n\n"

    async def chunks(self):
        started = set()
        async for d in self.deltas():
            self.count_streamed(d.index, d.token_ids)
            yield self.chunk([self.choice_json(d.index, d.text, d.token_ids, d.logprobs, d.finish_reason,
                                               d.stop_reason, d.index not in started)])
            started.add(d.index)


async def create_completion(body: CompletionRequest, state, request) -> Response:
    job = CompletionJob(body, state)
    await job.start()
    if job.sub is None:  # echo with max_tokens 0: the prompt is the whole answer
        payload = job.response([Choice(finish_reason="length") for _ in job.params])
        if body.stream:
            return StreamingResponse(job.echo_events(payload), media_type="text/event-stream")
        return JSONResponse(payload)
    return await job.respond(request)
