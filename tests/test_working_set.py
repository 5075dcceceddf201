"""GPU working set: exact slots, LRU eviction, protection of wanted blocks, row release."""
from __future__ import annotations

import pytest
import torch

from oasiskv.kv.working_set import WorkingSet

# the torch placement and the fused kernel (interpreted: conftest sets TRITON_INTERPRET=1)
both = pytest.mark.parametrize("fused", [False, True])


def place(ws, wanted_rows, num_blocks, step, layer=0, rows=(0,)):
    wanted = torch.tensor(wanted_rows, dtype=torch.int32)
    protect = torch.zeros(len(rows), num_blocks, dtype=torch.bool)
    protect.scatter_(1, wanted.clamp(min=0).long(), wanted >= 0)
    return ws.place(layer, torch.tensor(rows), wanted, protect, step)


@both
def test_empty_slots_fill_in_order_then_lru_is_evicted(fused):
    ws = WorkingSet(num_layers=2, rows=2, slots_per_row=3, max_blocks=10, device=torch.device("cpu"), fused=fused)
    assert ws.row("a") == 0 and ws.row("b") == 1
    miss, slots = place(ws, [[0, 4, 7]], 10, step=1)
    assert miss.tolist() == [[True, True, True]] and slots.tolist() == [[0, 1, 2]]
    miss, slots = place(ws, [[0, 7, -1]], 10, step=2)  # hits; block 4 not used this step
    assert miss.tolist() == [[False, False, False]] and slots[0, :2].tolist() == [0, 2]
    miss, slots = place(ws, [[0, 9, -1]], 10, step=3)  # block 4 (slot 1) is least recently used
    assert miss.tolist() == [[False, True, False]] and slots[0, 1].item() == 1
    assert ws.slot_of[0, 0, 4].item() == -1 and ws.slot_of[0, 0, 9].item() == 1
    miss, slots = place(ws, [[0, 9, 3]], 10, step=4)  # 7 (slot 2, used at step 2) goes now
    assert miss.tolist() == [[False, False, True]] and slots[0, 2].item() == 2
    assert ws.block_of[0, 0].tolist() == [0, 9, 3]
    assert ws.slot_of[1, 0].tolist() == [-1] * 10  # other layers untouched


@both
def test_rows_use_their_own_slot_ranges_and_release_resets(fused):
    ws = WorkingSet(num_layers=1, rows=2, slots_per_row=2, max_blocks=4, device=torch.device("cpu"), fused=fused)
    ws.row("a"), ws.row("b")
    miss, slots = place(ws, [[1, 2], [3, -1]], 4, step=1, rows=(0, 1))
    assert slots.tolist()[0] == [0, 1] and slots[1, 0].item() == 2
    ws.release("a")
    assert ws.slot_of[0, 0].tolist() == [-1] * 4 and ws.num_free_rows == 1
    assert ws.row("c") == 0 and ws.slot_of[0, 1, 3].item() == 2


@both
def test_protected_blocks_are_never_evicted(fused):
    ws = WorkingSet(num_layers=1, rows=1, slots_per_row=2, max_blocks=8, device=torch.device("cpu"), fused=fused)
    ws.row("a")
    place(ws, [[5, -1]], 8, step=1)  # 5 in slot 0 (old)
    place(ws, [[6, -1]], 8, step=2)  # 6 in slot 1 (newer)
    miss, slots = place(ws, [[5, 2]], 8, step=3)  # 5 is wanted: 6 must go although 5 is older
    assert miss.tolist() == [[False, True]] and slots.tolist() == [[0, 1]]
    assert ws.block_of[0, 0].tolist() == [5, 2]
