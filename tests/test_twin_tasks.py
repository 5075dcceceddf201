"""scripts/twin_tasks.py: dense's greedy answers against transformers' own generate, every rule's against dense's
when the budget covers the context, and its table's arithmetic."""
from __future__ import annotations

import copy

import torch

from scripts import selection_twin as twin
from scripts import twin_tasks
from tests.test_selection_twin import tiny_llama  # noqa: F401  (a fixture)


def prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(length)
    return [torch.randint(3, 97, (length,), generator=g).tolist() for _ in range(n)]


def test_dense_answers_are_transformers_greedy_generation(tiny_llama):  # noqa: F811
    reference = type(tiny_llama)(copy.deepcopy(tiny_llama.config)).eval()  # its own attention setting
    reference.load_state_dict(tiny_llama.state_dict())
    reference.set_attn_implementation("eager")
    for prompt in prompts(2, 90):
        (dense,) = twin_tasks.greedy_answers(tiny_llama, prompt, 12, [None], eos=set())
        with torch.inference_mode():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
        assert dense == out[0, len(prompt):].tolist()
    assert tiny_llama.config._attn_implementation == twin.ATTENTION_NAME


def test_an_end_of_sequence_token_ends_the_answer(tiny_llama):  # noqa: F811
    prompt = prompts(1, 60)[0]
    (free,) = twin_tasks.greedy_answers(tiny_llama, prompt, 10, [None], eos=set())
    (stopped,) = twin_tasks.greedy_answers(tiny_llama, prompt, 10, [None], eos={free[3]})
    assert stopped == free[:free.index(free[3]) + 1]


def test_a_budget_over_the_context_gives_denses_answers_and_a_small_one_changes_some(tiny_llama):  # noqa: F811
    wide = [twin.Rule(score, 16, per_head, 256) for score in ("bound", "mass", "oracle") for per_head in (False, True)]
    narrow = twin.Rule("bound", 8, False, 96)
    changed = 0
    for prompt in prompts(3, 200):
        dense, *rest = twin_tasks.greedy_answers(tiny_llama, prompt, 16, [None, *wide, narrow], eos=set())
        assert all(answer == dense for answer in rest[:-1])
        changed += rest[-1] != dense
    assert changed > 0


def test_the_table_scores_each_rule_against_dense():
    def sample(*answers):
        return [{"tokens": tokens, "score": score} for tokens, score in answers]

    per_task = {"a": [sample(([1, 2], 1.0), ([1, 2], 1.0)), sample(([3], 0.5), ([4], 0.0))],
                "b": [sample(([5], 1.0), ([6], 1.0)), sample(([7], 0.0), ([7], 0.0))]}
    dense, rule = twin_tasks.score_rules(["dense", "rule"], per_task)
    assert dense == {"rule": "dense", "tasks": {"a": 75.0, "b": 50.0}, "mean": 62.5, "same_answers": 100.0, "drop": 0.0}
    assert rule == {"rule": "rule", "tasks": {"a": 50.0, "b": 50.0}, "mean": 50.0, "same_answers": 50.0, "drop": 12.5}
