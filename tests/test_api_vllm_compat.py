"""What a vLLM script ported to `from oasiskv import LLM, SamplingParams` relies on: prompt dicts, get_tokenizer(),
llm_engine, stop_reason and cumulative_logprob, max_tokens None, the chat template's options, and LLM(...) arguments
that change nothing here (others are refused by name). References: the same request in another form, the
tokenizer's own decode, the logprobs the same call returns."""
from __future__ import annotations

import pytest

from oasiskv.api import split_kwargs

GREEDY = dict(temperature=0, max_tokens=6)


def test_the_package_exports_the_offline_api():
    from oasiskv import LLM, SamplingParams
    from oasiskv.api import LLM as ApiLLM

    assert LLM is ApiLLM and SamplingParams(top_k=0).top_k == -1


def test_prompt_dicts_are_their_text_or_ids(smollm_llm):
    from oasiskv import SamplingParams

    g = SamplingParams(**GREEDY)
    text = "The capital of France is"
    plain = smollm_llm.generate(text, g, use_tqdm=False)[0]
    by_dict = smollm_llm.generate([{"prompt": text}, {"prompt_token_ids": plain.prompt_token_ids}], g, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_dict] == [plain.outputs[0].token_ids] * 2
    assert by_dict[0].prompt == text and by_dict[1].prompt is None
    with pytest.raises(ValueError, match="prompt 0: a dict prompt holds 'prompt'"):
        smollm_llm.generate({"prompt": text, "multi_modal_data": {}}, g, use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request and priority"):
        smollm_llm.generate(text, g, use_tqdm=False, lora_request=object())
    assert not smollm_llm.engine.has_unfinished()


def test_get_tokenizer_renders_the_chat_as_chat_does(smollm_llm):
    from oasiskv import SamplingParams

    g = SamplingParams(**GREEDY)
    tok = smollm_llm.get_tokenizer()
    messages = [{"role": "user", "content": "Name a colour."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    via_text = smollm_llm.generate(text, g, use_tqdm=False)[0]
    via_chat = smollm_llm.chat(messages, g, use_tqdm=False)[0]
    assert via_text.prompt_token_ids == via_chat.prompt_token_ids
    assert via_text.outputs[0].token_ids == via_chat.outputs[0].token_ids
    assert smollm_llm.llm_engine is smollm_llm.engine


def test_the_chat_templates_options_reach_it(smollm_llm):
    from oasiskv import SamplingParams

    template = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}>" \
               "{% endif %}"
    out = smollm_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(**GREEDY), use_tqdm=False,
                          chat_template=template, chat_template_kwargs={"greeting": "Hey "})[0]
    assert smollm_llm.tokenizer.decode(out.prompt_token_ids) == "Hey [hi]>"
    out = smollm_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(**GREEDY), use_tqdm=False,
                          chat_template=template, add_generation_prompt=False, chat_template_kwargs={"greeting": ""})[0]
    assert smollm_llm.tokenizer.decode(out.prompt_token_ids) == "[hi]"


def test_stop_reason_and_cumulative_logprob(smollm_llm):
    from oasiskv import SamplingParams

    prompt = "1, 2, 3, 4,"
    free = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
                               use_tqdm=False)[0].outputs[0]
    assert free.stop_reason is None and free.finish_reason == "length"
    chosen = [lp[t].logprob for lp, t in zip(free.logprobs, free.token_ids)]
    assert free.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-9)
    word = free.text.split()[2]
    by_string = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[word]),
                                    use_tqdm=False)[0].outputs[0]
    assert by_string.stop_reason == word and by_string.cumulative_logprob is None  # no logprobs asked for
    token = free.token_ids[3]
    by_token = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[token]),
                                   use_tqdm=False)[0].outputs[0]
    assert by_token.stop_reason == token and by_token.token_ids[-1] == token


def test_max_tokens_none_runs_to_the_model_length(smollm_llm, monkeypatch):
    from oasiskv import SamplingParams

    out = smollm_llm.generate("1, 2, 3,", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                              use_tqdm=False)[0]
    monkeypatch.setattr(smollm_llm.engine, "max_model_len", len(out.prompt_token_ids) + 5)
    unbounded = smollm_llm.generate("1, 2, 3,", SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0]
    assert unbounded.token_ids == out.outputs[0].token_ids and unbounded.finish_reason == "length"


def test_vllm_arguments_that_change_nothing_are_taken_and_others_refused_by_name():
    taken = split_kwargs({"model": "m", "trust_remote_code": True, "enable_prefix_caching": False, "swap_space": 4,
                          "kv_cache_dtype": "auto", "max_logprobs": 20, "enable_chunked_prefill": True,
                          "speculative_config": {"method": "eagle3", "model": "/heads/x"}})
    assert (taken.kv.draft, taken.kv.draft_model) == ("eagle3", "/heads/x")
    for bad, message in [({"enable_prefix_caching": True}, "enable_prefix_caching=True is not supported"),
                         ({"quantization": "awq"}, "quantization='awq' is not supported"),
                         ({"max_logprobs": 50}, "at most 20 logprobs"),
                         ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8' is not supported")]:
        with pytest.raises(TypeError, match=message):
            split_kwargs(bad)
    with pytest.raises(ValueError, match="speculative_config must look like"):
        split_kwargs({"speculative_config": {"method": "medusa"}})


def test_the_offline_api_imports_without_the_servers_pydantic():
    """The GPU machine has no pydantic: `oasiskv eval` and `bench` (through oasiskv.api) failed there at import."""
    import subprocess
    import sys

    code = "import sys; sys.modules['pydantic'] = None; import oasiskv.api, oasiskv.evals.harness; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_chat_template_kwargs_override_the_named_options_as_in_vllm(smollm_llm, smollm_hf_tokenizer):
    """vLLM's chat(): chat_template_kwargs update the named options (add_generation_prompt, chat_template, ...); a key
    in both was a TypeError here (dict() got multiple values), and a non-dict a TypeError from **."""
    from oasiskv import SamplingParams

    messages = [{"role": "user", "content": "hi"}]
    out = smollm_llm.chat(messages, SamplingParams(**GREEDY), use_tqdm=False,
                          chat_template_kwargs={"add_generation_prompt": False})[0]
    text = smollm_hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert out.prompt_token_ids == smollm_hf_tokenizer.encode(text, add_special_tokens=False)
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    out = smollm_llm.chat(messages, SamplingParams(**GREEDY), use_tqdm=False, chat_template="unused {{ x }}",
                          chat_template_kwargs={"chat_template": template})[0]
    assert smollm_llm.tokenizer.decode(out.prompt_token_ids) == "<hi>"
    with pytest.raises(ValueError, match="chat_template_kwargs: a dict"):
        smollm_llm.chat(messages, SamplingParams(**GREEDY), use_tqdm=False, chat_template_kwargs=["greeting"])
    assert not smollm_llm.engine.has_unfinished()
