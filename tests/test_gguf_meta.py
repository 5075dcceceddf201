"""oasiskv/models/gguf_meta.py: the GGUF's config, tokenizer and tensor index read back from the disk cache,
without parsing the file, equal transformers' and gguf's own readings of it; a changed file gets a new entry; a
broken or unwritable cache costs only the parse."""
from __future__ import annotations

import json
import os

import pytest

from oasiskv.models import gguf_meta
from oasiskv.models.loader import embedded_default_path

TEXTS = ["Mr. Bingley was good-looking and gentlemanlike; he had a pleasant countenance.",
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
         "Numbers 1234567, accents café naïve, and a <|im_end|> special token."]


@pytest.fixture(scope="module")
def gguf():
    path = os.path.abspath(embedded_default_path())
    stat = os.stat(path)
    return path, stat.st_mtime_ns, stat.st_size


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OASISKV_GGUF_CACHE", str(d))
        yield d


@pytest.fixture(scope="module")
def built(gguf, cache_dir):
    """On an empty cache: transformers' own reading of the GGUF (config, tokenizer), which is then stored."""
    assert not os.path.exists(gguf_meta.entry_dir(*gguf))
    return json.loads(json.dumps(gguf_meta.config(*gguf))), gguf_meta.tokenizer(*gguf)


@pytest.fixture
def parses(built, monkeypatch):
    """Counts the parses of the GGUF and answers them with `built` (the first test checks the real ones)."""
    import transformers
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    calls, from_dir = [], transformers.AutoTokenizer.from_pretrained

    def tokenizer(path, gguf_file=None, **kwargs):
        if gguf_file is None:
            return from_dir(path, **kwargs)
        calls.append("tokenizer")
        return built[1]

    def config(path, return_tensors):
        calls.append("config")
        return {"config": dict(built[0])}

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", config)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    return calls


def same_tokenizer(a, b) -> None:
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
        ids = a.encode(text)
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": TEXTS[0]}]
    assert (a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert (a.eos_token_id, a.bos_token_id, len(a)) == (b.eos_token_id, b.bos_token_id, len(b))


def test_the_config_and_tokenizer_are_read_back_without_parsing_the_gguf(gguf, built, parses, smollm_hf_tokenizer):
    entry = gguf_meta.entry_dir(*gguf)
    assert os.path.isfile(os.path.join(entry, "config.json"))
    assert os.path.isfile(os.path.join(entry, "tokenizer", "tokenizer.json"))
    assert gguf_meta.config(*gguf) == built[0]
    same_tokenizer(gguf_meta.tokenizer(*gguf), built[1])
    assert parses == []
    same_tokenizer(built[1], smollm_hf_tokenizer)  # what was stored is transformers' tokenizer of the file
    assert built[0]["num_hidden_layers"] == 30 and built[0]["model_type"] == "llama"


def test_a_changed_file_or_another_reader_version_gets_its_own_entry(gguf, monkeypatch):
    import transformers

    path, mtime, size = gguf
    entry = gguf_meta.entry_dir(path, mtime, size)
    assert gguf_meta.entry_dir(path, mtime + 1, size) != entry
    assert gguf_meta.entry_dir(path, mtime, size + 1) != entry
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".other")
    assert gguf_meta.entry_dir(path, mtime, size) != entry
    monkeypatch.undo()
    assert gguf_meta.entry_dir(path, mtime, size) == entry
    real = gguf_meta.importlib.metadata.version
    monkeypatch.setattr(gguf_meta.importlib.metadata, "version", lambda name: real(name) + ".other")
    assert gguf_meta.entry_dir(path, mtime, size) != entry


def test_a_broken_entry_is_parsed_again_and_stored_whole(gguf, built, parses):
    entry = gguf_meta.entry_dir(*gguf)
    for name in ("config.json", os.path.join("tokenizer", "tokenizer.json")):
        with open(os.path.join(entry, name), "w") as f:
            f.write("{not json")
    assert gguf_meta.config(*gguf) == built[0]
    same_tokenizer(gguf_meta.tokenizer(*gguf), built[1])
    assert parses == ["config", "tokenizer"]
    assert gguf_meta.config(*gguf) == built[0]  # stored again: read back
    same_tokenizer(gguf_meta.tokenizer(*gguf), built[1])
    assert parses == ["config", "tokenizer"]


def test_an_unwritable_cache_costs_only_the_parse(gguf, built, tmp_path, monkeypatch, parses):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("OASISKV_GGUF_CACHE", str(blocker / "cache"))  # under a file: no directory can be made
    assert gguf_meta.config(*gguf) == built[0] and gguf_meta.config(*gguf) == built[0]
    same_tokenizer(gguf_meta.tokenizer(*gguf), built[1])
    assert parses == ["config", "config", "tokenizer"]
    assert not (blocker / "cache").exists()


def test_an_unwritable_cache_parses_the_tensor_index_once_a_process(gguf, tmp_path, monkeypatch):
    """Reading the config and loading the weights both need the index; with nowhere to store it, the second use
    read the file again with gguf's reader (seconds for SmolLM2)."""
    import gguf as gguf_lib

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("OASISKV_GGUF_CACHE", str(blocker / "cache"))
    real, opened = gguf_lib.GGUFReader, []
    monkeypatch.setattr(gguf_lib, "GGUFReader", lambda path: opened.append(path) or real(path))
    first = gguf_meta.tensor_index(*gguf)
    assert gguf_meta.tensor_index(*gguf) == first and opened == [gguf[0]]
    assert first["arch"] == "llama" and len(first["tensors"]) == 272
    path, mtime, size = gguf
    gguf_meta.tensor_index(path, mtime + 1, size)  # another version of the file: its own parse
    assert opened == [gguf[0]] * 2


@pytest.fixture(scope="module")
def reader(gguf):
    import gguf as gguf_lib

    return gguf_lib.GGUFReader(gguf[0])


def test_tensors_sliced_by_the_index_equal_ggufs_reader_bit_for_bit(gguf, cache_dir, reader):
    import gguf as gguf_lib
    import numpy as np

    # the raw (quantized) arrays and their types: equal inputs of gguf's deterministic dequantize, which the loader
    # then runs (dequantizing all 272 here three times took ~45 s of the suite; one tensor of each type is enough)
    expected = {t.name: t for t in reader.tensors}
    for attempt in ("parsed", "read back"):
        index = gguf_meta.tensor_index(*gguf)
        assert index["arch"] == "llama" and len(index["tensors"]) == len(expected) == 272, attempt
        data = np.memmap(gguf[0], mode="r", dtype=np.uint8)
        dequantized = set()
        for name, qtype, offset, n_bytes, dtype, shape in index["tensors"]:
            raw = data[offset: offset + n_bytes].view(np.dtype(dtype)).reshape(shape)
            want = expected[name]
            assert qtype == int(want.tensor_type) and raw.dtype == want.data.dtype, (attempt, name)
            assert raw.shape == want.data.shape and np.array_equal(raw, want.data), (attempt, name)
            if qtype not in dequantized:
                dequantized.add(qtype)
                got = gguf_lib.quants.dequantize(raw, gguf_lib.GGMLQuantizationType(qtype))
                assert np.array_equal(got, gguf_lib.quants.dequantize(want.data, want.tensor_type)), (attempt, name)
        assert len(dequantized) >= 2, dequantized  # Q4_1 and the float norms at least
    assert os.path.isfile(os.path.join(gguf_meta.entry_dir(*gguf), "tensors.json"))


def test_an_index_that_does_not_fit_the_file_is_built_again(gguf, cache_dir, reader, monkeypatch):
    import gguf as gguf_lib

    good = gguf_meta.tensor_index(*gguf)
    opened = []
    monkeypatch.setattr(gguf_lib, "GGUFReader", lambda path: opened.append(path) or reader)  # parsed once above
    stored = os.path.join(gguf_meta.entry_dir(*gguf), "tensors.json")
    bad = json.loads(json.dumps(good))
    bad["tensors"][-1][2] = gguf[2]  # the last tensor's offset at the end of the file
    for text in (json.dumps(bad), "{not json", json.dumps({"arch": "llama"}), json.dumps({"tensors": good["tensors"]})):
        with open(stored, "w") as f:
            f.write(text)
        assert gguf_meta.tensor_index(*gguf) == good
    assert opened == [gguf[0]] * 4
    with open(stored) as f:
        assert json.load(f) == good
    assert gguf_meta.tensor_index(*gguf) == good and len(opened) == 4  # read back


def test_a_cut_file_is_refused_as_such(gguf, cache_dir, tmp_path):
    """The first 3 MB of the model: gguf's own error names a numpy reshape; ours names the file and the likely cause,
    for the config and for the tensor index alike."""
    cut = tmp_path / "cut.gguf"
    with open(gguf[0], "rb") as f:
        cut.write_bytes(f.read(3_000_000))
    stat = os.stat(cut)
    for read in (gguf_meta.config, gguf_meta.tensor_index):
        with pytest.raises(ValueError, match=r"cut.gguf \(3,000,000 bytes\) is not a readable GGUF file: truncated"):
            read(str(cut), stat.st_mtime_ns, stat.st_size)
