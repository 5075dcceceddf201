"""A request as the scheduler sees it: token ids and counters, no tensors."""
from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from oasiskv.config import SamplingParams


PENDING_TOKEN = -1  # in a chunk's token_ids: a token sampled on the device, filled in there (engine/overlap.py)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that finished it
    output_text: str = ""
    text_context: list[int] | None = None  # the prompt tokens its text is decoded after (engine/stopping.py)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # its params' bad_words, tokenized (engine/penalties.py)
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    kv_stats: dict = field(default_factory=dict)  # the KV policy's counters for this request
    draft_token_id: int | None = None  # oasis mode: the draft source's guess of the token after the last one
    error: str | None = None  # why it ended badly (e.g. its remote KV was lost); reported to the client
    prompt_to_host: bool = False  # its prompt's K/V are exported from the host store (ScheduledChunk.prompt_to_host)
    table_list: list[int] | None = field(default=None, repr=False)  # the block_ids list that table_epoch names
    table_epoch: int = -1
    # async scheduling: tokens sampled on the device that the host has not read yet (1 between steps, 2 while a
    # step's are counted before the last step's are read), and whether the latest is the request's last (its
    # length limit), so that no step is planned after it
    num_pending: int = 0
    last_pending: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def tokens(self) -> TokenView:
        """Every token so far, prompt then output, without copying them (a live view)."""
        return TokenView(self.prompt_token_ids, self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1; a pending token (sampled, still on the device) reads as PENDING_TOKEN."""
        known = self.tokens[start:end]
        return known + [PENDING_TOKEN] * (min(end, self.num_tokens) - max(start, len(self.tokens)))

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


class TokenView(Sequence):
    """prompt + output as one read-only sequence, without building the concatenation: a decode step
    must not copy every request's whole context (16K tokens each) to look at its last few tokens."""

    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list[int], output: list[int]):
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            n = len(self.prompt)
            if stop <= n:
                return self.prompt[start:stop]
            if start >= n:
                return self.output[start - n:stop - n]
            return self.prompt[start:] + self.output[:stop - n]
        size = len(self)
        i = index + size if index < 0 else index
        if not 0 <= i < size:
            raise IndexError(f"token index {index} out of range for {size} tokens")
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]
