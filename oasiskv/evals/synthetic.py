"""RULER-style tasks generated with a seed over book haystacks: needles (single key, several keys,
several values), variable tracking and common-word extraction. Every answer can be read back out of
the prompt by brute force (tests do so); a sample's score is the share of its answers found in the
model's greedy output (RULER's string-match-all), for common words whether its first word is the answer.

Difficulty is set so that the anchor itself succeeds (a task dense fails says nothing about a sparse
mode): on SmolLM2-135M-Instruct at 4K, RULER's own variable tracking (one chain of 4 hops) and common
words (3 of a numbered list) scored 0 for dense. Here variable tracking is one chain of one hop with
the answer primed by "VAR" (docs/ACCURACY.md has the numbers). Common words was a comma-separated list of
short words, one of them a quarter of it: dense scored no better than copying the list's first or last
word, and at 4K it named words not in the list. It now hides special words through the haystack, as the
needles are hidden (nouns of one token), one of them a third of those sentences and every other once, as many
sentences per haystack token at 8K as at 4K, and is scored on the first word of the answer, whole."""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

from oasiskv.evals.haystack import Haystack, insert_sentences

ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lively", "misty", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "upper", "vivid",
              "wild", "young", "zesty", "bitter", "clever", "distant", "early", "fierce")
NOUNS = ("anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tunnel",
         "valley", "wagon", "willow", "yacht", "zephyr", "basket", "cellar", "forest", "glacier", "hammer")

# cwe's special words: nouns that SmolLM2's tokenizer writes as one token with a space before it and without (as after
# the answer's opening quote), and that Austen's six novels use at most 20 times; none is part of another. Adjective-noun
# pairs, as the needles' keys, were copied wrongly by SmolLM2-135M (the noun right, the adjective a synonym: "sharp-eye"
# for keen-bridge), and nouns of several tokens often began right and ended wrong ("pillar" for pillow, "petal" for garden)
CWE_WORDS = ("anchor", "engine", "river", "forest", "button", "castle", "bridge", "apple", "ocean", "robot", "camera",
             "wallet", "cookie", "planet", "satellite", "radio", "owl", "bee", "fox", "wolf", "tree", "rock", "lake",
             "moon", "cloud", "stone", "sand", "leaf", "flower", "grass", "boat", "ship", "train", "bus", "floor",
             "phone", "bag", "cup", "plate", "glass", "hat", "coat", "shirt", "coin", "map", "flag", "bell", "horn",
             "wheel", "chain", "gear", "pipe", "tube", "tank", "motor", "cat", "dog", "pig", "mouse", "snake", "lion",
             "berry", "bean", "corn", "rice", "bread", "soup", "salt", "sugar", "milk")
# cwe: the answer once per 330 haystack tokens among twice as many words said once (a third of the sentences), so the
# special sentences are as dense at 8K (22 repeats, 66 sentences) as at 4K (11, 33): at 8K the old cap of 12 repeats
# spread them twice as thin as at 4K
CWE_TOKENS_PER_REPEAT = 330
CWE_MAX_REPEATS = (len(CWE_WORDS) - 1) // 2  # 34: 69 distinct words said once

NEEDLE = "One of the special magic numbers for {key} is: {value}."
WORD_NEEDLE = "One of the special words is: {word}."
CWE_INTRO = ("Some special words are hidden within the following text. Make sure to memorize them. "
             "I will quiz you about which special word appears most often afterwards.\n\n")
NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.\n\n")


@dataclass
class Parts:
    """A task instance before tokenization."""

    intro: str
    body: str
    question: str
    answer_prefix: str
    answers: list[str]
    max_tokens: int


@dataclass
class SyntheticSample:
    task: str
    prompt_ids: list[int]
    answers: list[str]
    max_tokens: int


def distinct_keys(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample([(a, b) for a in ADJECTIVES for b in NOUNS], n)
    return [f"{a}-{b}" for a, b in pairs]


def distinct_numbers(rng: random.Random, n: int, digits: int = 7) -> list[str]:
    return [str(v) for v in rng.sample(range(10 ** (digits - 1), 10 ** digits), n)]


def needles_task(rng: random.Random, filler: str, keys: int, values: int) -> Parts:
    """`keys` distinct keys (the first is asked for), `values` values for the asked key."""
    names = distinct_keys(rng, keys)
    numbers = distinct_numbers(rng, keys - 1 + values)
    asked, wanted = names[0], numbers[:values]
    pairs = [(asked, v) for v in wanted] + list(zip(names[1:], numbers[values:]))
    sentences = [NEEDLE.format(key=k, value=v) for k, v in pairs]
    depths = [rng.uniform(0.05, 0.95) for _ in sentences]
    if values == 1:
        question = f"What is the special magic number for {asked} mentioned in the provided text?"
        prefix = f"The special magic number for {asked} mentioned in the provided text is"
    else:
        question = f"What are all the special magic numbers for {asked} mentioned in the provided text?"
        prefix = f"The special magic numbers for {asked} mentioned in the provided text are"
    return Parts(NIAH_INTRO, insert_sentences(filler, sentences, depths), question, prefix, wanted,
                 max_tokens=9 * values + 4)


def variable_tracking_task(rng: random.Random, filler: str, hops: int) -> Parts:
    """One chain VAR A = value, VAR B = VAR A, ... placed in order through the haystack. RULER's
    phrasing, with the answer primed by its first "VAR" (SmolLM2-135M then lists names, not prose)."""
    names = ["".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(hops + 1)]
    while len(set(names)) < len(names):
        names = ["".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(hops + 1)]
    value = distinct_numbers(rng, 1, digits=5)[0]
    sentences = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    depths = sorted(rng.uniform(0.05, 0.95) for _ in sentences)
    intro = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain of variable assignments in the text above, {len(names)} "
              f"variables are assigned the value {value}, they are: VAR")
    return Parts(intro, insert_sentences(filler, sentences, depths), question, prefix, names,
                 max_tokens=8 * len(names) + 4)


def spread_depths(rng: random.Random, n: int) -> list[float]:
    """One depth drawn in each of n equal slices of [0.05, 0.95]: the sentences cover the whole haystack."""
    return [0.05 + 0.9 * (i + rng.random()) / n for i in range(n)]


def cwe_repeats(size: int) -> int:
    return min(CWE_MAX_REPEATS, max(2, size // CWE_TOKENS_PER_REPEAT))


def common_words_task(rng: random.Random, filler: str, repeats: int) -> Parts:
    """Special words hidden through the haystack in the needles' sentence form: the asked-for word
    `repeats` times and twice as many other words once each, one sentence in each of equal slices of the
    text, so the count spans the whole context. The answer is opened by a quote: without it SmolLM2-135M
    often began with a preamble ("The special word is: ...") and the first word was not the answer."""
    singles = 2 * repeats
    keys = rng.sample(CWE_WORDS, 1 + singles)
    words = [keys[0]] * repeats + keys[1:]
    rng.shuffle(words)
    sentences = [WORD_NEEDLE.format(word=w) for w in words]
    question = "Question: Which special word appears most often in the provided text?"
    prefix = 'Answer: The special word that appears most often in the provided text is "'  # the quote: no preamble
    return Parts(CWE_INTRO, insert_sentences(filler, sentences, spread_depths(rng, len(sentences))), question,
                 prefix, [keys[0]], max_tokens=12)


TASKS = {
    "niah_single": lambda rng, hay, size: needles_task(rng, hay.text(size, rng), keys=1, values=1),
    "niah_multikey": lambda rng, hay, size: needles_task(rng, hay.text(size, rng), keys=4, values=1),
    "niah_multivalue": lambda rng, hay, size: needles_task(rng, hay.text(size, rng), keys=1, values=4),
    "vt": lambda rng, hay, size: variable_tracking_task(rng, hay.text(size, rng), hops=1),
    "cwe": lambda rng, hay, size: common_words_task(rng, hay.text(size, rng), repeats=cwe_repeats(size)),
}


def render(parts: Parts, tokenizer, chat: bool) -> list[int]:
    text = f"{parts.intro}{parts.body}\n\n{parts.question}"
    if not chat:
        return tokenizer.encode(f"{text}\n{parts.answer_prefix}")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}]) + \
        tokenizer.encode_continuation(parts.answer_prefix)


def make_sample(task: str, haystack: Haystack, context: int, seed: int, chat: bool = False) -> SyntheticSample:
    """One instance of `task` whose prompt plus answer room fits `context` tokens (within 64 of it)."""
    build = TASKS[task]
    size, best, previous = context, None, None
    for _ in range(10):
        parts = build(random.Random(seed), haystack, size)
        ids = render(parts, haystack.tokenizer, chat)
        spare = context - parts.max_tokens - len(ids)
        if spare >= 0 and (best is None or spare < best[0]):
            best = (spare, parts, ids)
        if 0 <= spare <= 64:
            break
        slope = 1.0  # prompt tokens per unit of size, estimated from the last two tries (secant steps)
        if previous and previous[0] != size and previous[1] != len(ids):
            slope = max(0.1, (len(ids) - previous[1]) / (size - previous[0]))
        previous = (size, len(ids))
        size = max(16, size + round((spare - 32) / slope))  # aim at 32 tokens to spare
    if best is None:
        raise ValueError(f"could not fit a {task} sample into {context} tokens")
    _, parts, ids = best
    return SyntheticSample(task, ids, parts.answers, parts.max_tokens)


def make_samples(task: str, haystack: Haystack, context: int, count: int, seed: int,
                 chat: bool = False) -> list[SyntheticSample]:
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose from {', '.join(TASKS)}")
    return [make_sample(task, haystack, context, seed * 100_003 + i, chat) for i in range(count)]


def string_match_all(output: str, answers: list[str]) -> float:
    """Share of the answers that occur in the output (case-insensitive)."""
    low = output.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


def first_word_match(output: str, answers: list[str]) -> float:
    """1 when the output's first word (letters joined by hyphens) is an answer, whole and case-insensitive, else 0:
    a substring match gave "history" for "story", and a model that lists every word it read scored."""
    match = re.search(r"[A-Za-z]+(?:-[A-Za-z]+)*", output)
    return float(match is not None and match.group(0).lower() in {a.lower() for a in answers})


SCORERS = {"cwe": first_word_match}  # the other tasks: string_match_all


def score_output(task: str, output: str, answers: list[str]) -> float:
    return SCORERS.get(task, string_match_all)(output, answers)
