"""Prompt lookup on the device (kernels/ngram_lookup.py): the Triton kernel (interpreter on the CPU; compiled on a
GPU) and its torch twin, both against the host's NgramDraft.lookup on the same contexts (hash tables per request,
an independent computation)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from oasiskv.kernels.ngram_lookup import ngram_lookup, ngram_lookup_reference, write_step_tokens  # noqa: E402
from oasiskv.lookahead.ngram import NgramDraft  # noqa: E402

from tests.kernel_device import DEV  # noqa: E402


def paged_contexts(lengths, bs, vocab, seed, width_extra=2):
    """Random contexts laid out in a shuffled paged pool: (pool, tables, contexts as lists)."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = [-(-n // bs) for n in lengths]
    width = max(nblocks) + width_extra
    total = sum(nblocks) + 3
    order = torch.randperm(total, generator=gen).tolist()
    pool = torch.randint(0, vocab, (total, bs), generator=gen, dtype=torch.int32)  # stale tokens past each end
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    contexts = []
    for b, n in enumerate(lengths):
        blocks = [order.pop() for _ in range(nblocks[b])]
        tables[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        tokens = torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int32)
        positions = torch.arange(n)
        write_step_tokens(pool, tables[b, positions // bs], positions % bs, tokens)
        contexts.append(tokens.tolist())
    return pool, tables, contexts


def host_lookup(contexts, max_n, min_n):
    return [NgramDraft(max_n=max_n, min_n=min_n).lookup("r", c) for c in contexts]


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("max_n,min_n", [(3, 1), (2, 2), (4, 1), (1, 1)])
@pytest.mark.parametrize("vocab", [2, 7, 1000])
def test_kernel_and_reference_equal_the_host_lookup(bs, max_n, min_n, vocab):
    lengths = [1, 2, 3, 4, 5, bs, bs + 1, 37, 300 + bs]  # the last crosses the interpreter's 256-end blocks
    pool, tables, contexts = paged_contexts(lengths, bs, vocab, seed=bs * 100 + vocab + max_n)
    expected = host_lookup(contexts, max_n, min_n)
    lens = torch.tensor(lengths, dtype=torch.int32)
    ref = ngram_lookup_reference(pool, tables, lens, torch.full((len(lengths),), -7), max_n, min_n)
    assert ref.tolist() == expected
    out = torch.full((len(lengths),), -7, device=DEV)
    ngram_lookup(pool.to(DEV), tables.to(DEV), lens.to(DEV), out, max_n, min_n)
    assert out.cpu().tolist() == expected


def test_the_latest_occurrence_of_the_longest_suffix_wins():
    # suffix (5, 6, 7): "5 6 7" occurs at ends 4 and 11 (follower 1, then 2); "6 7" later at 15 (follower 3)
    context = [9, 5, 6, 7, 1, 0, 0, 0, 5, 6, 7, 2, 0, 6, 7, 3, 0, 5, 6, 7]
    pool, tables, _ = paged_contexts([len(context)], 4, 1000, seed=0)
    positions = torch.arange(len(context))
    write_step_tokens(pool, tables[0, positions // 4], positions % 4, torch.tensor(context))
    lens = torch.tensor([len(context)], dtype=torch.int32)
    for fn in (ngram_lookup, ngram_lookup_reference):
        assert fn(pool, tables, lens, torch.zeros(1, dtype=torch.long)).tolist() == [2]
        assert fn(pool, tables, lens, torch.zeros(1, dtype=torch.long), 2, 1).tolist() == [3]
    assert host_lookup([context], 3, 1) == [2]


def test_writes_into_a_view_of_the_step_ids():
    """The engine's use: the draft rows are the tail of the step's input ids."""
    pool, tables, contexts = paged_contexts([50, 70], 16, 5, seed=3)
    ids = torch.arange(10, dtype=torch.long)
    lens = torch.tensor([50, 70], dtype=torch.int32)
    ngram_lookup(pool, tables, lens, ids[8:])
    assert ids[:8].tolist() == list(range(8)) and ids[8:].tolist() == host_lookup(contexts, 3, 1)


@pytest.mark.parametrize("bad, message", [
    (dict(pool=torch.zeros(4, 4, dtype=torch.int64)), "pool must be a contiguous int32"),
    (dict(lengths=torch.ones(3, dtype=torch.int32)), "lengths must be"),
    (dict(out=torch.zeros(2, dtype=torch.int32)), "out must be a contiguous int64"),
    (dict(max_n=0), "1 <= min_n <= max_n"),
])
def test_bad_shapes_are_clear_errors(bad, message):
    args = dict(pool=torch.zeros(4, 4, dtype=torch.int32), tables=torch.zeros(2, 3, dtype=torch.int32),
                lengths=torch.ones(2, dtype=torch.int32), out=torch.zeros(2, dtype=torch.long), max_n=3, min_n=1)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        ngram_lookup(**args)


@pytest.mark.parametrize("lengths, table_entry, message", [
    ([11, 4], 0, r"lengths must be in \[1, 9\), got values in \[4, 11\]"),  # 11 tokens in a table of 2 x 4
    ([0, 4], 0, r"lengths must be in \[1, 9\)"),
    ([5, 4], 7, r"tables entries of the blocks read must be in \[0, 4\), got values in \[0, 7\]")])
def test_values_out_of_range_are_clear_errors_on_the_cpu(lengths, table_entry, message):
    """The kernel trusts its lengths and table entries: a length beyond the table read past it (a segfault under the
    interpreter) and the torch twin failed on an unrelated gather; found by a helper's audit of the kernels. An entry
    of an unread block (row 1's second) is not checked."""
    tables = torch.tensor([[0, table_entry], [1, 9]], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        ngram_lookup(torch.zeros(4, 4, dtype=torch.int32), tables, torch.tensor(lengths, dtype=torch.int32),
                     torch.zeros(2, dtype=torch.long))
