"""Oasis's prediction groups (which layers are predicted together), checked against their definition."""
from types import SimpleNamespace

import pytest

from oasiskv.policies.oasis import OasisPolicy


def oasis(layers: int, dense_layers: int = 0, group: int = 6, shrinking: bool = False) -> OasisPolicy:
    policy = object.__new__(OasisPolicy)  # only the grouping rule: no pools needed
    policy.cfg = SimpleNamespace(dense_layers=dense_layers)
    policy.PREDICT_GROUP = group
    policy.group_ends = policy.prediction_group_ends(layers, shrinking)
    return policy


@pytest.mark.parametrize("shrinking", [False, True])
@pytest.mark.parametrize("layers", [2, 3, 7, 28, 36])
@pytest.mark.parametrize("dense_layers", [0, 1, 2])
@pytest.mark.parametrize("group", [1, 3, 6])
def test_prediction_groups_cover_sparse_layers_and_the_last_layer_is_alone(layers, dense_layers, group, shrinking):
    policy = oasis(layers, dense_layers, group, shrinking)
    ends = sorted(policy.group_ends)
    if dense_layers >= layers:  # no sparse layer: nothing is predicted
        assert ends == []
        return
    starts = [dense_layers] + [e + 1 for e in ends[:-1]]
    assert ends[-1] == layers - 1 and all(e >= dense_layers for e in ends)
    for start, end in zip(starts, ends):
        assert 1 <= end - start + 1 <= group  # consecutive sparse layers, at most a group of them
    if layers - 1 > dense_layers:
        assert layers - 2 in policy.group_ends  # so the group after the last layer holds only it
    if shrinking and layers - 4 >= dense_layers:
        assert layers - 4 in policy.group_ends  # the last groups: at most 3, 2 and 1 layers


def test_shrinking_groups_at_the_end_of_qwen3_8b():
    assert sorted(oasis(36, shrinking=True).group_ends) == [5, 11, 17, 23, 29, 32, 34, 35]
    assert sorted(oasis(36).group_ends) == [5, 11, 17, 23, 29, 34, 35]
