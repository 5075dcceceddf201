"""A model's generation_config.json as its default sampling params, as vLLM reads it (`--generation-config`):

- "auto" (default): the file in the model's Hugging Face directory, where there is one; for a GGUF, the
  recommended sampler settings llama.cpp reads from its metadata (general.sampling.temp, top_p, top_k, min_p;
  models/gguf_meta.py); a shipped config has none;
- "vllm": none, the neutral defaults (SamplingParams());
- a directory: its generation_config.json (missing: an error).

Of the file, the fields vLLM takes: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as
max_tokens; its eos_token_id also ends generation (vLLM adds it to every request's stop tokens)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

FILE = "generation_config.json"
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
DEFAULTED = tuple(SAMPLING_FIELDS.values())  # the SamplingParams fields a model's file may set


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict = field(default_factory=dict)  # SamplingParams fields -> the model's values
    eos_token_ids: tuple[int, ...] = ()
    source: str | None = None  # the file read, if any


def generation_defaults(setting: str, model_kind: str, model_location: str) -> GenerationDefaults:
    if setting == "auto" and model_kind == "gguf":
        return gguf_defaults(model_location)
    directory = config_directory(setting, model_kind, model_location)
    if directory is None:
        return GenerationDefaults()
    path = os.path.join(directory, FILE)
    from transformers import GenerationConfig

    try:
        values = GenerationConfig.from_pretrained(directory).to_diff_dict()
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    sampling = {ours: values[theirs] for theirs, ours in SAMPLING_FIELDS.items() if values.get(theirs) is not None}
    check_sampling(sampling, path)
    eos = values.get("eos_token_id")
    eos = () if eos is None else tuple(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return GenerationDefaults(sampling, eos, path)


def gguf_defaults(path: str) -> GenerationDefaults:
    from oasiskv.models import gguf_meta

    stat = os.stat(path)
    sampling = gguf_meta.sampling(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    if not sampling:
        return GenerationDefaults()
    source = f"{path} (general.sampling.*)"
    check_sampling(sampling, source)
    return GenerationDefaults(sampling, (), source)


def config_directory(setting: str, model_kind: str, model_location: str) -> str | None:
    """The directory whose generation_config.json is read, or None."""
    if setting == "vllm":
        return None
    if setting == "auto":
        if model_kind == "hf_dir" and os.path.isfile(os.path.join(model_location, FILE)):
            return model_location
        return None
    if not os.path.isfile(os.path.join(setting, FILE)):
        raise FileNotFoundError(f"--generation-config {setting}: no {FILE} there (or give auto, or vllm for "
                                f"the neutral defaults)")
    return setting


def check_sampling(sampling: dict, path: str) -> None:
    """The values as SamplingParams takes them: a bad one is named with its file at startup, not in a request."""
    from oasiskv.sampling_params import SamplingParams

    try:
        SamplingParams(**sampling)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e} (--generation-config vllm ignores the file)") from e
