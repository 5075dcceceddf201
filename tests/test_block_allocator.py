"""CPU tests for the KV block allocator: exact ids, FIFO reuse, errors, usage."""
import random
from collections import deque

import pytest

from oasiskv.kv.block_allocator import BlockAllocator


def test_rejects_empty_pool():
    for n in (0, -1):
        with pytest.raises(ValueError):
            BlockAllocator(n)


def test_fresh_pool():
    a = BlockAllocator(5)
    assert a.num_blocks == 5
    assert a.num_free == 5
    assert a.usage == 0.0
    assert a.can_allocate(0) and a.can_allocate(5)
    assert not a.can_allocate(6)


def test_hands_out_lowest_ids_first():
    a = BlockAllocator(10)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(1) == [3]
    assert a.allocate(0) == []
    assert a.allocate(4) == [4, 5, 6, 7]
    assert a.num_free == 2
    assert a.allocate(2) == [8, 9]
    assert a.num_free == 0
    assert a.usage == 1.0


def test_freed_ids_reused_only_after_never_used_ones_fifo():
    a = BlockAllocator(6)
    first = a.allocate(3)  # [0, 1, 2]
    a.free([2, 0])  # goes to the back, in this order
    assert a.num_free == 5
    # never-used ids 3, 4, 5 come before the freed ones, then freed ids in free order
    assert a.allocate(4) == [3, 4, 5, 2]
    a.free([4])
    assert a.allocate(2) == [0, 4]
    assert a.num_free == 0
    a.free([1, 3, 5, 2, 0, 4])
    assert a.allocate(6) == [1, 3, 5, 2, 0, 4]
    assert first == [0, 1, 2]


def test_can_allocate_tracks_free_count():
    a = BlockAllocator(4)
    a.allocate(3)
    assert a.can_allocate(1) and not a.can_allocate(2)
    a.allocate(1)
    assert a.can_allocate(0) and not a.can_allocate(1)
    a.free([1, 2])
    assert a.can_allocate(2) and not a.can_allocate(3)


def test_over_allocation_raises_memory_error_and_takes_nothing():
    a = BlockAllocator(4)
    assert a.allocate(2) == [0, 1]
    a.free([0])
    with pytest.raises(MemoryError):
        a.allocate(4)
    assert a.num_free == 3
    assert a.usage == 0.25
    # the free list order is untouched by the failed call
    assert a.allocate(3) == [2, 3, 0]
    with pytest.raises(MemoryError):
        a.allocate(1)
    assert a.num_free == 0
    assert a.usage == 1.0


def test_double_free_raises():
    a = BlockAllocator(4)
    ids = a.allocate(2)
    a.free([ids[0]])
    with pytest.raises(ValueError):
        a.free([ids[0]])
    assert a.num_free == 3
    assert a.usage == 0.25


def test_duplicate_id_in_one_free_call_raises():
    a = BlockAllocator(4)
    a.allocate(2)
    with pytest.raises(ValueError):
        a.free([1, 1])


@pytest.mark.parametrize("bad", [2, 3, -1, 4, 100])
def test_free_of_foreign_or_never_allocated_id_raises(bad):
    a = BlockAllocator(4)
    a.allocate(2)  # 0, 1 allocated; 2, 3 never allocated; others out of range
    with pytest.raises(ValueError):
        a.free([bad])
    assert a.num_free == 2
    assert a.usage == 0.5
    assert a.allocate(2) == [2, 3]


def test_free_on_fresh_pool_raises():
    a = BlockAllocator(3)
    with pytest.raises(ValueError):
        a.free([0])
    assert a.num_free == 3


def test_usage_fraction():
    a = BlockAllocator(8)
    assert a.usage == 0.0
    x = a.allocate(2)
    assert a.usage == pytest.approx(2 / 8)
    y = a.allocate(4)
    assert a.usage == pytest.approx(6 / 8)
    a.free(x)
    assert a.usage == pytest.approx(4 / 8)
    a.free(y)
    assert a.usage == 0.0


def test_random_against_reference_model():
    """Random allocate/free sequences versus a plain deque/set model of the documented policy."""
    rng = random.Random(1234)
    for trial in range(50):
        n = rng.randint(1, 40)
        a = BlockAllocator(n)
        free, used = deque(range(n)), set()
        for _ in range(200):
            if rng.random() < 0.5:
                k = rng.randint(0, n + 2)
                if k > len(free):
                    assert not a.can_allocate(k)
                    with pytest.raises(MemoryError):
                        a.allocate(k)
                else:
                    assert a.can_allocate(k)
                    expect = [free.popleft() for _ in range(k)]
                    used.update(expect)
                    assert a.allocate(k) == expect
            elif used:
                ids = rng.sample(sorted(used), rng.randint(1, len(used)))
                a.free(ids)
                for i in ids:
                    used.remove(i)
                    free.append(i)
            assert a.num_free == len(free)
            assert a.usage == pytest.approx(len(used) / n)
            assert a.num_free + len(used) == n
