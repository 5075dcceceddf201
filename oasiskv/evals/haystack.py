"""Windows of book text, in tokens: the haystacks of the synthetic tasks and the perplexity windows."""
from __future__ import annotations

import random
import re

CHARS_PER_TOKEN_BOUND = 8  # English prose tokenizes at ~4 characters per token; 8 leaves a wide margin


class Haystack:
    """Draws token windows from a corpus (a list of documents) with a caller-supplied random generator."""

    def __init__(self, documents: list[str], tokenizer):
        docs = [d for d in documents if d.strip()]
        if not docs:
            raise ValueError("the corpus is empty")
        self.documents, self.tokenizer = docs, tokenizer

    def window_ids(self, num_tokens: int, rng: random.Random) -> list[int]:
        """num_tokens consecutive tokens starting at a paragraph or sentence start of a random document
        (documents shorter than the window are repeated)."""
        text = self.text_from_random_start(num_tokens * CHARS_PER_TOKEN_BOUND, rng)
        ids = self.tokenizer.encode(text)
        if len(ids) < num_tokens:
            raise ValueError(f"could not draw a {num_tokens}-token window")
        return ids[:num_tokens]

    def text(self, num_tokens: int, rng: random.Random) -> str:
        """About num_tokens tokens of running text."""
        return self.tokenizer.decode(self.window_ids(num_tokens, rng))

    def text_from_random_start(self, num_chars: int, rng: random.Random) -> str:
        weights = [len(d) for d in self.documents]
        doc = rng.choices(self.documents, weights=weights)[0]
        start = sentence_start_after(doc, rng.randrange(len(doc)))
        text = doc[start:]
        while len(text) < num_chars:
            text += "\n\n" + doc
        return text[:num_chars]


def sentence_start_after(text: str, position: int) -> int:
    """First paragraph or sentence start at or after position (0 if there is none)."""
    match = re.compile(r"(\n\n|[.!?] )").search(text, position)
    if match is None or match.end() >= len(text) - 1:
        return 0
    return match.end()


def split_sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def insert_sentences(text: str, sentences: list[str], depths: list[float]) -> str:
    """Inserts each sentence between the text's sentences at its depth (0 = start, 1 = end);
    sentences with equal depth keep their order."""
    parts = split_sentences(text)
    slots = [round(d * len(parts)) for d in depths]
    out = []
    ordered = sorted(zip(slots, range(len(sentences)), sentences))
    k = 0
    for i in range(len(parts) + 1):
        while k < len(ordered) and ordered[k][0] == i:
            out.append(ordered[k][2])
            k += 1
        if i < len(parts):
            out.append(parts[i])
    return " ".join(out)
