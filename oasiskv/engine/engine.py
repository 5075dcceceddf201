"""The engine loop: requests in, one scheduler plan and one model step at a time, outputs out."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import reprlib
import sys
import time
import weakref
from dataclasses import dataclass, field

import torch

from oasiskv.config import EngineConfig
from oasiskv.sampling_params import SamplingParams, is_integer
from oasiskv.distributed.launch import start_tensor_parallel
from oasiskv.distributed.setup import attach_score_combiner, shard_for_rank
from oasiskv.engine.penalties import TokenHistory, bad_word_token_ids, banned_by_bad_words
from oasiskv.engine.request import Request
from oasiskv.engine.cuda_graph import DecodeGraphs
from oasiskv.engine.overlap import InFlight, resolve_async_scheduling
from oasiskv.engine.upload import HostCopies
from oasiskv.engine.runner import ModelRunner, StepResult
from oasiskv.engine.sampler import Sampler
from oasiskv.engine.scheduler import GPU_POOL, HOST_STORE, Scheduler
from oasiskv.kv.gpu_pool import bytes_per_block, plan_num_blocks
from oasiskv.lookahead.base import DraftChunk
from oasiskv.lookahead.factory import build_draft_source
from oasiskv.policies.factory import build_kv
from oasiskv.models.loader import load_model
from oasiskv.policies.dense import causal_attention
from oasiskv.engine.stopping import StopRules


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    step_time_s: float = 0.0
    preemptions: int = 0
    draft_tokens: int = 0  # oasis: sampled tokens that had a draft (a guess of them)
    draft_tokens_right: int = 0  # ... and the guess was right
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d["draft_accuracy"] = self.draft_tokens_right / self.draft_tokens if self.draft_tokens else None
        d.update(self.extra)
        return d


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device must be auto, cpu or cuda[:N], got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA GPU is available here (torch {torch.__version__}); use cpu or auto")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda[:N], got {name!r}")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
             "fp16": torch.float16, "float32": torch.float32, "float": torch.float32, "fp32": torch.float32}
    if name not in table:
        raise ValueError(f"--dtype must be one of auto, {', '.join(table)}; got {name!r}")
    return table[name]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        # --tensor-parallel-size N: this process is rank 0 and spawns the others (distributed/launch.py)
        self.tp = start_tensor_parallel(config, pick_device(config.device).type)
        try:
            self._build(config)
        except BaseException:
            # a failed engine's group would stay this process's while its traceback lives (a notebook keeps it),
            # and the next engine would join it: the spawned ranks go now
            if self.tp is not None and self.tp.shutdown is not None:
                self.tp.shutdown()
            raise

    def _build(self, config: EngineConfig) -> None:
        self.device = self.tp.device if self.tp else pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        loaded = load_model(config.model, config.load_format, self.device, self.dtype, config.seed,
                            config.show_progress, with_tokenizer=not self.tp or self.tp.is_leader,
                            tokenizer=config.tokenizer, generation_config=config.generation_config)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.generation = loaded.generation  # the model's default sampling params and extra EOS ids
        if self.generation.sampling and config.show_progress:
            print(f"[oasiskv] default sampling params from {self.generation.source}: {self.generation.sampling} "
                  f"(--generation-config vllm for the neutral ones)", file=sys.stderr)
        self.model_source = loaded.source
        self.max_model_len = config.scheduler.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:  # vLLM refuses it too
            raise ValueError(f"--max-model-len {self.max_model_len} is longer than the model's context of "
                             f"{self.model_config.max_position_embeddings} tokens (its max_position_embeddings)")
        window = self.model_config.sliding_window
        if window is not None and self.max_model_len > window:  # past it, full attention would give other tokens
            raise ValueError(f"the model attends to a sliding window of {window} tokens, which OasisKV does not "
                             f"implement: set --max-model-len {window} or less (got {self.max_model_len})")
        eos = (*self.model_config.eos_token_ids, *getattr(self.tokenizer, "eos_token_ids", ()),  # (rank 0's only)
               *self.generation.eos_token_ids)
        self.stops = StopRules(self.tokenizer, frozenset(eos), self.max_model_len)
        self.block_size = config.cache.block_size
        kv_model_config, cache_cfg, kv_cfg = self.model_config, config.cache, config.kv
        if self.tp:
            rank = shard_for_rank(self.model, cache_cfg, kv_cfg, self.tp, self.device)
            kv_model_config, cache_cfg, kv_cfg = rank.kv_model_config, rank.cache, rank.kv
        self.model.fuse_projections()  # before the KV pool takes the free memory: fusing copies a layer at a time
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        gpu_cache = cache_cfg
        if config.kv.offloaded:  # --num-kv-blocks then sizes the host store; the GPU keeps its default
            gpu_cache = dataclasses.replace(gpu_cache, num_kv_blocks=None)
        gpu_blocks = plan_num_blocks(kv_model_config, gpu_cache, self.dtype, self.device,
                                     self.weights_bytes(), self.profile_activation_bytes())
        if self.tp:
            gpu_blocks = self.tp.agree_min(gpu_blocks)
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        kv = build_kv(kv_model_config, cache_cfg, kv_cfg, gpu_blocks, self.max_model_len,
                      config.scheduler.max_running, self.dtype, self.device, timing=not use_graphs,
                      prefill_chunk=config.scheduler.max_num_batched_tokens, **self.kv_overrides())
        self.pool, self.host, self.policy, self.allocator = kv.pool, kv.host, kv.policy, kv.allocator
        if self.tp:
            attach_score_combiner(self.policy, self.tp, self.model_config)
        self.kv_description = kv.description
        sched_cfg = dataclasses.replace(config.scheduler, max_num_seqs=kv.max_running)
        self.scheduler = Scheduler(sched_cfg, self.allocator, self.block_size, self.max_model_len,
                                   HOST_STORE if config.kv.offloaded else GPU_POOL)
        graphs = DecodeGraphs(self.model, self.policy) if use_graphs else None
        if graphs is not None and self.tp:
            self.tp.before_leave.append(weakref.WeakMethod(graphs.release))
        self.runner = ModelRunner(self.model, self.policy, self.block_size, self.device, graphs,
                                  max_blocks=-(-self.max_model_len // self.block_size))
        self.drafter = None  # oasis mode: guesses each request's next token for the lookahead
        if self.policy.wants_drafts:
            self.drafter = build_draft_source(config.kv, self.model, self.device, self.dtype, config.model,
                                              kv_blocks=(self.allocator.num_blocks, self.block_size))
            self.runner.capture_layers = self.drafter.capture_layers
            self.runner.guess_after_drafts = self.drafter.wants_target_guess
        self.sampler = Sampler(self.device, config.seed)
        self.requests: dict[str, Request] = {}
        self.history_readers: set[str] = set()  # requests whose sampling reads their tokens (usually none)
        self.stats = EngineStats()
        self.in_flight: InFlight | None = None  # async scheduling: the step whose tokens are still on the device
        self.sampled_from: dict[str, int] = {}  # the last step's requests whose tokens were read at once (step())
        self.token_copies = HostCopies()
        self.async_scheduling = resolve_async_scheduling(config.scheduler.async_scheduling, self.drafter, self.device)
        self._ids = itertools.count()

    # -- set-up ---------------------------------------------------------------------------------
    @property
    def drafter(self):
        return self._drafter

    @drafter.setter
    def drafter(self, source) -> None:
        """A source that drafts on the device does so inside each step, through the runner."""
        self._drafter = source
        self.runner.fill_inputs = source.fill if source is not None and source.on_device else None

    def kv_overrides(self) -> dict:
        """Extra arguments of build_kv for the offloaded modes (a decode instance: disagg/decode.py)."""
        return {}

    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def profile_activation_bytes(self) -> int:
        """Peak activation memory of one full-size prefill step, measured (GPU only)."""
        if self.device.type != "cuda" or self.config.cache.kv_cache_gb:
            return 0
        n = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            hidden, _ = self.model(ids, torch.arange(n, device=self.device), _NoCacheCausal())
            self.model.logits(hidden[-self.config.scheduler.max_running:])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.empty_cache()
        return int(peak * 1.2) + (256 << 20)

    def stats_dict(self) -> dict:
        graphs = self.runner.graphs.counts if self.runner.graphs else {}
        tp = self.tp.stats() if self.tp else {}
        return {"kv_mode": self.policy.name, "async_scheduling": self.async_scheduling, **self.stats.as_dict(),
                **graphs, **self.kv_stats(), **tp}

    def kv_stats(self, request_id: str | None = None) -> dict:
        """The KV policy's statistics (one request's, with `request_id`, which they then forget) for the whole
        model: under tensor parallelism each rank moves its own heads' K/V over its own link, and rank 0's policy
        counts its share of the bytes only."""
        stats = self.policy.stats() if request_id is None else self.policy.request_stats(request_id)
        ranks = self.tp.world if self.tp else 1
        return {k: v * ranks if "bytes" in k and v is not None else v for k, v in stats.items()}

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (also done when the engine is garbage-collected)."""
        if self.tp and self.tp.is_leader:
            self.tp.shutdown()

    def max_concurrency(self, tokens_per_request: int) -> int:
        """How many requests of this many tokens the KV memory (pool or host store) holds at once."""
        fit = self.allocator.num_blocks // -(-tokens_per_request // self.block_size)
        return min(fit, self.scheduler.cfg.max_running)

    @property
    def kv_bytes_per_token(self) -> int:
        return bytes_per_block(self.model_config, 1, self.dtype)

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queues a request; raises ValueError (and queues nothing) if it can never run."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.n != 1:
            raise ValueError(f"an engine request is one choice (n 1, got {params.n}): LLM.generate and the server add "
                             "one per choice (SamplingParams.choices)")
        if hasattr(prompt, "tolist"):  # a tensor or an array of token ids
            prompt = prompt.tolist()
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(map(is_integer, prompt)):
            text, ids = None, [int(t) for t in prompt]
        else:
            raise ValueError(f"a prompt is a string or a list of integer token ids, got {reprlib.repr(prompt)}")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:  # (a text's too: a tokenizer larger than the model's vocabulary)
            source = "the prompt's text encodes to " if text is not None else ""
            raise ValueError(f"{source}token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}")
        ids = params.truncated(ids, self.max_model_len)
        if params.max_tokens is None:  # vLLM's: up to the model length
            params = dataclasses.replace(params, max_tokens=max(1, self.max_model_len - len(ids)))
        vocab = self.model_config.vocab_size
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {vocab}, "
                             f"got {params.logit_bias[-1][0]}")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise ValueError(f"allowed_token_ids must be below the vocabulary size {vocab}, "
                             f"got {max(params.allowed_token_ids)}")
        bad_words = bad_word_token_ids(self.tokenizer, params.bad_words, vocab) if params.bad_words else ()
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, text, ids, params, bad_word_ids=bad_words)
        self.scheduler.add(req)
        self.requests[rid] = req
        if params.reads_history:
            self.history_readers.add(rid)
        return rid

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self.scheduler.finish(req, "abort")
            self.release_kv(request_id)
            self.release_draft(request_id)
            self.sampler.forget(request_id)
            req.kv_stats = self.kv_stats(request_id)
            req.finish_time = time.perf_counter()
            req.output_text = self.stops.text(req, req.output_token_ids)  # as vLLM: the text so far

    def discard(self, request_ids: list[str]) -> None:
        """Abort and forget these requests: what a caller's step loop does after an error or an interrupt, so
        that its next call neither runs nor waits on them. A launched step that held only them is dropped too."""
        for rid in request_ids:
            if rid in self.requests:
                self.abort(rid)
                self.pop_finished(rid)
        if self.in_flight is not None and set(self.in_flight.request_ids) <= set(request_ids):
            self.in_flight = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One scheduler plan, one forward pass. Returns the requests that finished: in this step, or with async
        scheduling in the step before (whose tokens are read once this one is launched)."""
        overlap = self.overlap_now()
        self.sampled_from = {}  # request -> its output length before this step's token
        landed = self.land() if self.in_flight is not None and not overlap else []
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        for rid in plan.preempted:
            self.release_kv(rid)
            self.release_draft(rid)
        if not plan.chunks:
            return landed + (self.land() if self.in_flight is not None else [])
        t0 = time.perf_counter()
        with self.tp.lockstep() if self.tp else contextlib.nullcontext():
            result, flight = self.run_plan(plan, overlap)
        if overlap:
            landed = self.land() if self.in_flight is not None else []
            self.in_flight = flight
            self.stats.step_time_s += time.perf_counter() - t0
            return landed
        params = [self.requests[r].params for r in result.request_ids]
        histories = self.token_histories(result.request_ids, params)
        extra = (histories,) if histories is not None else ()  # (samplers of evals and tests take three arguments)
        tokens = self.sampler.sample(result.logits, result.request_ids, params, *extra) if result.request_ids else []
        self.sampled_from = {rid: len(self.requests[rid].output_token_ids) for rid in result.request_ids}
        self.stats.step_time_s += time.perf_counter() - t0
        finished = landed + self.accept_tokens(result.request_ids, tokens, result.chunks, result.draft_ids)
        if self.drafter is not None and not self.drafter.on_device:
            self.propose_drafts(result)
        return finished

    def run_plan(self, plan, overlap: bool) -> tuple[StepResult, InFlight | None]:
        """The plan's forward pass (on every rank) and, with `overlap`, the launch of its sampling, whose tokens the
        other ranks read too."""
        if self.tp:
            self.tp.send_step(plan, tokens_follow=overlap)
        result = self.runner.execute(plan, self.in_flight.pending if self.in_flight is not None else None)
        self.count_step(plan)
        if not overlap:
            return result, None
        flight = InFlight.launch(result, self.requests, self.max_model_len, self.sampler, self.token_copies)
        if self.tp and flight.request_ids:
            self.tp.send_tokens(flight.pending.tokens)
        return result, flight

    def count_step(self, plan) -> None:
        self.stats.steps += 1
        for c in plan.chunks:
            req = self.requests[c.request_id]
            req.num_computed_tokens += len(c.token_ids)
            if len(c.token_ids) == 1 and c.start >= len(req.prompt_token_ids):
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += len(c.token_ids)

    def accept_tokens(self, request_ids: list[str], tokens: list[int], chunks, drafts,
                      stale: frozenset[str] = frozenset()) -> list[Request]:
        """A step's sampled tokens (and the drafts that ran beside it, int64 on the host, row i: chunks[i]) into
        the requests. Returns the requests that finished. A request that ended meanwhile (aborted while its token
        was in flight) is skipped, as is an id in `stale` (a new request's now)."""
        if drafts is not None:  # the drafts the device made in that step, for the counts below
            for c, draft in zip(chunks, drafts.tolist()):
                req = self.requests.get(c.request_id)
                if req is not None and c.request_id not in stale:
                    req.draft_token_id = draft
        finished = []
        for rid, tok in zip(request_ids, tokens):
            req = self.requests.get(rid)
            if req is None or req.finished or rid in stale:
                continue
            if req.draft_token_id is not None:  # the draft that ran beside this step guessed `tok`
                self.stats.draft_tokens += 1
                self.stats.draft_tokens_right += req.draft_token_id == tok
            if self.append_token(req, tok):
                finished.append(req)
        return finished

    # -- async scheduling (engine/overlap.py) -------------------------------------------------
    def overlap_now(self) -> bool:
        """Plan the next step before this one's tokens are read (--async-scheduling). Not with a host draft source
        set after construction (as the tests' teacher is), nor while the sampler reads each step (the server's
        logprobs) or a request's sampling reads its tokens (penalties, min_tokens): all need each step's tokens
        on the host."""
        return (self.async_scheduling and (self.drafter is None or self.drafter.on_device)
                and not self.sampler.reads_each_step and not self.reading_histories())

    def reading_histories(self) -> bool:
        """Whether an unfinished request's sampling reads its tokens (penalties, min_tokens); the finished ones leave
        the set here, so a step with none of them looks at nothing."""
        if self.history_readers:
            self.history_readers = {r for r in self.history_readers if r in self.requests
                                    and not self.requests[r].finished}
        return bool(self.history_readers)

    def token_histories(self, request_ids: list[str], params: list[SamplingParams]) -> list[TokenHistory | None] | None:
        """Per sampling row, the tokens its penalties and min_tokens read (None: it has none); None when no row has."""
        if not any(p.reads_history for p in params):
            return None
        return [self.token_history(self.requests[rid]) if p.reads_history else None
                for rid, p in zip(request_ids, params)]

    def token_history(self, req: Request) -> TokenHistory:
        p, banned = req.params, ()
        if len(req.output_token_ids) < p.min_tokens:
            banned = tuple(p.stop_token_ids or ()) + (() if p.ignore_eos else tuple(self.eos_token_ids))
        if req.bad_word_ids:
            banned += banned_by_bad_words(req.bad_word_ids, req.output_token_ids)
        return TokenHistory(req.prompt_token_ids, req.output_token_ids, banned)

    def land(self) -> list[Request]:
        """Reads the tokens of the step in flight (waiting for it) and applies them."""
        flight, self.in_flight = self.in_flight, None
        tokens = flight.read()
        stale = flight.stale(self.requests)
        for rid in flight.request_ids:
            req = self.requests.get(rid)
            if req is not None and req.num_pending and rid not in stale:
                req.num_pending -= 1  # (last_pending stays: it may be the next step's, already launched)
        return self.accept_tokens(flight.request_ids, tokens, flight.chunks, flight.drafts, stale)

    def propose_drafts(self, result) -> None:
        """The draft source sees what the step computed and guesses the token after each new one."""
        chunks, row = [], 0
        guesses = result.draft_guesses.tolist() if result.draft_guesses is not None else []
        for i, c in enumerate(result.chunks):
            req, n = self.requests[c.request_id], len(c.token_ids)
            if not req.finished:
                context = req.tokens if c.sample else []
                drafted = i < len(guesses)  # a draft row ran beside this chunk: its token, and the target's guess
                ran = (c.token_ids[0] if c.draft_token_id is None else c.draft_token_id) if drafted else None
                chunks.append(DraftChunk(c.request_id, c.start, c.token_ids,
                                         req.token_slice(c.start + 1, c.start + n + 1), row, c.sample, context,
                                         ran, guesses[i] if drafted else None))
            row += n
        for rid, token in self.drafter.propose(chunks, result.captured).items():
            self.requests[rid].draft_token_id = token

    def release_kv(self, request_id: str) -> None:
        self.policy.release(request_id)
        if self.tp:  # the other ranks release it before the next plan
            self.tp.note_release(request_id)

    def release_draft(self, request_id: str) -> None:
        if self.drafter is not None:
            self.drafter.release(request_id)
        req = self.requests.get(request_id)
        if req is not None:
            req.draft_token_id = None

    def append_token(self, req: Request, token: int) -> bool:
        """Adds a sampled token and applies the stop rules. Returns True if the request finished."""
        now = time.perf_counter()
        req.first_token_time = req.first_token_time or now
        req.output_token_ids.append(token)
        reason = self.stops.reason(req, token)
        if reason is None:
            return False
        self.scheduler.finish(req, reason)
        self.release_kv(req.request_id)
        self.release_draft(req.request_id)
        req.kv_stats = self.kv_stats(req.request_id)
        self.sampler.forget(req.request_id)
        req.finish_time = now
        req.output_text = self.stops.final_text(req, reason)
        if reason == "stop_string":
            req.finish_reason = "stop"
        return True

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.stops.eos_token_ids

    def pop_finished(self, request_id: str) -> Request:
        return self.requests.pop(request_id)


class _NoCacheCausal:
    """Attention without a cache, for the memory-profiling pass: the same kernels prefill uses."""

    def attend(self, layer, q, k, v):
        return causal_attention(q, k, v, q.shape[-1] ** -0.5)
