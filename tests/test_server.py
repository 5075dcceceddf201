"""The OpenAI-compatible server over HTTP (a real uvicorn on a loopback port), checked against
independent references: the offline API's greedy output, the tokenizer's counts, and log_softmax of
a plain forward of the model."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from oasiskv.config import SamplingParams
from oasiskv.server.app import BackgroundServer, build_app

PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
OPENING = "The capital of France"  # an assistant message the model continues
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3, min_tokens=6)


@pytest.fixture(scope="module")
def served(smollm_llm):
    """References from the offline API first, then one server over the same loaded engine."""
    greedy = SamplingParams(temperature=0, max_tokens=8)
    refs = {"completions": smollm_llm.generate(PROMPTS, greedy, use_tqdm=False),
            "chat": smollm_llm.chat(CHAT, greedy, use_tqdm=False)[0],
            "penalized": smollm_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, **PENALTIES),
                                             use_tqdm=False)[0],
            "continued": smollm_llm.chat(CHAT + [{"role": "assistant", "content": OPENING}],
                                         SamplingParams(temperature=0, max_tokens=6), use_tqdm=False,
                                         add_generation_prompt=False, continue_final_message=True)[0]}
    app = build_app(smollm_llm.engine)
    with BackgroundServer(app) as url:
        yield url, app.state.server, refs


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none")


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0], timeout=120) as c:
        yield c


def sse_events(response: httpx.Response) -> list:
    lines = [line for line in response.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_models_health_and_tokenizer_endpoints(served, http):
    _, state, _ = served
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == state.model_name
    assert models["data"][0]["max_model_len"] == state.max_model_len
    health = http.get("/health")
    assert health.status_code == 200 and health.content == b""
    text = "Hello, world"
    tokens = http.post("/tokenize", json={"prompt": text}).json()
    assert tokens["tokens"] == state.tokenizer.hf(text)["input_ids"] and tokens["count"] == len(tokens["tokens"])
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == text
    assert http.get("/tokenizer_info").json()["eos_token"] == "<|im_end|>"
    special = "<|im_start|>user\nhi<|im_end|>"  # special tokens round-trip, as vLLM's /detokenize keeps them
    ids = http.post("/tokenize", json={"prompt": special}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == special
    # vLLM's token_strs: the vocabulary's spelling (byte-level BPE's "Ġ" for a space), not each token's text
    strs = http.post("/tokenize", json={"prompt": " Alex went", "return_token_strs": True}).json()["token_strs"]
    assert strs == state.tokenizer.hf.convert_ids_to_tokens(state.tokenizer.hf(" Alex went")["input_ids"])
    assert strs[0] == "ĠAlex"
    # an echoed prompt of ids keeps its special tokens' text, so text and text_offset agree (vLLM's echo)
    echo = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True,
                                              "logprobs": 0}).json()["choices"][0]
    tokens, offsets = echo["logprobs"]["tokens"], echo["logprobs"]["text_offset"]
    assert echo["text"].startswith(special) and "".join(tokens[:len(ids)]) == special
    assert all(echo["text"][at:at + len(t)] == t for at, t in zip(offsets, tokens))
    assert http.get("/v1/completions").json()["error"]["type"] == "MethodNotAllowedError"
    assert http.get("/version").json()["version"]


def test_greedy_completions_match_the_offline_api(served, client):
    _, state, refs = served
    out = client.completions.create(model=state.model_name, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [r.outputs[0].text for r in refs["completions"]]
    assert out.usage.prompt_tokens == sum(len(state.tokenizer.hf(p)["input_ids"]) for p in PROMPTS)
    assert out.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in refs["completions"])


def test_penalties_and_min_tokens_match_the_offline_api(served, http):
    """vLLM's fields, at the top level of the body."""
    ref = served[2]["penalized"].outputs[0]
    out = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, **PENALTIES})
    assert out.status_code == 200 and out.json()["choices"][0]["text"] == ref.text
    plain = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}).json()
    assert plain["choices"][0]["text"] != ref.text
    bad = http.post("/v1/completions", json={"prompt": "hi", "presence_penalty": 3})
    assert bad.status_code == 400 and "presence_penalty" in bad.json()["error"]["message"]


def test_fields_at_values_that_change_nothing_are_accepted(served, http):
    """What clients send by default (an empty logit_bias, best_of 1, text responses, a user) is no refusal."""
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "logit_bias": {}, "best_of": 1, "min_p": 0,
            "response_format": {"type": "text"}, "user": "someone", "presence_penalty": 0, "frequency_penalty": 0,
            "skip_special_tokens": True, "include_stop_str_in_output": False, "tool_choice": "auto"}
    out = http.post("/v1/completions", json=body)
    assert out.status_code == 200 and out.json()["choices"][0]["text"] == served[2]["completions"][0].outputs[0].text


def test_vllms_truncate_allowed_bad_words_and_special_tokens_fields(served, http):
    """vLLM's fields, served: the last k prompt tokens (usage counts them; the text is that of those tokens given
    alone), in completions and chat; only the allowed ids are generated (logprobs name each sampled token); a bad
    word is not; skip_special_tokens False keeps a special token's text, whole or streamed."""
    ids = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "truncate_prompt_tokens": 3}
    cut = http.post("/v1/completions", json=body).json()
    alone = http.post("/v1/completions", json={**body, "prompt": ids[-3:], "truncate_prompt_tokens": None}).json()
    assert cut["usage"]["prompt_tokens"] == 3 and cut["choices"][0]["text"] == alone["choices"][0]["text"]
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "truncate_prompt_tokens": 4})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 4
    allowed = http.post("/tokenize", json={"prompt": " Paris London the"}).json()["tokens"]
    out = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 1.0, "seed": 1,
                                             "allowed_token_ids": allowed, "logprobs": 0,
                                             "return_tokens_as_token_ids": True}).json()
    tokens = [int(t.removeprefix("token_id:")) for t in out["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 6 and set(tokens) <= set(allowed)
    paris = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    assert "Paris" in http.post("/v1/completions", json=paris).json()["choices"][0]["text"]
    banned = http.post("/v1/completions", json={**paris, "bad_words": ["Paris"]}).json()["choices"][0]["text"]
    assert banned and "Paris" not in banned
    forced = {**paris, "max_tokens": 2, "logit_bias": {"1": 100}, "skip_special_tokens": False}
    assert http.post("/v1/completions", json=forced).json()["choices"][0]["text"] == "<|im_start|>" * 2
    streamed = http.post("/v1/completions", json={**forced, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in sse_events(streamed) if e["choices"]) == "<|im_start|>" * 2


def test_the_stop_string_kept_in_the_text_streamed_or_not(served, http):
    """include_stop_str_in_output: the text goes on to the end of the stop string, in one piece or in deltas, and
    stop_reason names it."""
    ref = served[2]["completions"][1].outputs[0].text  # "1, 2, 3, 4," greedily, 8 tokens
    stop = ref.split()[1]
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "stop": [stop], "include_stop_str_in_output": True}
    want = ref[:ref.index(stop) + len(stop)]
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["text"] == want and whole["finish_reason"] == "stop" and whole["stop_reason"] == stop
    events = sse_events(http.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want
    assert events[-1]["choices"][0]["stop_reason"] == stop


def test_a_stop_token_is_in_the_ids_not_the_text_streamed_or_not(served, http):
    """vLLM's rule: the token that stopped the choice is left out of its text (unless include_stop_str_in_output);
    stop_reason is that token."""
    _, state, refs = served
    ref = refs["completions"][1].outputs[0]  # "1, 2, 3, 4," greedily, 8 tokens
    at = next(i for i, t in enumerate(ref.token_ids) if i > 0 and t not in ref.token_ids[:i])
    stop = ref.token_ids[at]
    for kept in (False, True):
        body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "stop_token_ids": [stop],
                "include_stop_str_in_output": kept}
        want = state.tokenizer.decode(ref.token_ids[:at + 1 if kept else at])
        whole = http.post("/v1/completions", json=body).json()["choices"][0]
        assert whole["text"] == want and whole["finish_reason"] == "stop" and whole["stop_reason"] == stop
        events = sse_events(http.post("/v1/completions", json={**body, "stream": True}))
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want


def test_token_id_prompt_and_stop_string(served, client):
    _, state, refs = served
    ref = refs["completions"][0].outputs[0]
    stop = ref.text.split()[1]  # the second word of the greedy answer
    out = client.completions.create(model=state.model_name, prompt=refs["completions"][0].prompt_token_ids,
                                    max_tokens=8, temperature=0, stop=[stop])
    choice = out.choices[0]
    assert choice.text == ref.text[:ref.text.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    batch = client.completions.create(model=state.model_name, prompt=[r.prompt_token_ids for r in refs["completions"]],
                                      max_tokens=8, temperature=0)  # a list of token-id lists, as lm-eval sends
    assert [c.text for c in batch.choices] == [r.outputs[0].text for r in refs["completions"]]


class PlainCausalAttention:
    """softmax(q k^T / sqrt(d)) v with an explicit causal mask: the test's own attention."""

    def attend(self, layer, q, k, v):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
        future = torch.ones(len(q), len(k), dtype=torch.bool).triu(1)
        return torch.einsum("hqk,khd->qhd", scores.masked_fill(future, float("-inf")).softmax(-1), v)


def plain_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden, _ = model(torch.tensor(ids), torch.arange(len(ids)), PlainCausalAttention())
        return torch.log_softmax(model.logits(hidden), -1)


def test_logprobs_and_echo_match_a_plain_forward(served, http):
    _, state, refs = served
    prompt, continuation = refs["completions"][1].prompt_token_ids, refs["completions"][1].outputs[0].token_ids[:3]
    ref = plain_logprobs(state.engine.model, prompt + continuation)  # row i: the distribution of token i + 1
    n = len(prompt)
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 3}
    gen = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]  # the engine's logits
    assert gen["token_logprobs"] == pytest.approx([float(ref[n - 1 + j, t]) for j, t in enumerate(continuation)],
                                                  abs=2e-3)
    assert sorted(gen["top_logprobs"][0].values(), reverse=True) == pytest.approx(ref[n - 1].topk(3).values.tolist(),
                                                                                  abs=2e-3)
    echoed = prompt + continuation[:2]
    body = {"prompt": echoed, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]  # prompt logprobs: a dense forward
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [float(ref[i - 1, t]) for i, t in enumerate(prompt + continuation) if i > 0]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=2e-3)
    assert choice["text"] == state.tokenizer.decode(prompt + continuation) == "".join(lp["tokens"])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    # the prompt alone (max_tokens 0), streamed as SSE as well
    body = {"prompt": echoed, "max_tokens": 0, "logprobs": 1, "echo": True}
    whole = http.post("/v1/completions", json=body).json()
    events = sse_events(http.post("/v1/completions", json={**body, "stream": True,
                                                           "stream_options": {"include_usage": True}}))
    assert len(events) == 2 and events[0]["choices"] == whole["choices"] and events[0]["object"] == "text_completion"
    assert events[1]["choices"] == [] and events[1]["usage"] == whole["usage"]
    assert whole["choices"][0]["text"] == state.tokenizer.decode(echoed)


def test_n_choices_with_a_seed_are_reproducible(served, client):
    _, state, _ = served

    def sample():
        return client.completions.create(model=state.model_name, prompt=PROMPTS[0], n=3, max_tokens=4,
                                         temperature=1.0, seed=7, extra_body={"ignore_eos": True})

    a, b = sample(), sample()
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 12


def test_streamed_completion_chunks_and_usage(served, http):
    _, _, refs = served
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(http.post("/v1/completions", json=body))
    *chunks, last = events
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks] == list(range(1, 9))  # one token per step
    assert "".join(c["choices"][0]["text"] for c in chunks) == refs["completions"][0].outputs[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    alone = sse_events(http.post("/v1/completions", json={**body, "stream_options": {"continuous_usage_stats": True}}))
    assert len(alone) == 8 and all("usage" not in c for c in alone)  # vLLM's: only together with include_usage


def test_continuous_usage_is_each_choices_own(served, http):
    """vLLM's continuous usage stats: a chunk carries its choice's prompt and that choice's tokens so far (they
    were the sums over every prompt and choice); the last chunk sums them. Two prompts of other lengths, n 2."""
    _, state, _ = served
    prompts = ["Hi", "Hello there my friend"]
    lengths = [len(state.tokenizer.hf(p)["input_ids"]) for p in prompts]
    body = {"prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0.7, "seed": 1, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    *chunks, last = sse_events(http.post("/v1/completions", json=body))
    seen = {}
    for c in chunks:
        index = c["choices"][0]["index"]
        seen[index] = seen.get(index, 0) + 1
        assert c["usage"]["prompt_tokens"] == lengths[index // 2] and c["usage"]["completion_tokens"] == seen[index]
    assert seen == {0: 3, 1: 3, 2: 3, 3: 3}
    assert last["usage"] == {"prompt_tokens": sum(lengths), "completion_tokens": 12, "total_tokens": sum(lengths) + 12}


def test_chat_completion_and_its_stream(served, client):
    _, state, refs = served
    ref = refs["chat"]
    out = client.chat.completions.create(model=state.model_name, messages=CHAT, max_tokens=8, temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
    stream = client.chat.completions.create(model=state.model_name, messages=CHAT, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_seed_minus_one_leaves_every_choice_unseeded():
    from oasiskv.server.job import sampling_params
    from oasiskv.server.protocol import CompletionRequest

    def seeds(seed):
        body = CompletionRequest(prompt="hi", seed=seed, n=3)
        return [sampling_params(body, 4, choice).seed for choice in range(3)]

    assert seeds(-1) == [None, None, None]  # choices 1 and 2 were seeded 0 and 1
    assert seeds(5) == [5, 6, 7] and seeds(None) == [None, None, None]


def test_logprobs_name_tokens_by_id_when_asked(served, http):
    _, _, refs = served
    want = [f"token_id:{t}" for t in refs["completions"][0].outputs[0].token_ids[:4]]
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "logprobs": 2, "return_tokens_as_token_ids": True}
    got = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert got["tokens"] == want
    assert all(key.startswith("token_id:") for top in got["top_logprobs"] for key in top)
    chat = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "return_tokens_as_token_ids": True}
    content = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in refs["chat"].outputs[0].token_ids[:4]]
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])


def test_chat_continues_and_echoes_the_final_assistant_message(served, http):
    _, _, refs = served
    ref = refs["continued"]
    body = {"messages": CHAT + [{"role": "assistant", "content": OPENING}], "max_tokens": 6, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    plain = http.post("/v1/chat/completions", json=body).json()
    assert plain["choices"][0]["message"]["content"] == ref.outputs[0].text
    assert plain["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == OPENING + ref.outputs[0].text
    events = sse_events(http.post("/v1/chat/completions", json={**body, "echo": True, "stream": True}))
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == OPENING + ref.outputs[0].text
