"""From engine outputs to choices: the engine requests of one HTTP request (a Submission) and the
incremental detokenization that turns their token ids into text deltas."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

from oasiskv.config import SamplingParams
from oasiskv.server.engine_loop import EngineLoop, Output
from oasiskv.engine.logprobs import TokenLogprob
from oasiskv.server.protocol import APIError


class Submission:
    """The engine requests of one HTTP request (prompts x n choices) and their shared output queue.
    close() aborts whatever has not finished: call it in a finally block."""

    def __init__(self, loop: EngineLoop, request_ids: list[str], queue: asyncio.Queue, prompts: list[list[int]]):
        self.loop, self.request_ids, self.queue, self.prompts = loop, request_ids, queue, prompts
        self.pending = set(range(len(request_ids)))

    @classmethod
    async def start(cls, loop: EngineLoop, prompts: list[list[int]], params: list[SamplingParams],
                    top_logprobs: int | None, kv_transfer_params: dict | None = None,
                    prompt_param: str = "prompt") -> "Submission":
        try:
            ids, queue = await loop.add(prompts, params, top_logprobs, kv_transfer_params)
        except ValueError as e:  # refused; a request that may fit later (a decode instance's room) is a 503
            status = 503 if getattr(e, "retry_later", False) else 400
            raise APIError(str(e), status=status, param=prompt_param if status == 400 else None) from e
        return cls(loop, ids, queue, prompts)

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
    """Output token ids in, text deltas out. Holds back what may still change: the last len(stop) - 1
    characters while stop strings are set (the engine cuts a stop string off only once it is complete); an
    incomplete UTF-8 character at the end is not in the decoded text at all."""

    def __init__(self, tokenizer, params: SamplingParams, prompt_ids: list[int]):
        self.tokenizer, self.params = tokenizer, params
        self.context = tokenizer.text_context(prompt_ids)  # the prompt tokens the output is decoded after
        self.holdback = max((len(s) for s in params.stop or ()), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0

    def push(self, token_ids: list[int]) -> str:
        self.ids += token_ids
        text = self.tokenizer.decode_after(self.context, self.ids, self.params.skip_special_tokens)
        safe = len(text) - self.holdback  # (an unfinished character is never in the text: whole_characters)
        delta = text[self.sent:safe] if safe > self.sent else ""
        self.sent += len(delta)
        return delta

    def finish(self, token_ids: list[int], out: Output) -> tuple[str, str | int | None]:
        """The last delta (from the engine's final text) and vLLM's stop_reason."""
        self.ids += token_ids
        full = self.tokenizer.decode_after(self.context, self.ids, self.params.skip_special_tokens)
        final = full if out.text is None or out.finish_reason == "abort" else out.text
        delta, self.sent = final[self.sent:], len(final)
        # the engine's own: the stop string it cut the text at (the earliest), the stop token; None for EOS
        return delta, out.stop_reason if out.finish_reason == "stop" else None


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
    streams = [TextStream(tokenizer, p, prompt) for p, prompt in zip(params, sub.prompts)]
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
