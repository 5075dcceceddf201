"""Offline API shaped like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass, field
from typing import Sequence

from tqdm.auto import tqdm

from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig, is_integer
from oasiskv.engine.engine import LLMEngine
from oasiskv.engine.request import Request

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)

    @classmethod
    def from_requests(cls, reqs: list[Request]) -> "RequestOutput":
        """One prompt's choices (n of them); the request id and metrics are the first choice's."""
        req = reqs[0]
        completions = [CompletionOutput(i, r.output_text, list(r.output_token_ids), r.finish_reason)
                       for i, r in enumerate(reqs)]
        metrics = {"num_preemptions": req.num_preemptions, **req.kv_stats}
        if req.first_token_time is not None:
            metrics["ttft_s"] = req.first_token_time - req.arrival_time
        if req.finish_time is not None:
            metrics["latency_s"] = req.finish_time - req.arrival_time
        return cls(req.request_id, req.prompt, list(req.prompt_token_ids), completions,
                   all(r.finished for r in reqs), metrics)


def split_kwargs(kwargs: dict) -> EngineConfig:
    """Accepts flat vLLM-style keyword arguments and sorts them into the config chain."""
    sections = {"cache": CacheConfig, "scheduler": SchedulerConfig, "kv": KVConfig}
    nested = {name: {} for name in sections}
    top = {}
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - set(sections)
    for key, value in kwargs.items():
        key = {"kv_mode": "mode", "kv_budget": "budget"}.get(key, key)
        owner = next((n for n, c in sections.items() if key in {f.name for f in dataclasses.fields(c)}), None)
        if owner:
            nested[owner][key] = value
        elif key in engine_fields:
            top[key] = value
        else:
            raise TypeError(f"unknown engine argument {key!r}")
    return EngineConfig(**top, **{n: sections[n](**v) for n, v in nested.items()})


def chat_messages(conv, index: int) -> list[dict]:
    """A conversation checked: a non-empty list of {"role": str, "content": str or a list of text parts} dicts.
    Returned with each list of parts joined into one string, as the server does."""
    where = f"conversation {index}"
    if not isinstance(conv, (list, tuple)) or not conv:
        raise ValueError(f"{where}: a chat is a non-empty list of {{'role', 'content'}} dicts, got {reprlib.repr(conv)}")
    out = []
    for j, m in enumerate(conv):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}, message {j}: a dict with a string 'role' is needed, got {reprlib.repr(m)}")
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"{where}, message {j}: 'content' must be a string or a list of {{'type': 'text', "
                             f"'text': ...}} parts, got {reprlib.repr(content)}")
        out.append({**m, "content": content})
    return out


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(split_kwargs({"model": model, **kwargs}))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if hasattr(prompts, "tolist"):  # a tensor or an array: one prompt of ids, or a batch of them
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_integer(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts: a string, a list of token ids, or a list of either; got {type(prompts).__name__}")
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        wrong = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if wrong is not None:
            raise ValueError(f"sampling_params: a SamplingParams or a list of them, got {type(wrong).__name__}")
        groups: list[list[str]] = []  # per prompt, its choices' request ids
        try:
            for p, sp in zip(prompts, params):
                groups.append([])
                for choice in sp.choices():
                    groups[-1].append(self.engine.add_request(p, choice))
        except ValueError as e:
            self.engine.discard([rid for g in groups for rid in g])  # all or nothing: a bad prompt queues none
            raise ValueError(f"prompt {len(groups) - 1}: {e}") from e
        return self._run(groups, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages: a list of {{'role', 'content'}} dicts, or a list of such lists; got "
                             f"{reprlib.repr(messages)}")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(chat_messages(conv, i)) for i, conv in enumerate(conversations)]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, groups: list[list[str]], use_tqdm: bool) -> list[RequestOutput]:
        ids = [rid for g in groups for rid in g]
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm, leave=False)
        try:
            while self.engine.has_unfinished():
                bar.update(len(self.engine.step()))
        except BaseException:  # an error or Ctrl-C: the next call must not run (or wait on) this call's requests
            self.engine.discard(ids)
            raise
        finally:
            bar.close()
        return [RequestOutput.from_requests([self.engine.pop_finished(i) for i in g]) for g in groups]
