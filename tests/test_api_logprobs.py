"""The offline API's logprobs and prompt_logprobs (vLLM's shape: per token a dict of token id -> Logprob with rank
and text) against transformers' own forward of SmolLM2 over the same tokens."""
from __future__ import annotations

import pytest
import torch

from oasiskv.api import SamplingParams

PROMPT = "The three primary colors are red,"


def hf_logprob_rows(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_of_greedy_and_sampled_tokens_are_transformers(smollm_llm, smollm_hf):
    prompt = smollm_llm.tokenizer.encode(PROMPT)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=1.2, seed=4, max_tokens=6, ignore_eos=True, logprobs=0)]
    outs = smollm_llm.generate([prompt, prompt], params, use_tqdm=False)
    for out, k in zip(outs, (3, 0)):
        choice = out.outputs[0]
        rows = hf_logprob_rows(smollm_hf, prompt + choice.token_ids)[len(prompt) - 1:-1]
        assert len(choice.logprobs) == len(choice.token_ids) == 6
        for row, token, entry in zip(rows, choice.token_ids, choice.logprobs):
            top = row.topk(k).indices.tolist() if k else []
            assert list(entry)[0] == token and set(entry) == {token, *top}
            for t, lp in entry.items():
                assert lp.logprob == pytest.approx(float(row[t]), abs=1e-4)
                assert lp.rank == int((row >= row[t]).sum())
                assert lp.decoded_token == smollm_llm.tokenizer.decode([t])
    assert all(e[t].rank == 1 for e, t in zip(outs[0].outputs[0].logprobs, outs[0].outputs[0].token_ids))
    assert outs[0].prompt_logprobs is None and not smollm_llm.engine.requests


def test_prompt_logprobs_are_transformers(smollm_llm, smollm_hf):
    prompt = smollm_llm.tokenizer.encode(PROMPT)
    out = smollm_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                              use_tqdm=False)[0]
    rows = hf_logprob_rows(smollm_hf, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[p], rows[p - 1]
        assert list(entry)[0] == prompt[p] and set(entry) >= set(row.topk(2).indices.tolist())
        assert entry[prompt[p]].logprob == pytest.approx(float(row[prompt[p]]), abs=1e-4)
    assert out.outputs[0].logprobs is None


def test_n_choices_each_get_their_logprobs_and_bad_counts_are_refused(smollm_llm):
    out = smollm_llm.generate(PROMPT, SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=4, ignore_eos=True,
                                                     logprobs=1), use_tqdm=False)[0]
    for choice in out.outputs:
        assert [list(e)[0] for e in choice.logprobs] == choice.token_ids
    for k in (-1, 21, 1.5):
        with pytest.raises(ValueError, match="logprobs must be an integer"):
            SamplingParams(logprobs=k)
    assert not smollm_llm.engine.sampler.wanted and not smollm_llm.engine.sampler.recorded


def test_decoded_tokens_keep_special_tokens_as_vllms_do(smollm_llm, smollm_hf_tokenizer):
    """vLLM's Logprob.decoded_token is tokenizer.decode([id]) at transformers' default, special tokens kept (so does
    the server's logprobs): the chat markers <|im_start|> and <|im_end|> read as '' here."""
    messages = [{"role": "user", "content": "Name a colour."}]
    out = smollm_llm.chat(messages, SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2),
                          use_tqdm=False)[0]
    entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    texts = {t: lp.decoded_token for entry in entries for t, lp in entry.items()}
    assert texts == {t: smollm_hf_tokenizer.decode([t]) for t in texts}
    assert {"<|im_start|>", "<|im_end|>"} <= set(texts.values())  # the prompt's markers are among them


def test_a_tied_token_ranks_behind_its_ties_as_in_vllm():
    """vLLM's rank counts the tokens at least as likely as the token (vllm/v1/sample/ops/logprobs.py,
    batched_count_greater_than: x >= value): a token tied with another ranks 2, not 1."""
    from oasiskv.engine.logprobs import token_logprobs

    logits = torch.tensor([[2.0, 2.0, 0.5, 2.0], [0.1, 0.3, 0.2, 0.0]])
    got = token_logprobs(logits, [1, 2], [0, 0])
    rows = torch.log_softmax(logits, -1)
    assert [lp.rank for lp in got] == [int((row >= row[t]).sum()) for row, t in zip(rows, [1, 2])] == [3, 2]


def test_an_error_while_attaching_logprobs_leaves_no_request_wanting_them(smollm_llm, monkeypatch):
    """The prompt_logprobs forward of the first prompt fails (as out of memory would): the second prompt's request
    stayed in the sampler's wanted list, and async scheduling stays paused while any request is there."""
    import oasiskv.api

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(oasiskv.api, "prompt_logprobs", out_of_memory)
    sp = SamplingParams(temperature=0, max_tokens=2, logprobs=1, prompt_logprobs=1)
    with pytest.raises(RuntimeError, match="simulated"):
        smollm_llm.generate(["One, two,", "Red, green,"], sp, use_tqdm=False)
    assert not smollm_llm.engine.sampler.wanted and not smollm_llm.engine.sampler.recorded
    assert not smollm_llm.engine.sampler.reads_each_step
