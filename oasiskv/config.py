"""Frozen configuration dataclasses: the only place defaults live. The CLI reads them."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from oasiskv.sampling_params import MAX_LOGPROBS, SamplingParams, is_integer  # noqa: F401 (their old home)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# a config without head_dim: transformers' default for the type (Qwen3Config's is 128, not hidden / heads; a Qwen3
# GGUF's config has its head_dim from qwen3.attention.key_length, read by gguf_meta: transformers' reader drops it)
DEFAULT_HEAD_DIM = {"qwen3": 128}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family model, read from a Hugging Face config dict."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None = None  # attention to the last N tokens only (Mistral 7B v0.1), which we do not run

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in REQUIRED_HF_KEYS if k not in hf]
        if missing:
            raise ValueError(f"the model's config has no {', '.join(missing)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rope_scaling = hf.get("rope_scaling") or (hf.get("rope_parameters") or {})
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
            rope_scaling = None
        theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(hf.get("head_dim") or DEFAULT_HEAD_DIM.get(model_type, hf["hidden_size"] // heads)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope_scaling or None,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            eos_token_ids=tuple(int(e) for e in eos_ids),
            bos_token_id=hf.get("bos_token_id"),
            sliding_window=int(hf["sliding_window"]) if hf.get("sliding_window") and hf.get("use_sliding_window", True)
            else None,
        )

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. Exactly one sizing rule applies, in this order:
    num_kv_blocks > kv_cache_gb > gpu_memory_gb > gpu_memory_utilization (GPU) / cpu default."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    gpu_memory_gb: float | None = None  # cap on all GPU memory the engine uses (emulates a smaller card)
    kv_cache_gb: float | None = None
    num_kv_blocks: int | None = None  # exact pool size, mainly for tests
    cpu_kv_cache_gb: float = 2.0  # default pool cap on machines without a GPU

    def __post_init__(self):
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for flag, value in (("--gpu-memory-gb", self.gpu_memory_gb), ("--kv-cache-gb", self.kv_cache_gb),
                            ("cpu_kv_cache_gb", self.cpu_kv_cache_gb)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be above 0, got {value}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got --num-kv-blocks {self.num_kv_blocks}")


KV_MODES = ("dense", "quest", "retrieval", "oasis", "oracle")  # oracle: eval only
DRAFTS = ("ngram", "repeat", "eagle3", "ngram+eagle3", "target", "target+eagle3")
# drafts that run an EAGLE-3 head (--draft-model, captured hidden states)
HEAD_DRAFTS = ("eagle3", "ngram+eagle3", "target+eagle3")
MISS_POLICIES = ("skip", "fetch", "fill")
# how blocks are scored for selection: Quest's bound summed over heads, or each head's bounds through a softmax
# over the blocks (an estimate of its attention mass) before the heads are combined (kernels/block_mass.py)
BLOCK_SCORES = ("bound", "mass")
# what one selection serves: every KV head of a layer (the blocks scored by all heads), or each KV head on its own
# (its own blocks, its own budget; policies/per_kv_head.py)
SELECT_PER = ("layer", "kv-head")
# the modes with a second pass over a shortlist (--shortlist): retrieval fetches the list, oasis ranks the listed
# blocks it holds on the GPU
SHORTLIST_MODES = ("quest", "retrieval", "oasis")


@dataclass(frozen=True)
class KVConfig:
    """Where KV lives and what a decode query attends to (see shared/DESIGN.md, 'One engine, several
    policies'). Budgets are in tokens per request per layer; sink and local blocks count inside it."""

    mode: str = "dense"
    budget: int = 2048
    sink_blocks: int = 1
    local_blocks: int = 4
    dense_layers: int = 0  # the first N layers attend densely (quest mode)
    block_score: str = "bound"  # bound | mass (BLOCK_SCORES)
    select_per: str = "layer"  # layer | kv-head (SELECT_PER); kv-head: the budget is per KV head
    # tokens per min/max summary, a divisor of the block size (default: the block size). Finer summaries rank blocks
    # by their sub-blocks (bound: the best one's; mass: the sum of theirs) at block_size / summary_tokens times the
    # summaries' memory; selection and transfers stay per block
    summary_tokens: int | None = None
    # (layer, weight) pairs: the layers share the tokens of --kv-budget in each, in proportion to their weights (1 where
    # not named); layers differ in what a selection loses (docs/ACCURACY.md, "Budgets per layer"). Retrieval and
    # oasis size every layer's working set for the largest budget
    layer_weights: tuple[tuple[int, float], ...] = ()
    # quest, retrieval, oasis: a second pass (0 = none). The block scores keep shortlist x the budget; the listed
    # blocks' exact attention mass, in a softmax over their keys alone, picks the budget (kernels/shortlist_mass.py):
    # reads their keys again. Oasis predicts the draft's list and keeps working sets of the list's size
    shortlist: float = 0.0
    host_kv_gb: float | None = None  # host store size; default: what the machine can spare
    # retrieval, oasis: tokens per request per layer resident on the GPU (default: the budget). Room beyond
    # the budget keeps recently used blocks, so fewer selected blocks miss; attention still reads the budget
    working_set: int | None = None
    # retrieval, oasis: tokens of one prompt's earlier prefill chunks kept on the GPU while it is prefilled in chunks,
    # so later chunks attend to them without reading the host store (kv/prefill_keep.py). Default: max_model_len
    # where a prompt can take more than one chunk, within a tenth of the GPU's room for KV (policies/factory.py)
    prefill_keep_tokens: int | None = None
    # oasis mode: a draft token runs beside each decode token; its selection is prefetched for the next step
    fetch_cap: float = 0.05  # at most fetch_cap x budget tokens prefetched per request per layer per step
    draft: str = "ngram"  # ngram | repeat | target | eagle3 | ngram+eagle3 | target+eagle3 (the last three: a head)
    draft_model: str | None = None  # EAGLE-3 head directory
    # a selected block not resident: skip it, fetch it synchronously, or fill its place with x_t's best
    # resident block outside its selection (kernels/miss_fill.py)
    miss_policy: str = "skip"

    def validate(self, block_size: int, num_layers: int) -> None:
        if self.mode not in KV_MODES:
            raise ValueError(f"--kv-mode must be one of {', '.join(KV_MODES)}, got {self.mode!r}")
        if self.dense_layers < 0:
            raise ValueError(f"--dense-layers must be at least 0, got {self.dense_layers}")
        if self.host_kv_gb is not None and not self.host_kv_gb > 0:
            raise ValueError(f"--host-kv-gb must be above 0, got {self.host_kv_gb}")
        if self.mode != "dense":  # (dense attends to everything: its budget, sink and local go unread)
            self.validate_budget(block_size)
        if self.block_score not in BLOCK_SCORES:
            raise ValueError(f"--block-score must be one of {', '.join(BLOCK_SCORES)}, got {self.block_score!r}")
        if self.select_per not in SELECT_PER:
            raise ValueError(f"--select-per must be one of {', '.join(SELECT_PER)}, got {self.select_per!r}")
        if self.select_per != "layer" and self.mode == "dense":
            raise ValueError("--select-per kv-head needs a sparse --kv-mode (dense selects nothing)")
        if self.summary_tokens is not None and (self.summary_tokens < 1 or block_size % self.summary_tokens):
            raise ValueError(f"--summary-tokens must divide the block size {block_size}, got {self.summary_tokens}")
        if not 0 <= self.dense_layers <= num_layers:
            raise ValueError(f"--dense-layers must be in [0, {num_layers}], got {self.dense_layers}")
        if self.working_set is not None:
            self.validate_working_set(block_size)
        if self.prefill_keep_tokens is not None and self.prefill_keep_tokens < 0:
            raise ValueError(f"--prefill-keep-tokens must be >= 0 (0: none), got {self.prefill_keep_tokens}")
        if self.prefill_keep_tokens and not self.offloaded:
            raise ValueError(f"--prefill-keep-tokens applies to the retrieval and oasis modes (--kv-mode {self.mode} "
                             "keeps every prompt's KV on the GPU)")
        if self.layer_weights:
            self.validate_layer_weights(block_size, num_layers)
        if self.shortlist:
            self.validate_shortlist()
        if self.dense_layers and self.offloaded:
            raise ValueError("--dense-layers is supported in quest mode only "
                             f"({self.mode} keeps no full KV on the GPU)")
        if self.mode == "oasis":
            self.validate_lookahead(block_size)
        elif self.draft != KVConfig.draft or self.draft_model is not None:
            raise ValueError(f"--draft and --draft-model (and speculative_config) apply to --kv-mode oasis, whose "
                             f"lookahead they drive; --kv-mode {self.mode} drafts nothing")

    def validate_budget(self, block_size: int) -> None:
        if self.budget % block_size or self.budget < block_size:
            raise ValueError(f"--kv-budget must be a positive multiple of the block size {block_size}, "
                             f"got {self.budget}")
        if self.sink_blocks < 0 or self.local_blocks < 1:
            raise ValueError("--sink-blocks must be >= 0 and --local-blocks >= 1 (the tail block is local)")
        if (self.sink_blocks + self.local_blocks) * block_size > self.budget:
            raise ValueError(f"sink ({self.sink_blocks}) + local ({self.local_blocks}) blocks exceed the budget "
                             f"of {self.budget // block_size} blocks")

    def validate_working_set(self, block_size: int) -> None:
        if not self.offloaded:
            raise ValueError(f"--working-set applies to the retrieval and oasis modes (--kv-mode {self.mode} keeps "
                             "the full KV on the GPU)")
        if self.working_set % block_size or self.working_set < self.budget:
            raise ValueError(f"--working-set must be a multiple of the block size {block_size} and at least "
                             f"--kv-budget ({self.budget}), got {self.working_set}")

    def validate_shortlist(self) -> None:
        if self.shortlist < 1:
            raise ValueError(f"--shortlist must be 0 (off) or at least 1 (times the budget), got {self.shortlist:g}")
        if self.mode not in SHORTLIST_MODES:
            raise ValueError(f"--shortlist applies to quest, retrieval and oasis, not {self.mode} (oracle ranks "
                             "every block exactly already)")

    def shortlist_blocks(self, budget_blocks: int) -> int:
        """Blocks the first pass keeps for a layer budget of `budget_blocks`."""
        return max(budget_blocks, int(self.shortlist * budget_blocks + 1e-6))

    def validate_layer_weights(self, block_size: int, num_layers: int) -> None:
        if self.mode == "dense":
            raise ValueError("--layer-weights needs a sparse --kv-mode (dense attends to every token)")
        layers = [layer for layer, _ in self.layer_weights]
        if len(set(layers)) < len(layers) or not all(0 <= layer < num_layers for layer in layers):
            raise ValueError(f"--layer-weights names each layer once, each in [0, {num_layers - 1}]; got {layers}")
        if not all(w > 0 for _, w in self.layer_weights):
            raise ValueError("--layer-weights must be positive")
        least = self.weighted_budget(min(self.weights_in_use(num_layers)), num_layers, block_size)
        if least < (self.sink_blocks + self.local_blocks) * block_size:
            raise ValueError(f"--layer-weights leaves a layer {least} tokens, less than its sink and local blocks: "
                             "raise --kv-budget or bring the weights closer to 1")

    def layer_budget(self, layer: int, num_layers: int, block_size: int) -> int:
        """Tokens per request of this layer: --kv-budget, or its share under --layer-weights."""
        if not self.layer_weights:
            return self.budget
        return self.weighted_budget(dict(self.layer_weights).get(layer, 1.0), num_layers, block_size)

    def weighted_budget(self, weight: float, num_layers: int, block_size: int) -> int:
        """A layer of this weight's share of --kv-budget x num_layers, rounded down to whole blocks (so the
        layers' sum stays within it)."""
        named = dict(self.layer_weights)
        total_weight = num_layers - len(named) + sum(named.values())
        return int(self.budget * num_layers * weight / total_weight + 1e-6) // block_size * block_size

    def weights_in_use(self, num_layers: int) -> set[float]:
        """The named weights, and 1 if some layer is not named."""
        return {w for _, w in self.layer_weights} | ({1.0} if len(self.layer_weights) < num_layers else set())

    def largest_budget(self, num_layers: int, block_size: int) -> int:
        """Tokens of the layer with the most budget: below it some layer attends densely."""
        if not self.layer_weights:
            return self.budget
        return self.weighted_budget(max(self.weights_in_use(num_layers)), num_layers, block_size)

    def working_set_blocks(self, num_layers: int, block_size: int) -> int:
        """Blocks per request and layer on the GPU (retrieval, oasis): --working-set, or the largest layer budget
        (times --shortlist) where that is more (a working set holds its layer's whole selection, or list)."""
        listed = self.shortlist_blocks(self.largest_budget(num_layers, block_size) // block_size) * block_size
        return max(self.working_set_tokens, listed) // block_size

    def for_mode(self, mode: str, **changes) -> "KVConfig":
        """This configuration for another mode (bench and eval run several from one set of flags):
        --working-set and --prefill-keep-tokens stay with the host modes and are dropped for those that hold
        everything on the GPU; --shortlist stays with the modes that take it, --draft and --draft-model with oasis."""
        kv = dataclasses.replace(self, mode=mode, **changes)
        if mode == "dense":  # dense selects nothing: a sweep's --select-per leaves it as it is
            kv = dataclasses.replace(kv, select_per="layer", summary_tokens=None, layer_weights=())
        if mode not in SHORTLIST_MODES:
            kv = dataclasses.replace(kv, shortlist=0.0)
        if mode != "oasis":  # the draft drives oasis's lookahead only
            kv = dataclasses.replace(kv, draft=KVConfig.draft, draft_model=None)
        return kv if kv.offloaded else dataclasses.replace(kv, working_set=None, prefill_keep_tokens=None)

    @property
    def working_set_tokens(self) -> int:
        return self.budget if self.working_set is None else self.working_set

    def validate_lookahead(self, block_size: int) -> None:
        if not 0 < self.fetch_cap <= 1:
            raise ValueError(f"--fetch-cap must be in (0, 1], got {self.fetch_cap}")
        if self.fetch_blocks(block_size) < 1:
            raise ValueError(f"--fetch-cap {self.fetch_cap} x --kv-budget {self.budget} is "
                             f"{self.fetch_cap * self.budget:g} tokens, less than one block of {block_size}: "
                             f"raise the cap to {block_size / self.budget:g} or more, or the budget to "
                             f"{math.ceil(block_size / self.fetch_cap / block_size - 1e-9) * block_size} or more")
        if self.draft not in DRAFTS:
            raise ValueError(f"--draft must be one of {', '.join(DRAFTS)}, got {self.draft!r}")
        if self.draft_model is not None and self.draft not in HEAD_DRAFTS:
            heads = ", ".join(HEAD_DRAFTS[:-1]) + f" or {HEAD_DRAFTS[-1]}"
            raise ValueError(f"--draft-model needs --draft {heads}, got --draft {self.draft}")
        if self.miss_policy not in MISS_POLICIES:
            raise ValueError(f"--miss-policy must be one of {', '.join(MISS_POLICIES)}, got {self.miss_policy!r}")

    def require_layer_layout(self, where: str) -> None:
        """For what exchanges or combines whole layers' KV chunks, summaries and block scores."""
        if self.select_per != "layer" or self.summary_tokens is not None or self.layer_weights or self.shortlist:
            raise ValueError(f"--select-per kv-head, --summary-tokens, --layer-weights and --shortlist are not "
                             f"supported with {where} (it works on one selection, one KV chunk and one summary per "
                             "layer and block, one budget and one pass)")

    def summary_parts(self, block_size: int) -> int:
        """Summaries per block."""
        return block_size // (self.summary_tokens or block_size)

    def fetch_blocks(self, block_size: int, budget: int | None = None) -> int:
        """Blocks a request may prefetch per layer per step: the fetch cap times the layer's budget (default
        --kv-budget; --layer-weights gives layers others), in blocks rounded down."""
        return int(self.fetch_cap * (self.budget if budget is None else budget) + 1e-9) // block_size

    @property
    def offloaded(self) -> bool:
        return self.mode in ("retrieval", "oasis")


ROLES = ("prefill", "decode")
KV_TRANSFERS = ("nixl",)


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation (`oasiskv serve --role`, oasiskv/disagg/). The prefill instance
    keeps each prompt's KV in its host store for the decode instance, which reads only the blocks its
    oasis prediction and its misses need."""

    role: str | None = None  # prefill | decode; None: a single instance
    kv_transfer: str = "nixl"
    release_timeout_s: float = 600.0  # prefill frees a prompt's KV if decode has not reported it done
    read_timeout_s: float = 10.0  # decode: one remote read; past it the request fails
    # decode: per request and layer, remote blocks kept in local host memory after their fetch
    # (a bounded LRU cache that saves re-reads of blocks evicted from the GPU working set)
    remote_cache_blocks: int = 4
    local_kv_blocks: int | None = None  # decode: local host blocks (spilled tails + cache); default: host sizing

    def validate(self) -> None:
        if self.role not in (None, *ROLES):
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kv_transfer not in KV_TRANSFERS:
            raise ValueError(f"--kv-transfer must be one of {', '.join(KV_TRANSFERS)}, got {self.kv_transfer!r}")
        # (a NaN deadline never expired, and its JSON failed every request; inf never frees a lost request's KV)
        if not all(0 < t < math.inf for t in (self.release_timeout_s, self.read_timeout_s)):
            raise ValueError(f"--kv-release-timeout and --kv-read-timeout must be positive and finite, got "
                             f"{self.release_timeout_s} and {self.read_timeout_s}")
        if self.remote_cache_blocks < 0:
            raise ValueError(f"--remote-cache-blocks must be >= 0, got {self.remote_cache_blocks}")
        if self.local_kv_blocks is not None and self.local_kv_blocks < 1:
            raise ValueError(f"--local-kv-blocks must be >= 1, got {self.local_kv_blocks}")
        self.check_flags_fit_the_role()

    # each setting that only some roles read, with its flag: set for another role, it would be silently ignored
    ROLE_SETTINGS = (("release_timeout_s", "--kv-release-timeout", ("prefill",)),
                     ("read_timeout_s", "--kv-read-timeout", ("decode",)),
                     ("remote_cache_blocks", "--remote-cache-blocks", ("decode",)),
                     ("local_kv_blocks", "--local-kv-blocks", ("decode",)))

    def check_flags_fit_the_role(self) -> None:
        default = DisaggConfig()
        for name, flag, roles in self.ROLE_SETTINGS:
            if getattr(self, name) != getattr(default, name) and self.role not in roles:
                where = "without --role" if self.role is None else f"with --role {self.role}"
                raise ValueError(f"{flag} is read only with --role {' or '.join(roles)}; it would be ignored {where}")


SCHEDULE_POLICIES = ("mixed", "prefill-first")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096  # per step; long prompts are prefilled in chunks of this size
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # mixed: each step runs every decode, then prefill chunks in the token budget left (no decode waits);
    # prefill-first: while a prompt can be admitted or a prefill is unfinished, steps run prefill chunks
    # only and decodes wait (SGLang's default); decode steps then stay pure, and replay CUDA graphs
    schedule_policy: str = "mixed"
    # plan and launch step t+1 while step t runs on the GPU; its input tokens are filled on the device
    # (engine/overlap.py). None: on where it helps and can run (a GPU, a draft source that drafts on the device)
    async_scheduling: bool | None = None

    @property
    def max_running(self) -> int:
        """Requests that may run at once: every running decode's token must fit in one step's budget, or the
        newest decodes and the waiting prompts would wait for the oldest to finish (vLLM refuses such a budget)."""
        return min(self.max_num_seqs, self.max_num_batched_tokens)

    def __post_init__(self):
        sizes = {"--max-num-seqs": self.max_num_seqs, "--max-num-batched-tokens": self.max_num_batched_tokens,
                 "--max-model-len": self.max_model_len}  # max_model_len None: the model's own
        for flag, value in sizes.items():
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, "
                             f"got {self.schedule_policy!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct GGUF)
    load_format: str = "auto"  # auto | dummy
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    device: str = "auto"
    seed: int = 0  # seeds dummy weights and unseeded sampling
    tensor_parallel_size: int = 1  # ranks: processes (one GPU each) sharing the model and the KV heads
    tokenizer: str | None = None  # another tokenizer than the model's: an HF directory or a .gguf file
    generation_config: str = "auto"  # default sampling params: auto (the model's generation_config.json) | vllm | DIR
    cache: CacheConfig = field(default_factory=CacheConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    show_progress: bool = True
    enforce_eager: bool = False  # False: decode-only steps on the GPU replay CUDA graphs

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class BenchConfig:
    """`oasiskv bench throughput | kernels | hf-reference` defaults (the CLI reads them)."""

    input_len: int = 16384
    output_len: int = 32  # single-mode runs (--kv-mode); --modes runs use what the user gives
    batch_sizes: str = "1,8,32"  # single-mode runs: fixed batches; 'max' is the most the KV memory holds
    warmup_steps: int = 3  # decode steps run before timing (kernel compiles)
    hbm_gbps: float | None = None  # None: a device-to-device copy measured in the same process
    num_prompts: int | None = None  # --modes runs: default one wave at the mode's largest concurrency
    profile_steps: int = 5  # decode steps timed phase by phase with --profile-step
    prompt_seed: int = 0  # random prompts are drawn from this seed, the same for every mode
    prompt_corpus: str | None = None  # None: random tokens; else windows of this evals corpus (a real model)
    # bench kernels: Qwen3-8B shapes at 16K context on the GPU
    kernel_context: int = 16384
    kernel_batches: str = "1,8,32"
    kernel_host_gib: float = 4.0  # pinned host store the gather reads from
    kernel_chunks: int = 2048  # (layer, block) chunks gathered in one launch
    kernel_rep_ms: int = 200  # triton do_bench repetition time


def draft_of_speculative_config(spec) -> tuple[str, str | None]:
    """vLLM's speculative_config ({"method": "eagle3", "model": DIR} or {"method": "ngram"}) as (draft, draft model):
    the draft predicts the next step's blocks here."""
    if not isinstance(spec, dict) or spec.get("method") not in ("eagle3", "ngram") or \
            (spec["method"] == "eagle3") != bool(spec.get("model")):  # ngram takes no model
        raise ValueError('speculative_config must look like {"method": "eagle3", "model": "DIR"} or '
                         f'{{"method": "ngram"}}, got {spec!r}')
    return spec["method"], spec.get("model")
