"""The server's wire format and failure modes on a tiny random-weight model (byte tokenizer), in process: fields
sent as JSON null take their defaults as vLLM's do, malformed logit_bias keys are a 400, stop_reason is the one the
engine stopped at, /metrics answers after the engine died, a request's own chat template is refused however it is
sent, and echo with logprobs under tensor parallelism is refused instead of hanging every rank."""
from __future__ import annotations

import os

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from oasiskv.api import LLM
from oasiskv.cli import parser as main_parser
from oasiskv.config import SamplingParams
from oasiskv.server.app import BackgroundServer, build_app
from tests.helpers import write_tiny_config


class Scripted:
    """A sampler that emits the bytes of `text` in turn (the byte tokenizer's ids), for every request."""

    reads_each_step = False

    def __init__(self, text: str):
        self.ids, self.pos = list(text.encode()), {}

    def sample(self, logits, request_ids, params, *extra):
        out = []
        for rid in request_ids:
            i = self.pos.get(rid, 0)
            self.pos[rid] = i + 1
            out.append(self.ids[i % len(self.ids)])
        return out

    def forget(self, request_id):
        self.pos.pop(request_id, None)


@pytest.fixture
def tiny(tmp_path, one_torch_thread):
    llm = LLM(write_tiny_config(tmp_path / "tiny"), load_format="dummy", show_progress=False, kv_cache_gb=0.01)
    yield llm


def test_null_fields_take_their_defaults_as_vllms_do(tiny):
    """vLLM declares n, stream, echo, logprobs (chat), presence/frequency_penalty Optional: an OpenAI-schema client
    that sends `null` for what it leaves unset gets an answer, not a 400."""
    with TestClient(build_app(tiny.engine)) as client:
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": None, "stream": None,
            "logprobs": None, "top_logprobs": None, "presence_penalty": None, "frequency_penalty": None})
        assert chat.status_code == 200, chat.text
        assert len(chat.json()["choices"]) == 1 and chat.json()["choices"][0]["logprobs"] is None
        completion = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": None,
                                                          "n": None, "stream": None,
                                                          "repetition_penalty": None, "min_p": None})
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["text"] and not completion.json()["choices"][0]["text"].startswith("hi")
        # a field that takes null keeps its meaning: completions' max_tokens null runs to the model length
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": None,
                                                    "ignore_eos": True}).json()["usage"]["completion_tokens"] == \
            tiny.engine.max_model_len - 2


def test_served_model_names_as_vllm_takes_them(tiny):
    """vLLM's default name is --model as given (ours is its short name: both are taken now; the path was a 404);
    several --served-model-name values are all served, the first in responses and every one in /v1/models."""
    given = tiny.engine.config.model
    body = {"prompt": "hi", "max_tokens": 1}
    with TestClient(build_app(tiny.engine)) as client:
        short = client.get("/v1/models").json()["data"][0]["id"]
        assert short == os.path.basename(os.path.normpath(given))
        assert client.post("/v1/completions", json={**body, "model": given}).json()["model"] == short
    with TestClient(build_app(tiny.engine, ["first", "second"]), raise_server_exceptions=False) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["first", "second"]
        assert client.post("/v1/completions", json={**body, "model": "second"}).json()["model"] == "first"
        assert client.post("/v1/completions", json={**body, "model": given}).status_code == 404
    assert main_parser().parse_args(["serve", "--served-model-name", "a", "b"]).served_model_name == ["a", "b"]


def test_a_logit_bias_key_that_is_not_a_decimal_token_id_is_a_400(tiny):
    """'²'.isdigit() is true and int('²') raises: the request got a 500 'internal error'."""
    with TestClient(build_app(tiny.engine), raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": {"\u00b2": 5}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "logit_bias"


def test_stop_reason_is_the_stop_string_the_engine_stopped_at(tiny):
    """The engine stops at the earliest stop string ("bc" in "xabc"); the server recomputed stop_reason from the
    text's end and named "c", unlike the offline API for the same request."""
    params = dict(max_tokens=8, stop=["c", "bc"], include_stop_str_in_output=True)
    tiny.engine.sampler = Scripted("xabcdefg")
    offline = tiny.generate("hi", SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert (offline.text, offline.stop_reason) == ("xabc", "bc")
    tiny.engine.sampler = Scripted("xabcdefg")
    with TestClient(build_app(tiny.engine)) as client:
        for stream in (False, True):
            r = client.post("/v1/completions", json={"prompt": "hi", **params, "stream": stream})
            if stream:
                import json
                events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
                text = "".join(e["choices"][0]["text"] for e in events)
                last = events[-1]["choices"][0]
            else:
                last = r.json()["choices"][0]
                text = last["text"]
            assert (text, last["finish_reason"], last["stop_reason"]) == ("xabc", "stop", "bc"), stream


def test_metrics_answer_after_the_engine_died(tiny, monkeypatch):
    """/health turns 503 and the request counters stay readable: /metrics was a 500 once the engine was dead, so
    the scrape that should show the failure showed nothing."""
    def broken():
        raise RuntimeError("the device fell over")

    with TestClient(build_app(tiny.engine)) as client:
        assert client.get("/metrics").status_code == 200
        monkeypatch.setattr(tiny.engine, "step", broken)
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 500
        assert client.get("/health").status_code == 503
        scraped = client.get("/metrics")
        assert scraped.status_code == 200, scraped.text
        assert 'oasiskv:request_success_total{finished_reason="abort"' in scraped.text


def test_a_chat_template_in_chat_template_kwargs_is_refused_as_chat_template_is():
    """chat_template is refused at the top level (README: a request's own chat_template gets a 400); through
    chat_template_kwargs it reached the tokenizer's `chat_template` argument and replaced the model's template."""
    from oasiskv.models.loader import embedded_default_path
    from oasiskv.models.tokenizer import HFTokenizer
    from oasiskv.server.chat import chat_prompt
    from oasiskv.server.protocol import APIError, ChatCompletionRequest

    tokenizer = HFTokenizer.from_gguf(embedded_default_path())
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                 chat_template_kwargs={"chat_template": "OWN {{ messages[0].content }}"})
    with pytest.raises(APIError) as refused:
        chat_prompt(body, tokenizer)
    assert refused.value.status == 400 and refused.value.param == "chat_template_kwargs"
    assert "chat_template" in refused.value.message
    # vLLM lets chat_template_kwargs set the template's own options (add_generation_prompt among them)
    plain = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False)
    merged = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                   chat_template_kwargs={"add_generation_prompt": False})
    assert chat_prompt(merged, tokenizer) == chat_prompt(plain, tokenizer)


def test_echo_with_logprobs_under_tensor_parallelism_is_refused_not_hung(tmp_path, one_torch_thread):
    """Prompt logprobs ran rank 0's shard of the model alone: its all_reduce waited for ranks that wait for the
    next plan, so that request and every later one hung until the collective timeout (5 minutes). The offline API
    refuses prompt_logprobs with tensor parallelism; the server now does too, and goes on serving."""
    from tests.test_tensor_parallel import engine_config
    from oasiskv.engine.engine import LLMEngine

    engine = LLMEngine(engine_config(tmp_path, "dense", 2))
    try:
        with BackgroundServer(build_app(engine)) as url, httpx.Client(base_url=url, timeout=20) as client:
            r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1, "echo": True,
                                                     "logprobs": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
            assert "tensor parallel" in r.json()["error"]["message"]
            plain = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})
            assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 2
            echoed = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1, "echo": True})
            assert echoed.status_code == 200  # echo without logprobs needs no forward of its own
    finally:
        engine.close()


def test_tokenize_takes_the_chat_templates_options(tiny):
    """/tokenize of messages ignored add_generation_prompt (an unknown field there): its count was that of another
    prompt than the one /v1/chat/completions runs for the same body."""
    messages = [{"role": "user", "content": "hi"}]
    with TestClient(build_app(tiny.engine)) as client:
        for add in (True, False):
            got = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": add}).json()
            assert got["tokens"] == tiny.tokenizer.apply_chat_template(messages, add_generation_prompt=add), add
            usage = client.post("/v1/chat/completions", json={"messages": messages, "add_generation_prompt": add,
                                                              "max_tokens": 1}).json()["usage"]
            assert got["count"] == usage["prompt_tokens"]
