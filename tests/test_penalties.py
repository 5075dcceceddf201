"""Sampling penalties and min_tokens (engine/penalties.py) against independent references: transformers' logits
processors and generate on the embedded SmolLM2, and OpenAI's formula written out token by token."""
from __future__ import annotations

import random

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from oasiskv.api import SamplingParams
from oasiskv.engine.penalties import TokenHistory, apply_penalties, bad_word_token_ids, banned_by_bad_words
from oasiskv.engine.sampler import Sampler, sample_row
from oasiskv.models.tokenizer import ByteTokenizer

PROMPT = "Write a list of fruits: apple, banana, apple, banana,"


def random_case(seed: int, vocab: int = 300):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g) * 4
    prompt = torch.randint(0, vocab, (40,), generator=g).tolist()
    output = torch.randint(0, vocab, (25,), generator=g).tolist()  # repeats: 25 draws from 300 ids, and seed-made
    return logits, prompt, output + output[:5]


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_repetition_penalty_is_transformers_rule(penalty, seed):
    logits, prompt, output = random_case(seed)
    ours = apply_penalties(logits, TokenHistory(prompt, output), SamplingParams(repetition_penalty=penalty))
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits[None].clone())[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.7), (-1.0, 1.5), (2.0, -2.0)])
def test_presence_and_frequency_follow_openais_formula(presence, frequency):
    logits, prompt, output = random_case(3)
    ours = apply_penalties(logits, TokenHistory(prompt, output),
                           SamplingParams(presence_penalty=presence, frequency_penalty=frequency))
    want = logits.tolist()
    for token in set(output):  # mu[j] - c[j] * frequency - (c[j] > 0) * presence; the prompt does not count
        want[token] -= output.count(token) * frequency + presence
    torch.testing.assert_close(ours, torch.tensor(want), rtol=0, atol=1e-5)


def test_banned_ids_cannot_be_drawn_and_ids_beyond_the_vocabulary_are_ignored():
    logits, prompt, output = random_case(4)
    banned = (int(logits.argmax()), 7, 10 ** 30, -1)
    out = apply_penalties(logits, TokenHistory(prompt, output, banned), SamplingParams(min_tokens=3))
    assert out[banned[0]] == float("-inf") and out[7] == float("-inf")
    keep = torch.ones_like(logits, dtype=torch.bool)
    keep[[banned[0], 7]] = False
    assert torch.equal(out[keep], logits[keep])
    sampler = Sampler(torch.device("cpu"), seed=0)
    history = TokenHistory(prompt, output, banned)
    assert sampler.sample(logits[None], ["r"], [SamplingParams(temperature=0, min_tokens=3)], [history]) != \
        [banned[0]]


def test_a_tiny_repetition_penalty_draws_among_the_seen_tokens():
    # logit / 1e-300 overflows fp32: the row must stay drawable (it drew token 0 through NaNs), and the draw falls on
    # a seen token with a positive logit, which the penalty raised above every other
    logits, prompt, output = random_case(6)
    seen_positive = {t for t in set(prompt + output) if logits[t] > 0}
    params = SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=0)
    row = apply_penalties(logits, TokenHistory(prompt, output), params)
    assert not torch.isnan(row).any()
    sampler = Sampler(torch.device("cpu"), seed=0)
    for i in range(20):
        token = sampler.sample(logits[None], [f"r{i}"], [params], [TokenHistory(prompt, output)])[0]
        assert token in seen_positive


def test_the_sampler_keeps_its_callers_logits_raw():
    logits, prompt, output = random_case(5)
    rows = logits[None].repeat(2, 1)
    before = rows.clone()
    params = [SamplingParams(temperature=0, repetition_penalty=3.0), SamplingParams(temperature=0)]
    Sampler(torch.device("cpu"), seed=0).sample(rows, ["a", "b"], params, [TokenHistory(prompt, output), None])
    assert torch.equal(rows, before)


@pytest.mark.parametrize("fields, message", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"min_tokens": 1.5}, "min_tokens"),
])
def test_bad_penalties_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def hf_generate(hf, ids: list[int], n: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=2, **kwargs)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_greedy_with_repetition_penalty_equals_transformers_generate(smollm_llm, smollm_hf, penalty):
    ids = smollm_llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=penalty)
    ours = smollm_llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == hf_generate(smollm_hf, ids, 16, repetition_penalty=penalty, eos_token_id=None)
    if penalty > 1:  # it breaks the loop greedy falls into here (below 1 it favours that loop)
        plain = smollm_llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0].token_ids
        assert ours != plain


def test_min_tokens_equals_transformers_min_new_tokens(smollm_llm, smollm_hf):
    chat = smollm_llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say only: yes"}])
    eos = sorted(smollm_llm.engine.eos_token_ids)
    free = smollm_llm.generate([chat], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 20  # it stops early of itself
    k = len(free.token_ids) + 5
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=k)
    held = smollm_llm.generate([chat], params, use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= k and not set(held.token_ids[:k]) & set(eos)
    assert held.token_ids == hf_generate(smollm_hf, chat, 40, min_new_tokens=k, eos_token_id=eos)  # EOS included


def test_presence_and_frequency_in_generation_equal_a_token_by_token_loop(smollm_llm, smollm_hf):
    ids = smollm_llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=0.8,
                            frequency_penalty=0.6)
    ours = smollm_llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(10):
            logits = smollm_hf(torch.tensor([seq])).logits[0, -1].tolist()
            for t in set(out):
                logits[t] -= 0.6 * out.count(t) + 0.8
            out.append(max(range(len(logits)), key=logits.__getitem__))
            seq.append(out[-1])
    assert ours == out


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_keeps_what_transformers_min_p_warper_keeps(min_p):
    """After temperature, the draw only comes from tokens at least min_p x the top token's probability."""
    from transformers import MinPLogitsWarper

    g = torch.Generator().manual_seed(6)
    logits = torch.randn(200, generator=g)
    kept = MinPLogitsWarper(min_p)(None, (logits / 1.5)[None])[0] > float("-inf")
    params = SamplingParams(temperature=1.5, min_p=min_p)
    drawn = {sample_row(logits, params, g) for _ in range(2000)}
    assert drawn <= set(kept.nonzero().flatten().tolist()) and len(drawn) > 1
    assert int(kept.sum()) < 200  # the filter cut something


def test_logit_bias_moves_greedy_and_sampling_and_refuses_bad_ids(smollm_llm):
    ids = smollm_llm.tokenizer.encode(PROMPT)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = smollm_llm.generate([ids], greedy, use_tqdm=False)[0].outputs[0].token_ids
    target = smollm_llm.tokenizer.encode(" cherry")[0]
    pushed = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={str(target): 100})
    assert smollm_llm.generate([ids], pushed, use_tqdm=False)[0].outputs[0].token_ids == [target] * 4
    banned = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={plain[0]: -100})
    assert smollm_llm.generate([ids], banned, use_tqdm=False)[0].outputs[0].token_ids[0] != plain[0]
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True, logit_bias={target: 100})
    assert smollm_llm.generate([ids], sampled, use_tqdm=False)[0].outputs[0].token_ids == [target] * 8
    with pytest.raises(ValueError, match="below the vocabulary size"):
        smollm_llm.generate([ids], SamplingParams(logit_bias={10 ** 9: 1}), use_tqdm=False)
    assert not smollm_llm.engine.requests


def test_bad_words_ban_exactly_the_tokens_that_would_complete_one():
    """banned_by_bad_words against a brute force: a token is banned iff the output with it appended ends with one of
    the words; a generation that draws only unbanned tokens then never holds a word."""
    rng = random.Random(0)
    vocab = 6
    for _ in range(300):
        words = tuple(tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3)))
        output: list[int] = []
        for _ in range(12):
            banned = set(banned_by_bad_words(words, output))
            completes = {t for t in range(vocab) for w in words
                         if len(output) + 1 >= len(w) and tuple(output + [t])[-len(w):] == w}
            assert banned == completes
            allowed = [t for t in range(vocab) if t not in banned]
            if not allowed:
                break
            output.append(rng.choice(allowed))
        assert not any(tuple(output[i:i + len(w)]) == w for w in words for i in range(len(output)))


def test_bad_words_are_tokenized_as_vllm_does():
    """Each word as it is, and after a space where that gives other ids of the same count (bytes: a space is one more
    id, so the spaced form is never added); an id beyond the model's vocabulary is refused."""
    assert bad_word_token_ids(ByteTokenizer(), ("ab", " c"), 256) == ((97, 98), (99,))

    class Words:  # a word-level tokenizer whose words start with a marker, as SentencePiece's do
        ids = {"x": 1, "▁x": 2, "y": 3, "▁y": 3}

        def encode_continuation(self, text):
            return [self.ids[w] for w in text.replace(" ", " ▁").split(" ") if w]

    assert bad_word_token_ids(Words(), ("x", " y"), 10) == ((1,), (2,), (3,))
    with pytest.raises(ValueError, match="outside the vocabulary of 2"):
        bad_word_token_ids(Words(), ("x",), 2)
