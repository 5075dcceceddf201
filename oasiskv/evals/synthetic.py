"""RULER-style tasks generated with a seed over book haystacks: needles (single key, several keys,
several values), variable tracking and common-word extraction. Every answer can be read back out of
the prompt by brute force (tests do so); a sample's score is the share of its answers found in the
model's greedy output (RULER's string-match-all).

Difficulty is set so that the anchor itself succeeds (a task dense fails says nothing about a sparse
mode): on SmolLM2-135M-Instruct at 4K, RULER's own variable tracking (one chain of 4 hops) and common
words (3 of a numbered list) scored 0 for dense. Here variable tracking is one chain of one hop with
the answer primed by "VAR", and common words asks for the one word that makes up a quarter of a
comma-separated list of short words, the answer opened by a quote (docs/ACCURACY.md has the numbers)."""
from __future__ import annotations

import random
import string
from dataclasses import dataclass

from oasiskv.evals.haystack import Haystack, insert_sentences

ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lively", "misty", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "upper", "vivid",
              "wild", "young", "zesty", "bitter", "clever", "distant", "early", "fierce")
NOUNS = ("anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tunnel",
         "valley", "wagon", "willow", "yacht", "zephyr", "basket", "cellar", "forest", "glacier", "hammer")

MAX_WORD_LETTERS = 7  # common-word lists use short words: SmolLM2-135M copies them back reliably

NEEDLE = "One of the special magic numbers for {key} is: {value}."
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


def common_words_task(rng: random.Random, vocabulary: list[str], num_words: int, common: int,
                      share: float) -> Parts:
    """A comma-separated list of num_words short words in which `common` words make up `share` of
    the list and every other word appears once (or a few times, always less often)."""
    short = [w for w in vocabulary if len(w) <= MAX_WORD_LETTERS]
    repeats = max(2, round(share * num_words / common))
    num_rare = max(0, num_words - common * repeats)
    chosen = rng.sample(short, min(len(short), common + num_rare))
    frequent, others = chosen[:common], chosen[common:]
    copies = -(-num_rare // len(others))  # a small vocabulary repeats its rare words, fewer times than `repeats`
    if copies >= repeats:
        raise ValueError(f"the corpus has too few distinct short words ({len(short)}) for a {num_words}-word list")
    words = frequent * repeats + (others * copies)[:num_rare]
    rng.shuffle(words)
    intro = "Below is a list of words. In these words, some appear more often than others.\n\n"
    if common == 1:
        question = "Question: What is the most common word in the above list?"
        prefix = 'Answer: The most common word in the list is "'
    else:
        question = f"Question: What are the {common} most common words in the above list?"
        prefix = f'Answer: The {common} most common words in the list are "'
    return Parts(intro, ", ".join(words), question, prefix, frequent, max_tokens=6 * common + 4)


TASKS = {
    "niah_single": lambda rng, hay, size: needles_task(rng, hay.text(size, rng), keys=1, values=1),
    "niah_multikey": lambda rng, hay, size: needles_task(rng, hay.text(size, rng), keys=4, values=1),
    "niah_multivalue": lambda rng, hay, size: needles_task(rng, hay.text(size, rng), keys=1, values=4),
    "vt": lambda rng, hay, size: variable_tracking_task(rng, hay.text(size, rng), hops=1),
    "cwe": lambda rng, hay, size: common_words_task(rng, hay.vocabulary(), num_words=size // 3, common=1, share=0.25),
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
