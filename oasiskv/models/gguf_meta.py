"""What a GGUF's metadata gives, kept on disk: the HF config and the fast tokenizer (transformers' readings), and
where each tensor lies in the file.

Any of them needs the whole metadata parsed, vocabulary included: about 4 s each time for SmolLM2 on a 2-core CPU.
transformers and gguf's reader parsed it three times in every process that loads a GGUF (the CLI, a server, each
tensor-parallel rank, a test's subprocess). Now it is parsed once per file and the results are kept under
``~/.cache/oasiskv/gguf/<key>/`` (``$OASISKV_GGUF_CACHE`` moves it). The key hashes the file's absolute path, size
and mtime with transformers' and gguf's versions, so a changed file or another reader never reads a stale entry. Writes
land in a temporary name that is renamed into place, so a concurrent process sees a whole entry or none; a cache
that cannot be written is skipped.

transformers' config misses what some GGUFs need: ``<arch>.attention.key_length`` (its Qwen3 reader drops it, and
Qwen3's head_dim is not hidden / heads) and llama.cpp's ``rope_freqs`` tensor (Llama 3.1 / 3.2's RoPE scaling).
``own_reading`` reads them in the parse that indexes the tensors; the stored config holds them.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "oasiskv", "gguf")
# what an entry holds: 2 adds own_reading to the config (entries stored before it lack head_dim and rope_freqs);
# 3 adds the sampling defaults to the tensor index; 4 reads <arch>.rope.scaling.*
ENTRY_FORMAT = 4
ARCHITECTURES = ("llama", "qwen2", "qwen3")  # GGUF architectures of the model types OasisKV runs (Mistral's is llama)
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's RoPE frequency factors: read into the config, not loaded as a weight
# llama.cpp's recommended sampler settings (general.sampling.*) that mean what vLLM's SamplingParams fields mean.
# Left out: penalty_repeat (llama.cpp applies it to the last penalty_last_n tokens, vLLM's repetition_penalty to the
# whole prompt and output), the XTC and mirostat samplers and the sampler order, which have no vLLM field.
SAMPLING_KEYS = {"general.sampling.temp": ("temperature", float), "general.sampling.top_p": ("top_p", float),
                 "general.sampling.top_k": ("top_k", int), "general.sampling.min_p": ("min_p", float)}
# tensor indexes this process parsed but could not store (an unwritable cache), by entry: reading the config and
# loading the weights each need the index, and each parse costs seconds
unstored_indexes: dict[str, dict] = {}


def entry_dir(path: str, mtime_ns: int, size: int) -> str:
    import transformers

    readers = f"{transformers.__version__}|{importlib.metadata.version('gguf')}|{ENTRY_FORMAT}"  # what made the entry
    key = hashlib.sha256(f"{path}|{size}|{mtime_ns}|{readers}".encode()).hexdigest()[:24]
    return os.path.join(os.environ.get("OASISKV_GGUF_CACHE", DEFAULT_DIR), key)


def config(path: str, mtime_ns: int, size: int) -> dict:
    """The HF config dict in the GGUF's metadata: transformers' reading of it, with own_reading's keys."""
    entry = entry_dir(path, mtime_ns, size)
    cfg = read_json(entry, "config.json")
    if isinstance(cfg, dict):
        return cfg
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    arch = tensor_index(path, mtime_ns, size)["arch"]
    if arch not in ARCHITECTURES:  # (transformers' refusal of it read as a damaged file below)
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    try:
        cfg = load_gguf_checkpoint(path, return_tensors=False)["config"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise unreadable(path, size, e) from e
    cfg.update(tensor_index(path, mtime_ns, size)["config"])  # what transformers' reader misses
    write_json(entry, "config.json", cfg)
    return cfg


def own_reading(reader) -> dict:
    """The config keys transformers' reader leaves out (those of the GGUF that has them)."""
    out = {"head_dim": head_dim_of(reader), "rope_scaling": rope_scaling_of(reader)}
    return {key: value for key, value in out.items() if value is not None}


def head_dim_of(reader) -> int | None:
    """llama.cpp's head size, <arch>.attention.key_length (value_length is the same in the models we run)."""
    arch = str(reader.fields["general.architecture"].contents())
    key_length = field_value(reader, f"{arch}.attention.key_length")
    value_length = field_value(reader, f"{arch}.attention.value_length")
    if value_length not in (None, key_length):
        raise ValueError(f"{arch}.attention.key_length {key_length} != value_length {value_length}: OasisKV's "
                         "attention needs one head size for keys and values")
    return None if key_length is None else int(key_length)


def rope_scaling_of(reader) -> dict | None:
    """The RoPE scaling the GGUF declares: llama.cpp's converter writes a linear scaling as <arch>.rope.scaling.type
    and .factor keys (and YaRN or LongRoPE with more keys, which OasisKV does not implement: refused rather than run
    unscaled), Llama 3's as the rope_freqs tensor."""
    arch = str(reader.fields["general.architecture"].contents())
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    factors = rope_freqs_scaling(reader)
    if kind in (None, "none"):
        return factors
    factor = field_value(reader, f"{arch}.rope.scaling.factor")
    if kind != "linear" or factors is not None or factor is None:
        also = ", with a rope_freqs tensor" if factors else ""
        raise ValueError(f"{arch}.rope.scaling.type {kind!r} (factor {factor}{also}) is not supported: OasisKV "
                         "implements linear RoPE scaling (with its factor) and Llama 3's rope_freqs")
    return {"rope_type": "linear", "factor": float(factor)}


def rope_freqs_scaling(reader) -> dict | None:
    """llama.cpp's converter writes Llama 3.1 / 3.2's llama3 RoPE scaling as a rope_freqs tensor, one factor per
    rotary frequency, and divides each inverse frequency by its factor: a rope scaling of that kind here."""
    import gguf

    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            factors = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)
            return {"rope_type": "freq_factors", "freq_factors": [float(f) for f in factors]}
    return None


def sampling_reading(reader) -> dict:
    """The SamplingParams fields the GGUF's general.sampling.* keys set (SAMPLING_KEYS)."""
    out = {}
    for key, (name, kind) in SAMPLING_KEYS.items():
        value = field_value(reader, key)
        if value is not None:
            out[name] = kind(value)
    return out


def sampling(path: str, mtime_ns: int, size: int) -> dict:
    """llama.cpp's recommended sampler settings in the GGUF, as SamplingParams fields (from the tensor index's parse)."""
    return tensor_index(path, mtime_ns, size)["sampling"]


def field_value(reader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def unreadable(path: str, size: int, error: Exception) -> ValueError:
    """gguf's own errors on a cut or damaged file name a numpy reshape; say what the user can act on."""
    return ValueError(f"{path} ({size:,} bytes) is not a readable GGUF file: truncated or corrupt? Copy or "
                      f"install it again ({type(error).__name__}: {error})")


def tensor_index(path: str, mtime_ns: int, size: int) -> dict:
    """{"arch": the model architecture, "tensors": [[name, GGML type, file offset, bytes, numpy dtype, shape], ...],
    "config": own_reading's keys}: enough to slice each tensor's data out of the file (gguf's reader gives the same
    slices); the config keys come from the same parse."""
    entry = entry_dir(path, mtime_ns, size)
    if entry in unstored_indexes:
        return unstored_indexes[entry]
    index = read_json(entry, "tensors.json")
    try:
        if isinstance(index["arch"], str) and isinstance(index["config"], dict) and \
                isinstance(index["sampling"], dict) and \
                all(offset + n_bytes <= size for _, _, offset, n_bytes, _, _ in index["tensors"]):
            return index
    except (KeyError, TypeError, ValueError):
        pass  # not an index of this file: parse it again
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise unreadable(path, size, e) from e
    index = {"arch": str(reader.fields["general.architecture"].contents()),
             "tensors": [[t.name, int(t.tensor_type), int(t.data_offset), int(t.n_bytes), t.data.dtype.str,
                          list(t.data.shape)] for t in reader.tensors],
             "config": own_reading(reader), "sampling": sampling_reading(reader)}
    if not write_json(entry, "tensors.json", index):
        unstored_indexes[entry] = index
    return index


def tokenizer(path: str, mtime_ns: int, size: int):
    """transformers' fast tokenizer built from the GGUF's vocabulary."""
    from transformers import AutoTokenizer

    stored = os.path.join(entry_dir(path, mtime_ns, size), "tokenizer")
    if os.path.isdir(stored):
        try:
            return AutoTokenizer.from_pretrained(stored)
        except Exception:  # noqa: BLE001 - whatever broke the entry, the GGUF still holds the vocabulary
            shutil.rmtree(stored, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    save(tok, stored)
    return tok


def save(tok, stored: str) -> None:
    try:
        os.makedirs(os.path.dirname(stored), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(stored), suffix=".tmp")
    except OSError:
        return
    try:
        tok.save_pretrained(staging)
        os.rename(staging, stored)  # fails when another process stored it first: theirs stays
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def read_json(entry: str, name: str):
    """The stored value, or None when there is none or it is not JSON."""
    try:
        with open(os.path.join(entry, name), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(entry: str, name: str, value) -> bool:
    """Whether the value was stored; an unwritable cache only costs the next process the parse."""
    try:
        os.makedirs(entry, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=entry, suffix=".tmp", delete=False, encoding="utf-8") as f:
            json.dump(value, f)
        os.replace(f.name, os.path.join(entry, name))
    except OSError:
        return False
    return True
