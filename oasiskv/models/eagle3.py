"""EAGLE-3 draft head (../shared/reference/eagle3.md): config parsing for the EAGLE/SpecForge and the
speculators layouts, the head module, a loader for both layouts and a saver in the EAGLE layout.

Capture convention. A head's aux layer ids are read as Hugging Face capture indices: index i is the
input of target layer i, i.e. transformers' hidden_states[i] (0 = embedding output), as vLLM reads
`eagle_aux_hidden_state_layer_ids` verbatim. Our runner captures by output-of-layer id (see
lookahead/base.py), so capture index i is our capture id i - 1. Heads we save record the convention
under CAPTURE_CONVENTION_KEY; a head that declares "output_of_layer" ids (SpecForge's internal naming)
is converted by adding 1.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from oasiskv.config import ModelConfig
from oasiskv.models.linear import Linear
from oasiskv.models.llama import MLP, Attention, AttentionBackend, CausalLM, RMSNorm, Rotary, rope_inv_freq

EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHITECTURES = ("Eagle3Speculator",)
CAPTURE_CONVENTION_KEY = "oasiskv_capture_index_convention"
HF_INDEX, OUTPUT_OF_LAYER = "hf_hidden_states_index", "output_of_layer"
# variants we do not implement; speculators' norm_output (feed the normed state back) is not SpecForge's
# norm_output (norm before lm_head, what every head does), so it is refused in the speculators layout only
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm")
UNSUPPORTED_SPECULATORS_FLAGS = UNSUPPORTED_FLAGS + ("norm_output",)


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the draft decoder layer; its vocab_size is the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    capture_indices: tuple[int, ...] | None  # HF convention (module docstring); None: the target default
    norm_before_residual: bool  # residual = hidden_norm(g) instead of g
    fc_bias: bool = False

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int,
                   capture_indices: tuple[int, ...] | None = None) -> "Eagle3Config":
        """A plain Llama draft layer with the target's dimensions (what EAGLE and SpecForge train)."""
        layer = dataclasses.replace(target, model_type="llama", num_layers=1, tie_word_embeddings=False,
                                    attention_bias=False, qk_norm=False)
        indices = checked_capture_indices(capture_indices or default_capture_indices(target.num_layers),
                                          target.num_layers)
        return cls(layer, min(draft_vocab_size, target.vocab_size), target.hidden_size, indices, False)


def default_capture_indices(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default: the inputs of layers 2, L//2 and L-3 (HF hidden_states indices)."""
    return 2, num_layers // 2, num_layers - 3


def parse_eagle3_config(hf: dict) -> Eagle3Config:
    arch = (hf.get("architectures") or [None])[0]
    unsupported = UNSUPPORTED_FLAGS
    if arch in SPECULATORS_ARCHITECTURES:
        unsupported = UNSUPPORTED_SPECULATORS_FLAGS
        layer_hf, ids = hf.get("transformer_layer_config"), hf.get("eagle_aux_hidden_state_layer_ids")
        if not isinstance(layer_hf, dict):
            raise ValueError("speculators EAGLE-3 config lacks transformer_layer_config")
    elif arch in EAGLE_ARCHITECTURES:
        layer_hf, ids = hf, (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if (hf.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
            raise ValueError("eagle_config.use_aux_hidden_state is false: an EAGLE-1/2 head, not EAGLE-3")
    else:
        known = ", ".join(EAGLE_ARCHITECTURES + SPECULATORS_ARCHITECTURES)
        raise ValueError(f"not an EAGLE-3 head: architectures {hf.get('architectures')!r}, expected one of {known}")
    for flag in unsupported:
        if hf.get(flag) or layer_hf.get(flag):
            raise ValueError(f"EAGLE-3 variant {flag}=true is not supported (only vanilla heads, "
                             "optionally with norm_before_residual)")
    try:
        layer = ModelConfig.from_hf({"model_type": "llama", "num_hidden_layers": 1, **layer_hf})
    except KeyError as e:
        raise ValueError(f"EAGLE-3 config lacks the Llama key {e}") from None
    if layer.num_layers != 1:
        raise ValueError(f"EAGLE-3 heads with {layer.num_layers} decoder layers are not supported (only 1)")
    return Eagle3Config(
        layer=layer,
        draft_vocab_size=int(hf.get("draft_vocab_size") or layer.vocab_size),
        target_hidden_size=int(hf.get("target_hidden_size") or layer.hidden_size),
        capture_indices=None if ids is None else hf_capture_indices(ids, hf.get(CAPTURE_CONVENTION_KEY, HF_INDEX)),
        norm_before_residual=bool(hf.get("norm_before_residual", False)),
        fc_bias=bool(hf.get("bias", False)),
    )


def hf_capture_indices(ids: list[int], convention: str) -> tuple[int, ...]:
    if convention not in (HF_INDEX, OUTPUT_OF_LAYER):
        raise ValueError(f"{CAPTURE_CONVENTION_KEY} must be {HF_INDEX} or {OUTPUT_OF_LAYER}, got {convention!r}")
    shift = 1 if convention == OUTPUT_OF_LAYER else 0
    return tuple(int(i) + shift for i in ids)


class DraftLayer(nn.Module):
    """The Llama decoder layer of EAGLE-3: attention reads concat(input_layernorm(embed),
    hidden_norm(g)), 2H wide, embedding first; the residual stream is g (H wide)."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        h = cfg.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(dataclasses.replace(cfg, hidden_size=2 * h), layer=0)
        self.self_attn.o_proj = Linear(cfg.num_heads * cfg.head_dim, h, bias=False)  # back to H, not 2H
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, cos, sin, backend: AttentionBackend) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        x = residual + self.self_attn(x, cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """fc + one draft layer + norm + lm_head over the draft vocabulary. The token embedding is the
    target's (shared, not copied, not a parameter of the head) unless the checkpoint brings its own."""

    def __init__(self, cfg: Eagle3Config, target_embedding: torch.Tensor | None, own_embedding: bool = False):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = Linear(3 * cfg.target_hidden_size, h, bias=cfg.fc_bias)
        self.midlayer = DraftLayer(cfg.layer, cfg.norm_before_residual)
        self.norm = RMSNorm(h, cfg.layer.rms_norm_eps)
        self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.rotary = Rotary(cfg.layer)
        self.embed_tokens = nn.Embedding(cfg.layer.vocab_size, h) if own_embedding else None
        self.target_embedding = None if own_embedding else target_embedding.detach()  # a plain tensor: unregistered

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Our runner's output-of-layer ids: HF capture index i is the output of layer i - 1."""
        return tuple(i - 1 for i in self.config.capture_indices)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        weight = self.target_embedding if self.embed_tokens is None else self.embed_tokens.weight
        return F.embedding(token_ids, weight)

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend, fed_back: bool = False) -> torch.Tensor:
        """token_ids, positions [N]; hidden [N, 3*H_t] (target features, fused by fc) or, fed_back, [N, H] (the
        head's own previous output, used as is). Returns the pre-norm output [N, H]."""
        width = self.config.hidden_size if fed_back else 3 * self.config.target_hidden_size
        if hidden.shape[-1] != width:
            what = "its own output" if fed_back else "3 target features"
            raise ValueError(f"EAGLE-3 head input of width {hidden.shape[-1]}; {what} should be {width} wide")
        if not fed_back:
            hidden = self.fc(hidden)
        embeds = self.embed(token_ids).to(hidden.dtype)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        return self.midlayer(embeds, hidden, cos, sin, backend)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [N, draft_vocab] in fp32."""
        return self.lm_head(self.norm(out)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]  # d2t holds offsets, not ids

    def reset_rotary(self) -> None:
        """inv_freq is a buffer, so a .to(dtype) rounds it; recompute it in fp32."""
        self.rotary.inv_freq = rope_inv_freq(self.config.layer).float().to(self.d2t.device)


# -- loading --------------------------------------------------------------------------------------------


def load_eagle3(directory: str, target: CausalLM, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> Eagle3Head:
    """Loads a head from a local directory (config.json + model.safetensors, sharded safetensors or
    pytorch_model.bin) in either layout, checked against the target it drafts for."""
    config_path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"EAGLE-3 head directory {directory} does not exist")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"EAGLE-3 head directory {directory} has no config.json")
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"EAGLE-3 head {config_path} cannot be read as JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"EAGLE-3 head {config_path} must hold a JSON object, got {type(hf).__name__}")
    cfg = parse_eagle3_config(hf)
    tensors = canonical_names(read_checkpoint(directory))
    cfg = check_against_target(cfg, target.config, "embed_tokens.weight" in tensors)
    target_embedding = target.model.embed_tokens.weight
    device = device or target_embedding.device
    dtype = dtype or target_embedding.dtype
    with torch.device(device):
        head = Eagle3Head(cfg, target_embedding, own_embedding="embed_tokens.weight" in tensors)
    head.to(dtype)
    head.reset_rotary()
    assign_tensors(head, tensors)
    return head.eval().requires_grad_(False)


def check_against_target(cfg: Eagle3Config, target: ModelConfig, has_embedding: bool) -> Eagle3Config:
    if cfg.target_hidden_size != target.hidden_size:
        raise ValueError(f"EAGLE-3 head expects target hidden size {cfg.target_hidden_size}, "
                         f"the target has {target.hidden_size}")
    if cfg.layer.vocab_size != target.vocab_size:
        raise ValueError(f"EAGLE-3 head vocab_size {cfg.layer.vocab_size} != target vocab_size {target.vocab_size}")
    if not 1 <= cfg.draft_vocab_size <= target.vocab_size:
        raise ValueError(f"EAGLE-3 head draft_vocab_size {cfg.draft_vocab_size} must be in [1, the target's "
                         f"{target.vocab_size}]")
    if not has_embedding and cfg.hidden_size != target.hidden_size:
        raise ValueError(f"EAGLE-3 head hidden size {cfg.hidden_size} != target hidden size {target.hidden_size} "
                         "and the checkpoint has no embed_tokens of its own")
    indices = cfg.capture_indices or default_capture_indices(target.num_layers)
    return dataclasses.replace(cfg, capture_indices=checked_capture_indices(indices, target.num_layers))


def checked_capture_indices(indices, num_layers: int) -> tuple[int, ...]:
    ascending = all(a < b for a, b in zip(indices, indices[1:]))  # the runner captures in layer order
    if len(indices) != 3 or not ascending or not all(1 <= i <= num_layers for i in indices):
        raise ValueError(f"EAGLE-3 capture indices {tuple(indices)} must be 3 ascending HF hidden_states indices "
                         f"in [1, {num_layers}] (index 0, the embedding output, is not captured)")
    return tuple(indices)


def read_checkpoint(directory: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files and os.path.isfile(os.path.join(directory, "pytorch_model.bin")):
        files = [os.path.join(directory, "pytorch_model.bin")]
    if not files:
        raise FileNotFoundError(f"EAGLE-3 head directory {directory} has neither *.safetensors nor pytorch_model.bin")
    from safetensors.torch import load_file

    tensors = {}
    for path in files:
        try:  # a truncated or corrupt file: one line naming it
            read = torch.load(path, map_location="cpu", weights_only=True) if path.endswith(".bin") else load_file(path)
        except Exception as e:
            raise ValueError(f"EAGLE-3 weights {path} cannot be read: {type(e).__name__}: {e}") from None
        tensors.update(read)
    return tensors


def canonical_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' layers.0.* is our midlayer.*; t2d (a membership mask) and the speculators
    verifier_* copies are not needed at inference."""
    out = {}
    for name, t in tensors.items():
        if name == "t2d" or name.startswith("verifier_"):
            continue
        out["midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name] = t
    return out


def assign_tensors(head: Eagle3Head, tensors: dict[str, torch.Tensor]) -> None:
    expected = dict(head.named_parameters()) | {"d2t": head.d2t}
    if "d2t" not in tensors and head.config.draft_vocab_size == head.config.layer.vocab_size:
        tensors = {**tensors, "d2t": torch.zeros_like(head.d2t)}  # full vocabulary: EAGLE drops d2t
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unknown:
        raise ValueError(f"EAGLE-3 checkpoint tensors with no place in the head: {unknown[:5]}")
    if missing:
        raise ValueError(f"EAGLE-3 checkpoint lacks {missing[:5]}")
    check_d2t(tensors["d2t"], head.config.layer.vocab_size)
    with torch.no_grad():
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(expected[name].shape):
                raise ValueError(f"EAGLE-3 tensor {name}: checkpoint shape {tuple(t.shape)} != "
                                 f"expected {tuple(expected[name].shape)} from config.json")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"EAGLE-3 tensor {name} holds NaN or infinite values")
            expected[name].copy_(t)


def check_d2t(d2t: torch.Tensor, vocab_size: int) -> None:
    """d2t maps draft id i to target id i + d2t[i]: every such id must be in the target's vocabulary (one outside it
    stopped generation at the next step's embedding lookup)."""
    if d2t.is_floating_point():
        raise ValueError(f"EAGLE-3 d2t must hold integer offsets, got {d2t.dtype}")
    ids = d2t + torch.arange(len(d2t), device=d2t.device)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"EAGLE-3 d2t maps draft ids to target ids in [{int(ids.min())}, {int(ids.max())}], "
                         f"outside the target vocabulary's [0, {vocab_size})")


# -- saving ---------------------------------------------------------------------------------------------


def save_eagle3(head: Eagle3Head, directory: str, dtype: torch.dtype = torch.float16) -> None:
    """config.json + model.safetensors in the EAGLE/SpecForge layout (LlamaForCausalLMEagle3)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {name: p.detach().to("cpu", dtype).contiguous() for name, p in head.named_parameters()}
    d2t = head.d2t.detach().cpu()
    t2d = torch.zeros(head.config.layer.vocab_size, dtype=torch.bool)
    t2d[d2t + torch.arange(len(d2t))] = True
    save_file({**tensors, "d2t": d2t, "t2d": t2d}, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(eagle_layout_config(head.config, dtype), f, indent=2)


def eagle_layout_config(cfg: Eagle3Config, dtype: torch.dtype) -> dict:
    layer = cfg.layer
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": layer.num_heads,
        "num_key_value_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": layer.rms_norm_eps,
        "rope_theta": layer.rope_theta,
        "rope_scaling": layer.rope_scaling,
        "max_position_embeddings": layer.max_position_embeddings,
        "vocab_size": layer.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,  # SGLang aliases lm_head to embed_tokens when true
        "attention_bias": False,
        "bias": cfg.fc_bias,
        "norm_before_residual": cfg.norm_before_residual,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.capture_indices), "use_aux_hidden_state": True},
        CAPTURE_CONVENTION_KEY: HF_INDEX,
    }
