"""Offline API shaped like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from tqdm.auto import tqdm

from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams, SchedulerConfig
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
    def from_request(cls, req: Request) -> "RequestOutput":
        completion = CompletionOutput(0, req.output_text, list(req.output_token_ids), req.finish_reason)
        metrics = {"num_preemptions": req.num_preemptions, **req.kv_stats}
        if req.first_token_time is not None:
            metrics["ttft_s"] = req.first_token_time - req.arrival_time
        if req.finish_time is not None:
            metrics["latency_s"] = req.finish_time - req.arrival_time
        return cls(req.request_id, req.prompt, list(req.prompt_token_ids), [completion], req.finished, metrics)


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
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(p, sp))
        except ValueError as e:
            for rid in ids:  # all or nothing: a bad prompt queues none of this call's prompts
                self.engine.abort(rid)
                self.engine.pop_finished(rid)
            raise ValueError(f"prompt {len(ids)}: {e}") from e
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm, leave=False)
        while self.engine.has_unfinished():
            bar.update(len(self.engine.step()))
        bar.close()
        return [RequestOutput.from_request(self.engine.pop_finished(i)) for i in ids]
