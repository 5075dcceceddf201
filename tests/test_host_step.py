"""Host-side pieces of a decode step, against plain-Python references: the block table tensor, the
request's token view, and prompt-lookup drafting (incremental tables against a brute-force search)."""
import random

import pytest
import torch

from oasiskv.engine.request import TokenView
from oasiskv.engine.runner import block_table_tensor
from oasiskv.lookahead.ngram import NgramDraft


@pytest.mark.parametrize("lengths,width", [([3, 0, 7, 1], 0), ([5, 2], 9), ([], 4), ([0, 0], 0)])
def test_block_table_tensor_pads_each_list(lengths, width):
    rng = random.Random(0)
    tables = [[rng.randrange(1 << 20) for _ in range(n)] for n in lengths]
    got = block_table_tensor(tables, width)
    cols = max([width, 1] + lengths)
    want = [t + [0] * (cols - len(t)) for t in tables]
    assert got.dtype == torch.int32 and got.shape == (len(tables), cols)
    assert got.tolist() == want


def test_token_view_reads_like_the_concatenation():
    prompt, output = list(range(10, 17)), list(range(50, 54))
    view, whole = TokenView(prompt, output), prompt + output
    assert len(view) == len(whole) and list(view) == whole
    for i in range(-len(whole), len(whole)):
        assert view[i] == whole[i]
    for start in range(-12, 13):
        for stop in range(-12, 13):
            assert view[start:stop] == whole[start:stop]
    assert view[::3] == whole[::3] and view[-3:] == whole[-3:]
    with pytest.raises(IndexError):
        view[len(whole)]
    output.append(99)  # a live view: the request's next token shows
    assert view[-1] == 99 and len(view) == len(whole) + 1


def brute_force_lookup(context: list[int], max_n: int, min_n: int) -> int:
    """The token after the latest earlier occurrence of the last n tokens, n from max_n down."""
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        suffix = context[-n:]
        for end in range(len(context) - 1, n - 1, -1):  # context[end - n:end] is an earlier n-gram
            if context[end - n:end] == suffix:
                return context[end]
    return context[-1]


@pytest.mark.parametrize("max_n,min_n", [(3, 1), (4, 2), (1, 1)])
@pytest.mark.parametrize("prompt_len, base", [(40, 0), (300, 151_000)])  # the second: numpy's keys, large ids
def test_ngram_lookup_matches_a_brute_force_search_as_the_context_grows(max_n, min_n, prompt_len, base):
    rng = random.Random(max_n * 10 + min_n)
    draft = NgramDraft(max_n=max_n, min_n=min_n)
    prompt = [base + rng.randrange(6) for _ in range(prompt_len)]
    output: list[int] = []
    for step in range(60):
        context = TokenView(prompt, output)
        assert draft.lookup("r", context) == brute_force_lookup(prompt + output, max_n, min_n), step
        # mostly one new token per step, sometimes several (a prefill chunk's worth), once a long chunk
        new = 1 if step % 7 else (100 if step == 14 else 3)
        output += [base + rng.randrange(6) for _ in range(new)]
    draft.release("r")
    assert draft.lookup("r", [1, 2, 1]) == brute_force_lookup([1, 2, 1], max_n, min_n)


def test_ngram_restarts_when_a_request_is_recomputed():
    draft = NgramDraft()
    long = [1, 2, 3, 4, 1, 2, 3, 9]
    draft.lookup("r", long)
    short = [5, 6, 5]  # shorter than what the tables saw: a recompute from position 0
    assert draft.lookup("r", short) == brute_force_lookup(short, 3, 1) == 6
