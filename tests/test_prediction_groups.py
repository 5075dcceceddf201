"""Oasis's prediction groups (which layers are predicted together, which the tail graph predicts), checked against
their definition."""
from types import SimpleNamespace

import pytest

from oasiskv.policies.oasis import OasisPolicy


def oasis(layers: int, dense_layers: int = 0, group: int = 6) -> OasisPolicy:
    policy = object.__new__(OasisPolicy)  # only the grouping rule: no pools needed
    policy.cfg = SimpleNamespace(dense_layers=dense_layers)
    policy.PREDICT_GROUP = group
    policy.group_ends = policy.prediction_group_ends(layers)
    return policy


def groups_of(policy: OasisPolicy, dense_layers: int) -> list[range]:
    ends = sorted(policy.group_ends)
    starts = [dense_layers] + [e + 1 for e in ends[:-1]]
    return [range(s, e + 1) for s, e in zip(starts, ends)]


@pytest.mark.parametrize("layers", [2, 3, 7, 28, 36])
@pytest.mark.parametrize("dense_layers", [0, 1, 2])
@pytest.mark.parametrize("group", [1, 3, 6])
def test_prediction_groups_cover_sparse_layers_and_the_last_layer_is_alone(layers, dense_layers, group):
    policy = oasis(layers, dense_layers, group)
    ends = sorted(policy.group_ends)
    if dense_layers >= layers:  # no sparse layer: nothing is predicted
        assert ends == []
        return
    assert ends[-1] == layers - 1 and all(e >= dense_layers for e in ends)
    for g in groups_of(policy, dense_layers):
        assert 1 <= len(g) <= group  # consecutive sparse layers, at most a group of them
    if layers - 1 > dense_layers:
        assert layers - 2 in policy.group_ends  # so the group after the last layer holds only it


@pytest.mark.parametrize("layers", [3, 7, 36])
@pytest.mark.parametrize("dense_layers", [0, 2])
@pytest.mark.parametrize("tail_from", [0, 1, 4, 30, 33, 36])
def test_the_tail_graph_predicts_from_the_first_layer_of_the_first_deferred_group(layers, dense_layers, tail_from):
    """A group is deferred to the tail graph when its prediction is made at tail_from or later; the next step's graph
    waits for the tail before the first layer of those groups, and no layer of an earlier group is in them."""
    policy = oasis(layers, dense_layers)
    deferred = [g for g in groups_of(policy, dense_layers) if g[-1] >= tail_from]
    expected = min((g[0] for g in deferred), default=None)
    got = policy.first_layer_of_group_ending_at(tail_from)
    if expected is None:  # nothing deferred: the wait is at no layer
        assert got >= layers
    else:
        assert got == expected


def test_groups_and_tail_of_qwen3_8b():
    policy = oasis(36)
    assert sorted(policy.group_ends) == [5, 11, 17, 23, 29, 34, 35]
    assert policy.first_layer_of_group_ending_at(36 - OasisPolicy.TAIL_LAYERS) == 30
    assert policy.first_layer_of_group_ending_at(36 - 12) == 24
