"""Where a captured decode step is split into graphs (engine/cuda_graph.py), and oasis's prediction
groups, checked against their definitions by brute force. The capture itself needs a GPU
(scripts/gpu_graph_check.py compares graph replays with eager steps there)."""
from types import SimpleNamespace

import pytest
import torch

from oasiskv.policies.base import KVPolicy
from oasiskv.policies.oasis import OasisPolicy


def oasis(layers: int, dense_layers: int = 0, group: int = 6) -> OasisPolicy:
    policy = object.__new__(OasisPolicy)  # only the grouping and splitting rules: no pools needed
    policy.cfg = SimpleNamespace(dense_layers=dense_layers)
    policy.PREDICT_GROUP = group
    policy.group_ends = policy.prediction_group_ends(layers)
    return policy


@pytest.mark.parametrize("layers", [1, 2, 5, 28, 36])
@pytest.mark.parametrize("per_graph", [0, 1, 3, 6, 40])
def test_default_splits_every_n_layers(layers, per_graph):
    splits = KVPolicy().graph_splits(layers, per_graph)
    expected = [] if per_graph == 0 else [i for i in range(layers - 1) if (i + 1) % per_graph == 0]
    assert splits == expected


@pytest.mark.parametrize("layers", [2, 3, 7, 28, 36])
@pytest.mark.parametrize("dense_layers", [0, 1, 2])
@pytest.mark.parametrize("group", [1, 3, 6])
def test_prediction_groups_cover_sparse_layers_and_the_last_layer_is_alone(layers, dense_layers, group):
    policy = oasis(layers, dense_layers, group)
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


@pytest.mark.parametrize("layers", [2, 7, 28, 36])
@pytest.mark.parametrize("dense_layers", [0, 2])
@pytest.mark.parametrize("per_graph", [0, 1, 3, 6])
def test_oasis_splits_keep_away_from_group_ends(layers, dense_layers, per_graph):
    policy = oasis(layers, dense_layers)
    splits = policy.graph_splits(layers, per_graph)
    gap = policy.PREDICT_GROUP // 2
    assert splits == sorted(set(splits)) and all(0 <= s < layers - 1 for s in splits)
    for s in splits:  # a split joins the copy stream: never within `gap` layers after a group's fork
        assert not any(0 <= s - end < gap for end in policy.group_ends)
    for s in KVPolicy().graph_splits(layers, per_graph):  # each wanted split is kept or moved later
        assert any(t >= s for t in splits) or all(
            any(0 <= t - end < gap for end in policy.group_ends) for t in range(s, layers - 1))


def test_forward_calls_after_layer_in_order_and_is_unchanged():
    from oasiskv.config import ModelConfig
    from oasiskv.models.llama import CausalLM

    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    torch.manual_seed(0)
    model = CausalLM(cfg).eval()

    class SelfOnly:
        def attend(self, layer, q, k, v):  # each token attends to itself only
            return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)

    ids, positions = torch.tensor([3, 7, 11]), torch.tensor([0, 1, 2])
    seen = []
    with torch.inference_mode():
        plain, _ = model(ids, positions, SelfOnly())
        split, _ = model(ids, positions, SelfOnly(), after_layer=seen.append)
    assert seen == list(range(cfg.num_layers))
    assert torch.equal(plain, split)
