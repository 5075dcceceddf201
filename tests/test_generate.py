"""End to end on the embedded SmolLM2: CLI vs transformers, batch invariance under preemption, bad input."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from oasiskv.api import LLM, SamplingParams

PROMPTS = [
    "The history of the Roman Empire",
    "def quicksort(arr):",
    "Q: What is 12 times 7?\nA:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List of prime numbers: 2, 3, 5,",
    "Water boils at",
    "The three primary colors are red,",
    "In 1969, the Apollo 11 mission",
]


def hf_greedy(hf, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.slow
def test_cli_generate_equals_transformers_greedy(smollm_hf, smollm_hf_tokenizer):
    prompt = "The capital of France is Paris. The capital of Germany is"
    proc = subprocess.run(
        [sys.executable, "-m", "oasiskv.cli", "generate", "--prompt", prompt, "--max-tokens", "24",
         "--temperature", "0", "--ignore-eos", "--json"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    prompt_ids = smollm_hf_tokenizer.encode(prompt)
    assert result["token_ids"] == hf_greedy(smollm_hf, prompt_ids, 24)
    assert result["text"] == smollm_hf_tokenizer.decode(result["token_ids"], skip_special_tokens=True)
    assert result["stats"]["output_tokens"] == 24 and result["stats"]["finish_reason"] == "length"


def test_chat_answers_sensibly(smollm_llm):
    out = smollm_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_batch_invariance_with_preemption_and_chunked_prefill(smollm_llm):
    """8 requests of different lengths together, in a pool too small for all of them and with
    prefill chunks of 32 tokens, give each one the greedy tokens it gets alone."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tight = LLM(show_progress=False, num_kv_blocks=10, max_num_batched_tokens=32)
    together = tight.generate(PROMPTS, params, use_tqdm=False)
    assert tight.engine.stats.preemptions > 0
    assert any(o.metrics["num_preemptions"] > 0 for o in together)
    for prompt, out in zip(PROMPTS, together):
        alone = smollm_llm.generate(prompt, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, prompt


def test_stop_strings_and_max_tokens(smollm_llm):
    out = smollm_llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=30, stop=[" 9"]),
                              use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text.endswith("8,") and " 9" not in out.outputs[0].text
    kept = smollm_llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=30, stop=[" 9", "xyz"],
                                                                include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == out.outputs[0].text + " 9" and kept.outputs[0].finish_reason == "stop"
    out = smollm_llm.generate("1, 2, 3,", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                              use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"

    with pytest.raises(ValueError, match="empty string"):
        SamplingParams(stop=["x", ""])


def test_a_stop_string_far_into_a_long_output(smollm_llm, smollm_hf_tokenizer):
    """Past the engine's window of last tokens (STOP_WINDOW_TOKENS), the output is no longer decoded whole each step:
    the cut must still fall at the stop string's first occurrence in the whole text (the brute force)."""
    from oasiskv.engine.stopping import STOP_WINDOW_TOKENS

    prompt = "Count with me: 1, 2, 3, 4, 5,"
    free = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=160, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    text = smollm_hf_tokenizer.decode(free.token_ids, skip_special_tokens=True)
    far = len(smollm_hf_tokenizer.decode(free.token_ids[:STOP_WINDOW_TOKENS + 40], skip_special_tokens=True))
    stop = text[far:far + 4]
    assert text.find(stop) > len(smollm_hf_tokenizer.decode(free.token_ids[:STOP_WINDOW_TOKENS + 1]))
    out = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=160, ignore_eos=True, stop=[stop]),
                              use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[:text.find(stop)]


def test_a_stop_string_within_min_tokens_does_not_stop(smollm_llm, smollm_hf_tokenizer):
    """vLLM's rule: only a stop string that ends after the first min_tokens tokens' text stops the request."""
    prompt = "The capital of France is"
    free = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    text = smollm_hf_tokenizer.decode(free.token_ids, skip_special_tokens=True)
    early = smollm_hf_tokenizer.decode(free.token_ids[:4], skip_special_tokens=True)
    cut = min(i for s in (".", ":") if (i := text.find(s, len(early))) > 0)  # the first stop after them
    assert "." in early  # and a "." within the first 4 tokens, which must not stop it
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[".", ":"], min_tokens=4)
    out = smollm_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[:cut]


def test_a_stop_token_ends_the_ids_but_not_the_text(smollm_llm, smollm_hf_tokenizer):
    """vLLM's rule: the token that stopped the request is its last token id, and its text is left out unless
    include_stop_str_in_output."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = smollm_llm.generate("1, 2, 3, 4, 5,", greedy, use_tqdm=False)[0].outputs[0]
    at = next(i for i, t in enumerate(free.token_ids) if i > 0 and t not in free.token_ids[:i])
    stop = free.token_ids[at]
    for kept in (False, True):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop],
                                include_stop_str_in_output=kept)
        out = smollm_llm.generate("1, 2, 3, 4, 5,", params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free.token_ids[:at + 1] and out.finish_reason == "stop"
        shown = free.token_ids[:at + 1 if kept else at]
        assert out.text == smollm_hf_tokenizer.decode(shown, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_batch_independent(smollm_llm):
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    a = smollm_llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0].token_ids
    batch = smollm_llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                                [SamplingParams(temperature=1.0, max_tokens=16), p,
                                 SamplingParams(temperature=0.5, max_tokens=16, seed=7)], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == a


def test_bad_request_is_rejected_and_others_keep_running(smollm_llm):
    engine = smollm_llm.engine
    good = engine.add_request("Hello, my name is", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for bad_prompt, message in [("", "empty"), ([10**9], "out of range"), ([1] * 100000, "max_model_len")]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(bad_prompt, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_finished(good)
    assert len(out.output_token_ids) == 8 and out.finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(smollm_llm):
    """vLLM's truncate_prompt_tokens: the output is the one of the prompt's last k tokens given alone, and the request
    reports the truncated prompt; -1 keeps max_model_len tokens; a size above it is refused."""
    ids = smollm_llm.get_tokenizer().encode(PROMPTS[0] + " " + PROMPTS[2])
    greedy = SamplingParams(temperature=0, max_tokens=6)
    cut = smollm_llm.generate([ids], dataclasses.replace(greedy, truncate_prompt_tokens=5), use_tqdm=False)[0]
    alone = smollm_llm.generate([ids[-5:]], greedy, use_tqdm=False)[0]
    assert list(cut.prompt_token_ids) == ids[-5:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    whole = smollm_llm.generate([ids], dataclasses.replace(greedy, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert list(whole.prompt_token_ids) == ids
    too_long = smollm_llm.engine.max_model_len + 1
    with pytest.raises(ValueError, match="truncate_prompt_tokens .* is greater than max_model_len"):
        smollm_llm.generate([ids], dataclasses.replace(greedy, truncate_prompt_tokens=too_long), use_tqdm=False)


def test_allowed_token_ids_are_the_only_tokens_generated(smollm_llm):
    """vLLM's allowed_token_ids: each greedy token is the one a +100 logit_bias on the same ids picks (another way to
    the same rule); sampled tokens stay in the set; an id beyond the vocabulary is refused."""
    allowed = smollm_llm.get_tokenizer().encode(" Paris London Rome Berlin the a")
    only = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)
    biased = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={t: 100 for t in allowed})
    a, b = smollm_llm.generate([PROMPTS[0]] * 2, [only, biased], use_tqdm=False)
    assert set(a.outputs[0].token_ids) <= set(allowed) and a.outputs[0].token_ids == b.outputs[0].token_ids
    drawn = smollm_llm.generate(PROMPTS[1], dataclasses.replace(only, temperature=1.0, seed=3), use_tqdm=False)[0]
    assert set(drawn.outputs[0].token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids must be below the vocabulary size"):
        smollm_llm.generate("x", SamplingParams(allowed_token_ids=[1, 10 ** 7]), use_tqdm=False)


def test_special_tokens_kept_in_the_text_and_no_text_without_detokenize(smollm_llm, smollm_hf_tokenizer):
    """vLLM's skip_special_tokens=False: the text is transformers' decode of prompt + output with the special tokens
    kept, less the prompt's (here the output is <|im_start|> three times, forced by a logit_bias); detokenize=False:
    the same ids, no text, logprobs without token text, and stop strings refused."""
    prompt = smollm_hf_tokenizer.encode("Hello there")
    forced = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={1: 100}, logprobs=1)
    skipped, kept, bare = smollm_llm.generate([prompt] * 3, [
        forced, dataclasses.replace(forced, skip_special_tokens=False), dataclasses.replace(forced, detokenize=False)],
        use_tqdm=False)
    assert skipped.outputs[0].token_ids == kept.outputs[0].token_ids == bare.outputs[0].token_ids == [1, 1, 1]
    whole = smollm_hf_tokenizer.decode(prompt + [1, 1, 1], skip_special_tokens=False)
    before = smollm_hf_tokenizer.decode(prompt, skip_special_tokens=False)
    assert kept.outputs[0].text == whole[len(before):] == "<|im_start|>" * 3 and skipped.outputs[0].text == ""
    assert bare.outputs[0].text == "" and bare.outputs[0].logprobs[0][1].decoded_token is None
    assert kept.outputs[0].logprobs[0][1].decoded_token == "<|im_start|>"
    with pytest.raises(ValueError, match="stop strings need the text"):
        SamplingParams(stop=["x"], detokenize=False)


def test_bans_that_leave_no_allowed_token_give_way_to_allowed_token_ids(smollm_llm):
    """min_tokens bans EOS, the one allowed id, and a bad word bans the other: every logit was -inf and id 0 (not
    allowed) was drawn ([0, 0, 2]). The allowed ids win: EOS, which stops the request once min_tokens are out; the
    banned word's id all along."""
    only_eos = SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[2], min_tokens=2)
    out = smollm_llm.generate("Hi", only_eos, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([2, 2], "stop")
    word = smollm_llm.get_tokenizer().decode([100])
    only_word = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[100], bad_words=[word])
    assert smollm_llm.generate("Hi", only_word, use_tqdm=False)[0].outputs[0].token_ids == [100] * 3


def test_an_unfinished_character_is_left_out_of_the_text(smollm_llm, smollm_hf_tokenizer):
    """The length limit cut a multi-byte character: the text ended in U+FFFD, which vLLM's detokenizer never shows.
    The reference is transformers' decode of prompt + output, less the prompt's text and the replacement chars."""
    prompt = smollm_hf_tokenizer.encode("日本の首都は")
    out = smollm_llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].outputs[0]
    whole = smollm_hf_tokenizer.decode(prompt + out.token_ids)
    assert whole.endswith("\ufffd")  # (the case: this output stops inside a character)
    assert out.text == whole[len(smollm_hf_tokenizer.decode(prompt)):].rstrip("\ufffd") and out.text


def test_chat_reports_the_rendered_prompt_and_template_errors_clearly(smollm_llm, smollm_hf_tokenizer):
    """vLLM's: RequestOutput.prompt is the rendered conversation (it was None); a template that fails is a ValueError
    naming the cause (jinja2's own errors escaped), and a reserved template option is refused by name."""
    messages = [{"role": "user", "content": "Hi"}]
    out = smollm_llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt == smollm_hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match="the chat template failed: TemplateSyntaxError"):
        smollm_llm.chat(messages, chat_template="{% for m in messages %}", use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set tokenize"):
        smollm_llm.chat(messages, chat_template_kwargs={"tokenize": True}, use_tqdm=False)
    with pytest.raises(ValueError, match="1 prompts but 0 sampling params"):  # (an empty list meant the defaults)
        smollm_llm.generate(["Hi"], [], use_tqdm=False)


def test_bad_words_never_complete_in_the_output(smollm_llm):
    """vLLM's bad_words: a one-token word (as it is and after a space) is never drawn, as a -100 logit_bias on both
    ids gives; a two-token word's second token is never drawn after its first, so the output equals the free one up
    to where that word would first complete and never holds the word's ids."""
    tok = smollm_llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = tok.encode("Paris", add_special_tokens=False) + tok.encode(" Paris", add_special_tokens=False)
    assert len(ids) == 2
    banned, biased = smollm_llm.generate(["The capital of France is"] * 2, [
        dataclasses.replace(greedy, bad_words=["Paris"]), dataclasses.replace(greedy, logit_bias={t: -100 for t in ids})],
        use_tqdm=False)
    assert banned.outputs[0].token_ids == biased.outputs[0].token_ids and not set(ids) & set(banned.outputs[0].token_ids)
    word = tuple(tok.encode(" Roman Empire", add_special_tokens=False))
    free = smollm_llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids
    first = next(i for i in range(len(free)) if tuple(free[i:i + len(word)]) == word)  # " Roman Empire" comes
    out = smollm_llm.generate(PROMPTS[0], dataclasses.replace(greedy, bad_words=["Roman Empire"]),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert len(word) == 2 and out[:first + 1] == free[:first + 1] and out[first + 1] != word[1]
    assert all(tuple(out[i:i + 2]) != word for i in range(len(out)))


def test_generate_rejects_batch_with_a_bad_prompt_atomically(smollm_llm):
    with pytest.raises(ValueError, match="prompt 1"):
        smollm_llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not smollm_llm.engine.has_unfinished()


@pytest.mark.parametrize("fields, message", [
    ({"seed": "x"}, "seed"), ({"seed": 2 ** 64}, "seed"), ({"seed": -2 ** 63 - 1}, "seed"), ({"seed": True}, "seed"),
    ({"temperature": "0.5"}, "temperature"), ({"top_p": None}, "top_p"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids"), ({"stop_token_ids": 2}, "stop_token_ids"),
])
def test_sampling_params_refuse_what_the_step_would_fail_on(fields, message):
    """A seed torch's generators refuse failed the engine's step (and the next generate then never returned)."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_a_seed_whose_later_choices_leave_the_range_is_refused_by_its_own_value():
    """Choice i of n is seeded seed + i: the error came from the second choice, naming 2**64, a seed never given."""
    with pytest.raises(ValueError, match=rf"seed {2 ** 64 - 1} with n 2: .* below 2\*\*64 - 1"):
        SamplingParams(seed=2 ** 64 - 1, n=2)
    assert [c.seed for c in SamplingParams(seed=2 ** 64 - 2, n=2).choices()] == [2 ** 64 - 2, 2 ** 64 - 1]


def test_sampling_params_take_the_seed_range_and_numpy_ints():
    np = pytest.importorskip("numpy")
    for seed in (-2 ** 63, 2 ** 64 - 1, np.int64(3)):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)  # what the sampler does with it
    assert SamplingParams(stop_token_ids=[np.int64(7), 2]).stop_token_ids == (7, 2)


def test_a_failed_generate_leaves_the_engine_ready(smollm_llm, monkeypatch):
    """A step that raises (or Ctrl-C) inside generate: its requests are aborted and forgotten, and the next call
    returns what it would have returned anyway."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = smollm_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    engine = smollm_llm.engine

    def fail(*args, **kwargs):
        raise RuntimeError("sampling failed")

    with monkeypatch.context() as patch:
        patch.setattr(engine.sampler, "sample", fail)
        with pytest.raises(RuntimeError, match="sampling failed"):
            smollm_llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert not engine.has_unfinished() and not engine.requests
    again = smollm_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]


BAD_GENERATE = [  # (prompts, sampling params, message): each a ValueError that queues nothing
    (None, None, "prompts: a string"), (5, None, "prompts: a string"), ([None], None, "prompt 0: a prompt is"),
    ([[1.5, 2.0]], None, "integer token ids"), ([[True, False]], None, "integer token ids"),
    (["hi", [1, "a"]], None, "prompt 1"), (["hi"], {"max_tokens": 3}, "SamplingParams"),
]
CHAT_OK = {"role": "user", "content": "hi"}
BAD_CHATS = [  # (messages, message): the server's ChatMessage rules
    ("hello", "messages: a list"), ([], "messages: a list"), ([CHAT_OK, "hi"], "message 1: message: Input should be"),
    ([{"role": "user", "content": 5}], "message 0: content"), ([{"content": "hi"}], "message 0: role"),
    ([{"role": "wizard", "content": "hi"}], "role: Input should be"), ([[CHAT_OK], []], "conversation 1"),
    ([CHAT_OK, {"role": "user", "content": [{"type": "image_url"}]}], "message 1: content"),
]


def test_generate_and_chat_refuse_malformed_input_clearly(smollm_llm):
    """Wrong types got TypeErrors from deep inside (or were truncated: float ids); each is now a ValueError that
    names the prompt or message, and the engine stays empty."""
    for prompts, params, message in BAD_GENERATE:
        with pytest.raises(ValueError, match=message):
            smollm_llm.generate(prompts, params, use_tqdm=False)
    for messages, message in BAD_CHATS:
        with pytest.raises(ValueError, match=message):
            smollm_llm.chat(messages, use_tqdm=False)
    assert not smollm_llm.engine.has_unfinished() and not smollm_llm.engine.requests


def test_prompts_as_tensors_and_text_parts_match_their_plain_forms(smollm_llm):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = smollm_llm.tokenizer.encode(PROMPTS[5])
    plain = smollm_llm.generate([ids], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert smollm_llm.generate(torch.tensor(ids), greedy, use_tqdm=False)[0].outputs[0].token_ids == plain
    batch = smollm_llm.generate(torch.tensor([ids, ids]), greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch] == [plain, plain]
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2 + "}, {"type": "text", "text": "2?"}]}]
    assert (smollm_llm.chat(parts, greedy, use_tqdm=False)[0].outputs[0].token_ids ==
            smollm_llm.chat(chat, greedy, use_tqdm=False)[0].outputs[0].token_ids)


def test_n_choices_are_the_seeded_single_requests(smollm_llm):
    """SamplingParams(n=3, seed=s): choice i is what a single request seeded s + i gives (the server's rule), in one
    RequestOutput per prompt; greedy choices agree."""
    sampled = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    outs = smollm_llm.generate(PROMPTS[:2], sampled, use_tqdm=False)
    assert len(outs) == 2 and [c.index for c in outs[1].outputs] == [0, 1, 2]
    for prompt, out in zip(PROMPTS[:2], outs):
        for i, choice in enumerate(out.outputs):
            single = SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8, ignore_eos=True)
            assert choice.token_ids == smollm_llm.generate(prompt, single, use_tqdm=False)[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    greedy = smollm_llm.generate(PROMPTS[0], SamplingParams(n=2, temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="one choice"):
        smollm_llm.engine.add_request("hi", SamplingParams(n=2))


def test_cli_reports_missing_model_clearly():
    proc = subprocess.run([sys.executable, "-m", "oasiskv.cli", "generate", "--prompt", "x", "--model",
                           "/no/such/model"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "not found" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_dummy_model_is_reproducible():
    cmd = [sys.executable, "-m", "oasiskv.cli", "generate", "--model", "qwen3-0.6b", "--load-format", "dummy",
           "--seed", "0", "--prompt", "hello", "--max-tokens", "4", "--temperature", "0", "--json",
           "--kv-cache-gb", "0.05"]
    runs = [subprocess.run(cmd, capture_output=True, text=True, timeout=600) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 4


@pytest.mark.parametrize("flags, message", [
    (["--kv-mode", "quest", "--working-set", "4096"], "--working-set applies to the retrieval and oasis modes"),
    (["--kv-mode", "oasis", "--fetch-cap", "2"], "--fetch-cap must be in"),
    (["--prompt-file", "/no/such/file.txt"], "cannot read --prompt-file: .*No such file"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1, got 0"),
    (["--max-model-len", "0"], "--max-model-len must be at least 1, got 0"),
    (["--gpu-memory-utilization", "1.5"], r"--gpu-memory-utilization must be in \(0, 1\]"),
    (["--kv-cache-gb", "-1"], "--kv-cache-gb must be above 0"),
])
def test_cli_rejects_bad_flags_before_loading_weights(flags, message, monkeypatch):
    from oasiskv import cli
    from oasiskv.engine import engine

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the flags were checked")

    monkeypatch.setattr(engine, "load_model", no_loading)
    with pytest.raises(SystemExit, match=message):
        cli.main(["generate", "--prompt", "x", *flags])


def test_cli_generate_chat_without_a_template_is_a_one_line_error(tmp_path, smollm_hf_tokenizer, capsys):
    """--chat with a tokenizer that has no chat template ended in a traceback; it is the CLI's error line now."""
    from oasiskv import cli
    from tests.helpers import write_tiny_config

    smollm_hf_tokenizer.save_pretrained(tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        (tmp_path / "tok" / name).unlink(missing_ok=True)
    model = write_tiny_config(tmp_path / "model")
    with pytest.raises(SystemExit, match="error: this model's tokenizer has no chat template"):
        cli.main(["generate", "--model", model, "--load-format", "dummy", "--tokenizer", str(tmp_path / "tok"),
                  "--kv-cache-gb", "0.01", "--chat", "--prompt", "Hi", "--max-tokens", "2"])


def test_vllms_dtype_spellings_half_and_float():
    from oasiskv.engine.engine import pick_dtype

    cpu = torch.device("cpu")
    assert pick_dtype("half", cpu) == torch.float16 and pick_dtype("float", cpu) == torch.float32
    with pytest.raises(ValueError, match="--dtype must be one of auto, .*half"):
        pick_dtype("double", cpu)
