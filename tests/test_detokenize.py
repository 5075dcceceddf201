"""Output text as a continuation of the prompt (vLLM's incremental detokenization). A SentencePiece-style tokenizer
(Metaspace: a word-start marker for the space) drops the marker of the first token it decodes, so an output decoded
alone lost its leading space (" Paris" came out "Paris"). The reference is the transformers tokenizer's own text of
prompt + output, less the prompt's text; byte-level BPE (the embedded model's) gives the same text both ways."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from oasiskv.config import SamplingParams
from oasiskv.models.tokenizer import HFTokenizer
from oasiskv.server.generation import TextStream
from tests.helpers import write_tiny_config

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"\u2581w{i}": i for i in range(3, 512)}}  # the tiny model's 512


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def reference(hf, prompt: list[int], ids: list[int]) -> str:
    before = hf.decode(prompt, skip_special_tokens=True)
    whole = hf.decode(prompt + ids, skip_special_tokens=True)
    assert whole.startswith(before)
    return whole[len(before):]


def test_a_word_start_marker_survives_after_the_prompt():
    hf = metaspace_tokenizer()
    assert hf.decode([7]) == "w7" and hf.decode([5, 7]) == "w5 w7"  # what decoding alone loses
    tok = HFTokenizer(hf)
    prompt = [1, 3, 4, 5, 6, 9, 10]
    context = tok.text_context(prompt)
    assert context == prompt[-4:]  # the fewest last tokens (4) whose text is whole
    assert tok.decode_after(context, [7, 8]) == reference(hf, prompt, [7, 8]) == " w7 w8"
    assert tok.decode_after(tok.text_context([1]), [7]) == "w7"  # after BOS alone nothing precedes the word
    assert tok.decode_after(context, []) == ""


def test_byte_level_bpe_text_is_the_same_either_way(smollm_hf_tokenizer):
    tok = HFTokenizer(smollm_hf_tokenizer)
    prompt = smollm_hf_tokenizer.encode("The capital of France is")
    for text in (" Paris, a city of 2 million.", "\n\nIt is Paris", " caf\u00e9 \u2014 na\u00efve"):
        ids = smollm_hf_tokenizer.encode(text, add_special_tokens=False)
        assert tok.decode_after(tok.text_context(prompt), ids) == tok.decode(ids) \
            == reference(smollm_hf_tokenizer, prompt, ids)


@pytest.fixture
def tiny_with_metaspace(tmp_path):
    model = write_tiny_config(tmp_path / "model")
    metaspace_tokenizer().save_pretrained(tmp_path / "tok")
    return model, str(tmp_path / "tok")


def test_generate_and_the_server_stream_give_the_leading_space(tiny_with_metaspace):
    from oasiskv.api import LLM

    model, tok_dir = tiny_with_metaspace
    llm = LLM(model=model, tokenizer=tok_dir, load_format="dummy", show_progress=False, kv_cache_gb=0.01)
    hf = llm.get_tokenizer()
    prompt = [1, 3, 4, 5, 6, 9]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={7: 100.0})  # w7 each step
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == [7, 7, 7]
    assert out.text == reference(hf, prompt, [7, 7, 7]) == " w7 w7 w7"
    stream = TextStream(llm.llm_engine.tokenizer, params, prompt)
    pieces = [stream.push([t]) for t in out.token_ids[:-1]]
    last, _ = stream.finish(out.token_ids[-1:], type("Out", (), {"text": out.text, "finish_reason": "length",
                                                                  "stop_reason": None})())
    assert "".join(pieces) + last == out.text


def test_a_tokenizer_path_without_a_tokenizer_is_a_clear_error_before_any_weights(tmp_path, monkeypatch):
    from oasiskv.api import LLM
    from oasiskv.models import loader

    monkeypatch.setattr(loader, "empty_model", lambda *a: pytest.fail("built the model first"))
    model = write_tiny_config(tmp_path / "model")
    for path in (tmp_path / "missing", tmp_path / "model"):  # no such path; a directory with a config only
        with pytest.raises(FileNotFoundError, match=f"--tokenizer {path}: not a .gguf file nor a directory with"):
            LLM(model=model, tokenizer=str(path), load_format="dummy", show_progress=False, kv_cache_gb=0.01)


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2 / Mistral style: BPE over Metaspace text, with bytes <0x00>..<0xFF> for characters out of the
    vocabulary, and tokenizers' ByteFallback decoder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for c in "\u2581abcdefghijklmnopqrstuvwxyz.!":
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


class Finished:
    text, finish_reason, stop_reason = None, "length", None


@pytest.mark.parametrize("seed", range(4))
def test_byte_fallback_text_keeps_its_finished_characters(seed):
    """Text cut inside a character spelled in byte tokens: ByteFallback's decoder turns the whole run of byte
    tokens into U+FFFD when its last character is unfinished, and stripping those took the run's finished characters
    with them, so the final text lost a character the stream had already sent (found by a helper's audit of the
    tokenizers). Reference: the text of the whole output, which every cut's text must begin, and, for a cut after a
    finished character, equal up to it."""
    import random

    hf = byte_fallback_tokenizer()
    tok, rng = HFTokenizer(hf), random.Random(seed)
    prompt = hf.encode("say it")
    alphabet = list("ab c.!") + ["\u65e5", "\u672c", "\u00e9", "\U0001f600"]
    for _ in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 10)))
        ids = hf.encode(text, add_special_tokens=False)
        full = reference(hf, prompt, ids)
        cut = rng.randrange(1, len(ids) + 1)
        final = tok.decode_after(tok.text_context(prompt), ids[:cut])
        whole_chars = [reference(hf, prompt, ids[:k]) for k in range(cut + 1)]
        assert final == max((t for t in whole_chars if "\ufffd" not in t), key=len), (text, cut)
        assert full.startswith(final)
        stream = TextStream(tok, SamplingParams(), prompt)
        sent = "".join(stream.push([i]) for i in ids[:cut - 1]) + stream.finish(ids[cut - 1:cut], Finished())[0]
        assert sent == final
