"""What a GGUF's metadata gives, kept on disk: the HF config and the fast tokenizer (transformers' readings), and
where each tensor lies in the file.

Any of them needs the whole metadata parsed, vocabulary included: about 4 s each time for SmolLM2 on a 2-core CPU.
transformers and gguf's reader parsed it three times in every process that loads a GGUF (the CLI, a server, each
tensor-parallel rank, a test's subprocess). Now it is parsed once per file and the results are kept under
``~/.cache/oasiskv/gguf/<key>/`` (``$OASISKV_GGUF_CACHE`` moves it). The key hashes the file's absolute path, size
and mtime with transformers' and gguf's versions, so a changed file or another reader never reads a stale entry. Writes
land in a temporary name that is renamed into place, so a concurrent process sees a whole entry or none; a cache
that cannot be written is skipped.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "oasiskv", "gguf")


def entry_dir(path: str, mtime_ns: int, size: int) -> str:
    import transformers

    readers = f"{transformers.__version__}|{importlib.metadata.version('gguf')}"  # what parsed the entry
    key = hashlib.sha256(f"{path}|{size}|{mtime_ns}|{readers}".encode()).hexdigest()[:24]
    return os.path.join(os.environ.get("OASISKV_GGUF_CACHE", DEFAULT_DIR), key)


def config(path: str, mtime_ns: int, size: int) -> dict:
    """The HF config dict in the GGUF's metadata (transformers' reading of it)."""
    entry = entry_dir(path, mtime_ns, size)
    cfg = read_json(entry, "config.json")
    if isinstance(cfg, dict):
        return cfg
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        cfg = load_gguf_checkpoint(path, return_tensors=False)["config"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise unreadable(path, size, e) from e
    write_json(entry, "config.json", cfg)
    return cfg


def unreadable(path: str, size: int, error: Exception) -> ValueError:
    """gguf's own errors on a cut or damaged file name a numpy reshape; say what the user can act on."""
    return ValueError(f"{path} ({size:,} bytes) is not a readable GGUF file: truncated or corrupt? Copy or "
                      f"install it again ({type(error).__name__}: {error})")


def tensor_index(path: str, mtime_ns: int, size: int) -> dict:
    """{"arch": the model architecture, "tensors": [[name, GGML type, file offset, bytes, numpy dtype, shape], ...]}:
    enough to slice each tensor's data out of the file (gguf's reader gives the same slices)."""
    entry = entry_dir(path, mtime_ns, size)
    index = read_json(entry, "tensors.json")
    try:
        if isinstance(index["arch"], str) and all(offset + n_bytes <= size
                                                  for _, _, offset, n_bytes, _, _ in index["tensors"]):
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
                          list(t.data.shape)] for t in reader.tensors]}
    write_json(entry, "tensors.json", index)
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


def write_json(entry: str, name: str, value) -> None:
    try:
        os.makedirs(entry, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=entry, suffix=".tmp", delete=False, encoding="utf-8") as f:
            json.dump(value, f)
        os.replace(f.name, os.path.join(entry, name))
    except OSError:
        pass  # an unwritable cache only costs the next process the parse
