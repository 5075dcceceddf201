"""The eval harness without a model: task generators are deterministic under a seed, fit their
context, and their answers are what a brute-force reading of the prompt finds."""
from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from oasiskv.evals.harness import DENSE, Variant, expand_variants, row, split_runnable, variant_config
from oasiskv.evals.haystack import Haystack, insert_sentences
from oasiskv.evals.report import drop, plot, table, write_json
from oasiskv.evals.synthetic import make_samples, score_output, string_match_all
from oasiskv.evals.texts import join_lines, load_corpus
from oasiskv.config import EngineConfig
from oasiskv.models.tokenizer import ByteTokenizer

CONTEXT = 1024


@pytest.fixture(scope="module")
def haystack():
    return Haystack(load_corpus("sample"), ByteTokenizer())


def prompt_text(sample) -> str:
    return ByteTokenizer().decode(sample.prompt_ids)


def test_builtin_sample_and_line_joining():
    text = load_corpus("sample")[0]
    assert text.startswith("Chapter 1") and "Netherfield" in text and 6000 < len(text) < 12000
    assert join_lines(["a b", "c", "", "", "d"]) == "a b c\n\nd"
    assert len(load_corpus("stdlib")) > 10


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe"])
def test_samples_are_deterministic_and_fit_the_context(haystack, task):
    a = make_samples(task, haystack, CONTEXT, 3, seed=5)
    b = make_samples(task, haystack, CONTEXT, 3, seed=5)
    c = make_samples(task, haystack, CONTEXT, 3, seed=6)
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]
    assert [s.prompt_ids for s in a] != [s.prompt_ids for s in c]
    for s in a:
        assert CONTEXT - 64 <= len(s.prompt_ids) + s.max_tokens <= CONTEXT


def test_chat_samples_on_a_model_without_a_tokenizer(haystack):
    """A random-weight model's byte tokenizer has no `hf`: `eval --chat` on one failed with an AttributeError."""
    sample = make_samples("niah_single", haystack, CONTEXT, 1, seed=0, chat=True)[0]
    text = prompt_text(sample)
    assert text.startswith("user: ") and "\nassistant: " in text
    assert CONTEXT - 64 <= len(sample.prompt_ids) + sample.max_tokens <= CONTEXT


@pytest.mark.parametrize("task,keys,values", [("niah_single", 1, 1), ("niah_multikey", 4, 1),
                                               ("niah_multivalue", 1, 4)])
def test_needle_answers_match_a_brute_force_reading(haystack, task, keys, values):
    for s in make_samples(task, haystack, CONTEXT, 4, seed=1):
        text = prompt_text(s)
        found = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", text)
        asked = re.search(r"magic numbers? for ([a-z]+-[a-z]+) mentioned", text).group(1)
        assert len({k for k, _ in found}) == keys and len(found) == keys - 1 + values
        assert sorted(s.answers) == sorted(v for k, v in found if k == asked)


def test_variable_tracking_answers_match_a_brute_force_resolution(haystack):
    for s in make_samples("vt", haystack, CONTEXT, 4, seed=2):
        text = prompt_text(s)
        assigned = dict(re.findall(r"VAR ([A-Z]{5}) = (\d{5}|VAR [A-Z]{5})\.", text))

        def resolve(name):
            value = assigned[name]
            return resolve(value[4:]) if value.startswith("VAR ") else value

        value = re.search(r"assigned the value (\d{5}) in the text", text).group(1)
        assert sorted(s.answers) == sorted(n for n in assigned if resolve(n) == value)
        assert len(s.answers) == 2 and text.endswith("they are: VAR")


def special_words(text: str) -> list[tuple[int, str]]:
    return [(m.start(), m.group(1)) for m in re.finditer(r"One of the special words is: ([a-z]+)\.", text)]


def test_common_words_answer_is_strictly_the_most_frequent_and_spread(haystack):
    """The asked-for word is a third of the special words, every other is said once, and its sentences
    reach from the first quarter of the prompt to the last (counting them needs the whole context)."""
    for s in make_samples("cwe", haystack, 8192, 4, seed=3):
        text = prompt_text(s)
        found = special_words(text)
        counts = Counter(w for _, w in found).most_common()
        repeats = counts[0][1]
        assert [counts[0][0]] == s.answers and counts[1][1] == 1
        assert repeats > 12 and len(found) == 3 * repeats  # more than the old cap of 12 at 8K
        assert not [a for a, _ in counts for b, _ in counts if a != b and a in b]  # no word inside another
        where = [at / len(text) for at, w in found if w == s.answers[0]]
        assert min(where) < 0.25 and max(where) > 0.75
        assert text.endswith('appears most often in the provided text is "')


@pytest.mark.parametrize("context", [1024, 4096, 8192])
def test_common_words_say_the_answer_once_per_330_haystack_tokens(haystack, context):
    """The special sentences are as dense in every context (at 8K the old cap of 12 repeats spread them twice as
    thin as at 4K): the answer once per 330 tokens of book text (the byte tokenizer: one token a character), at
    least twice. The book text is what remains of the body without the special sentences, a little shorter than the
    text drawn (the sentences are split and joined again by one space): at most one repeat more than it says."""
    for s in make_samples("cwe", haystack, context, 3, seed=4):
        text = prompt_text(s)
        found = special_words(text)
        body = text[text.index("\n\n") + 2:text.index("\n\nQuestion:")]
        book = len(body) - sum(len(f"One of the special words is: {w}.") + 1 for _, w in found)
        assert max(2, book // 330) <= Counter(w for _, w in found)[s.answers[0]] <= max(2, book // 330) + 1


def test_common_words_repeat_more_in_a_longer_context(haystack):
    short, middle, long = (make_samples("cwe", haystack, c, 1, seed=4)[0] for c in (1024, 4096, 8192))
    said = [prompt_text(x).count(f"special words is: {x.answers[0]}.") for x in (short, middle, long)]
    assert 2 <= said[0] < said[1] < said[2] and abs(said[2] - 2 * said[1]) <= 2  # about twice as many at 8K as at 4K


def test_insert_sentences_keeps_order_and_depth():
    text = "One. Two. Three. Four."
    assert insert_sentences(text, ["A.", "B."], [0.0, 1.0]) == "A. One. Two. Three. Four. B."
    assert insert_sentences(text, ["A.", "B."], [0.5, 0.5]) == "One. Two. A. B. Three. Four."


def test_windows_are_deterministic_token_windows(haystack):
    w1 = haystack.window_ids(3000, random.Random(1))
    assert w1 == haystack.window_ids(3000, random.Random(1)) and len(w1) == 3000  # longer than the sample


def test_string_match_all():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)


def test_common_words_score_the_first_word_whole():
    assert score_output("cwe", ' "falcon".', ["falcon"]) == 1.0
    assert score_output("cwe", ": Falcon, then more", ["falcon"]) == 1.0
    assert score_output("cwe", " falconry", ["falcon"]) == 0.0  # a substring match took it
    assert score_output("cwe", " river, falcon", ["falcon"]) == 0.0  # listing every word
    assert score_output("cwe", "The special word is falcon", ["falcon"]) == 0.0  # a preamble
    assert score_output("cwe", "", ["falcon"]) == 0.0
    assert score_output("niah_single", "It is 1234567.", ["1234567"]) == 1.0


def test_variants_and_configs():
    variants = expand_variants(["dense", "quest", "oasis"], [256, 512], [0.05, 1.0], ["ngram"])
    assert Variant("quest", 256) in variants and Variant("oasis", 512, 1.0, "ngram") in variants
    assert len(variants) == 2 + 4 and all(v.mode != "dense" for v in variants)
    assert Variant("oasis", 512, 0.05, "ngram").label == "oasis@0.05 ngram budget=512"
    assert Variant("oasis", 512, 0.01).series == "oasis@0.01" and Variant("quest", 512).series == "quest"
    assert variant_config(EngineConfig(), Variant("quest", 256)).kv.budget == 256
    with pytest.raises(ValueError, match="kv-mode"):
        variant_config(EngineConfig(), Variant("no-such-mode", 256))


def test_miss_policy_sweep_names_its_rows():
    variants = expand_variants(["quest", "oasis"], [512], [0.05], ["ngram"], ["bound", "mass"], ["skip", "fill"])
    assert Variant("quest", 512, block_score="mass") in variants and len(variants) == 2 + 4  # quest has no misses
    assert Variant("oasis", 512, 0.05, "ngram", "bound", "skip").series == "oasis@0.05 ngram"  # defaults unnamed
    assert Variant("oasis", 512, 0.05, "ngram", "mass", "fill").series == "oasis+mass+fill@0.05 ngram"
    assert variant_config(EngineConfig(), Variant("oasis", 512, 0.05, miss_policy="fill")).kv.miss_policy == "fill"
    with pytest.raises(ValueError, match="--miss-policy must be one of"):
        variant_config(EngineConfig(), Variant("oasis", 512, 0.05, miss_policy="hope"))


def test_cap_sweep_skips_caps_below_one_block():
    sweep = expand_variants(["quest", "oasis"], [512, 2048], [0.01, 0.05, 1.0], None)
    runnable, skipped = split_runnable(sweep, block_size=16)
    assert skipped == [Variant("oasis", 512, 0.01)]  # 5 tokens; at 2048 it is 20 tokens, one block
    assert Variant("oasis", 2048, 0.01) in runnable and len(runnable) == 2 + 5
    for v in runnable:
        variant_config(EngineConfig(), v)  # the engine accepts every point it is asked to run


def rows_for_report():
    def r(v, metric, value, dense):
        return {**row(1024, v, "ppl", metric, value), "dense": dense}

    return [r(DENSE, "ppl", 10.0, 10.0), r(DENSE, "top1_agree", 100.0, 100.0),
            r(Variant("quest", 128), "ppl", 12.0, 10.0), r(Variant("quest", 128), "top1_agree", 90.0, 100.0),
            r(Variant("quest", 256), "top1_agree", 95.0, 100.0),
            r(Variant("oasis", 256, 0.05), "top1_agree", 97.0, 100.0)]


def test_drops_point_the_same_way_and_report_files(tmp_path):
    rows = rows_for_report()
    assert drop(rows[0]) is None and drop(rows[2]) == 2.0 and drop(rows[3]) == 10.0  # worse is positive
    lines = table(rows, ["oasis@0.01 budget=128"]).splitlines()
    assert lines[1].split() == ["metric", "dense", "mode", "budget", "128", "budget", "256"]
    assert lines[2].split() == ["ppl.ppl", "10.00", "quest", "12.00", "(2.00)"]
    assert lines[3].split() == ["ppl.top1_agree", "100.0", "quest", "90.00", "(10.00)", "95.00", "(5.00)"]
    assert lines[4].split() == ["oasis@0.05", "97.00", "(3.00)"]  # each cap is its own row
    assert lines[-1] == "not run (fetch cap x budget below one block): oasis@0.01 budget=128"
    write_json(tmp_path / "r.json", rows, {"quick": True})
    assert json.loads((tmp_path / "r.json").read_text())["results"][3]["drop"] == 10.0
    plot(tmp_path / "r.png", rows)
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("sizes", ["16,4", "4,16"])
def test_the_whole_block_row_has_whole_block_summaries_in_any_order(sizes):
    """The base configuration took the first listed size: with 4,16 the row named quest ran 4-token summaries."""
    import argparse

    from oasiskv.evals import cli

    parser = argparse.ArgumentParser()
    cli.add_args(parser)
    args = parser.parse_args(["--modes", "dense,quest", "--kv-budget", "512", "--summary-tokens", sizes])
    cli.fill_sizes(args)
    config = cli.base_config(args)
    listed = [None if n == config.cache.block_size else n for n in args.summary_tokens]
    got = {v.label: variant_config(config, v).kv.summary_tokens
           for v in expand_variants(args.modes, args.kv_budget, None, None, summary_tokens=listed)}
    assert got == {"quest budget=512": None, "quest+sum4 budget=512": 4}


def test_the_plot_draws_lookahead_agreement_as_values(tmp_path, monkeypatch):
    """Dense predicts nothing, so agreement rows have no drop; the plot kept only rows with a drop and left the
    agreement panel out (with agreement alone: 'nothing to plot')."""
    from oasiskv.evals import report

    agreement = [{**row(1024, Variant("oasis", b, 0.05), "lookahead", "agreement", v), "dense": None}
                 for b, v in ((512, 90.0), (1024, 95.0))]
    drawn = []
    monkeypatch.setattr("matplotlib.axes.Axes.plot", lambda ax, x, y, **kw: drawn.append((list(x), list(y))))
    report.plot(tmp_path / "a.png", rows_for_report() + agreement)
    assert ([512, 1024], [90.0, 95.0]) in drawn


def test_a_gutenberg_header_and_licence_are_left_out_of_the_book():
    """Moby-Dick's file carries Project Gutenberg's header and licence (a 7-digit tax id, shaped like a needle's
    value, and ZIP codes); a window running past the book's end read them. Only the text between the START and END
    lines is the book; a text without them is kept whole."""
    from oasiskv.evals.texts import gutenberg_body

    book = ("The Project Gutenberg EBook of X\n\nRelease Date: 2001\n\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***"
            "\n\n\nCall me Ishmael.\n\nThe end.\n\nEnd of Project Gutenberg's X\n\n*** END OF THIS PROJECT GUTENBERG "
            "EBOOK X ***\n\nEIN 64-6221541, Salt Lake City, UT 84116")
    assert gutenberg_body(book) == "Call me Ishmael.\n\nThe end.\n"
    assert gutenberg_body("Call me Ishmael.") == "Call me Ishmael."


def test_report_numbers_and_context_labels():
    """A drop that rounds to zero printed "-0.00", 99.999 printed "100.00" beside dense's "100.0"; the plot named
    a 512-token context "0K" (context // 1024), and 1024 and 1536 both "1K"."""
    from oasiskv.evals.report import context_label, fmt

    assert fmt("ppl", -0.0004) == "0.00" and fmt("ppl", 99.999) == fmt("ppl", 100.0) == "100.0"
    assert fmt("niah_single", 12.345) == "12.35" and fmt("kl", -0.0) == "0.0000"
    assert [context_label(c) for c in (512, 1024, 1536, 8192)] == ["512", "1K", "1.5K", "8K"]
