"""Host-side pieces of a decode step, against plain-Python references: the block table array, the step upload, the
request's token view, and prompt-lookup drafting (incremental tables against a brute-force search)."""
import random

import numpy as np
import pytest
import torch

from oasiskv.engine.request import TokenView
from oasiskv.engine.runner import KeptTables, block_table_array
from oasiskv.engine.scheduler import ScheduledChunk
from oasiskv.engine.upload import StepUpload
from oasiskv.lookahead.ngram import NgramDraft


@pytest.mark.parametrize("lengths,width", [([3, 0, 7, 1], 0), ([5, 2], 9), ([], 4), ([0, 0], 0)])
def test_block_table_array_pads_each_list(lengths, width):
    rng = random.Random(0)
    tables = [[rng.randrange(1 << 20) for _ in range(n)] for n in lengths]
    got = block_table_array(tables, width)
    cols = max([width, 1] + lengths)
    want = [t + [0] * (cols - len(t)) for t in tables]
    assert got.dtype == np.int32 and got.shape == (len(tables), cols)
    assert got.tolist() == want


def test_block_tables_kept_between_steps_equal_a_fresh_conversion():
    """Tables that grow, one restarted under a new epoch (a preemption), one without an epoch (rebuilt each
    time), a request id reused by a new table, and requests that skip a step."""
    rng = random.Random(1)
    tables = KeptTables()
    live = {f"r{i}": ([rng.randrange(1 << 20) for _ in range(rng.randrange(1, 9))], i) for i in range(5)}
    epochs = iter(range(100, 10**6))
    for step in range(60):
        for rid, (table, epoch) in list(live.items()):
            if rng.random() < 0.3:
                table.append(rng.randrange(1 << 20))
            if rng.random() < 0.05:  # preempted and readmitted, or finished and its id reused: a new table
                live[rid] = ([rng.randrange(1 << 20) for _ in range(rng.randrange(1, 4))], next(epochs))
        decoding = [rid for rid in live if rng.random() < 0.8]
        chunks = [ScheduledChunk(rid, [1], 0, list(live[rid][0]), True,
                                 table_epoch=None if rid == "r4" else live[rid][1]) for rid in decoding]
        width = rng.choice([0, 40])
        assert np.array_equal(tables.build(chunks, width), block_table_array([c.block_ids for c in chunks], width))


def test_step_upload_returns_each_array_as_a_view_of_one_buffer():
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-2**40, 2**40, 7), rng.integers(0, 9, (3, 5)).astype(np.int32), np.zeros((0, 4), np.int32),
              rng.integers(0, 2, (2, 3)).astype(bool), np.arange(3, dtype=np.int32)[::2]]  # the last: not contiguous
    upload = StepUpload(torch.device("cpu"))
    for _ in range(3):  # buffers are reused in turn: each call's views keep their own values
        packed, views = upload(arrays)
        for a, t in zip(arrays, views):
            assert t.shape == a.shape and t.numpy().dtype == a.dtype and np.array_equal(t.numpy(), a)
            assert t.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
            assert t.data_ptr() % 16 == packed.data_ptr() % 16
    with pytest.raises(TypeError, match="int64, int32 or bool"):
        upload([np.zeros(3, np.float32)])


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
