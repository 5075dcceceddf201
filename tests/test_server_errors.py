"""Bad input, cancellation and load against a real server: errors have vLLM's shape, disconnecting
clients free their KV at once, and everyone else is served."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from oasiskv.api import split_kwargs
from oasiskv.engine.engine import LLMEngine
from oasiskv.models.loader import LoadedModel
from oasiskv.server.app import BackgroundServer, build_app

GOOD = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def served(smollm_llm):
    """A server in retrieval mode (KV in the host store, a GPU working set per request), so that the
    accounting checks cover both. It reuses the weights already loaded for the dense engine."""
    dense = smollm_llm.engine
    loaded = LoadedModel(dense.model, dense.model_config, dense.tokenizer, dense.model_source)
    config = split_kwargs(dict(show_progress=False, max_num_batched_tokens=512, kv_mode="retrieval", kv_budget=96,
                               host_kv_gb=0.25, kv_cache_gb=0.25))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("oasiskv.engine.engine.load_model", lambda *args, **kwargs: loaded)
        engine = LLMEngine(config)
    app = build_app(engine)
    with BackgroundServer(app) as url:
        yield url, app.state.server


def metric(text: str, name: str, labels: str = "") -> float:
    found = re.search(rf"^{re.escape(name)}{{[^}}]*{re.escape(labels)}[^}}]*}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def scrape(client: httpx.AsyncClient) -> str:
    return (await client.get("/metrics")).text


async def stream_text(client: httpx.AsyncClient, body: dict) -> tuple[str, int]:
    text, events = "", []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        text += json.loads(e)["choices"][0]["text"]
    return text, len(events) - 1


def too_long(state) -> dict:
    return {"prompt": [100] * (state.max_model_len + 1), "max_tokens": 1}


BAD_COMPLETIONS = [  # (name, body: dict, raw bytes, or a function of the server state, status)
    ("malformed JSON", b'{"prompt": "hi",', 400),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', 400),
    ("prompt of the wrong type", {"prompt": 5}, 400),
    ("max_tokens of the wrong type", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("temperature of the wrong type", {"prompt": "hi", "temperature": "hot"}, 400),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}, 400),
    ("zero max_tokens without echo", {"prompt": "hi", "max_tokens": 0}, 400),
    ("huge max_tokens", {"prompt": "hi", "max_tokens": 10 ** 9}, 400),
    ("prompt too long", too_long, 400),
    ("empty prompt", {"prompt": ""}, 400),
    ("empty prompt list", {"prompt": []}, 400),
    ("token id out of range", {"prompt": [10 ** 7]}, 400),
    ("negative temperature", {"prompt": "hi", "temperature": -1}, 400),
    ("top_p zero", {"prompt": "hi", "top_p": 0}, 400),
    ("n zero", {"prompt": "hi", "n": 0}, 400),
    ("too many logprobs", {"prompt": "hi", "logprobs": 21}, 400),
    ("stream_options without stream", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    ("missing prompt", {"max_tokens": 2}, 400),
    # seeds torch refuses failed the engine's step, which lost every request and refused new ones
    ("seed beyond torch's range", {"prompt": "hi", "seed": 2 ** 64}, 400),
    ("second choice's seed beyond it", {"prompt": "hi", "n": 2, "seed": 2 ** 64 - 1}, 400),
    ("seed beyond int64", {"prompt": "hi", "seed": 2 ** 63}, 400),
    ("unknown model", {"prompt": "hi", "model": "no-such-model"}, 404),
    # fields vLLM honours and this server does not: refused, not ignored
    ("suffix", {"prompt": "hi", "suffix": "end"}, 400),
    ("logit_bias beyond the vocabulary", {"prompt": "hi", "logit_bias": {"99999999": 5}}, 400),
    ("logit_bias that is not a token id", {"prompt": "hi", "logit_bias": {"x": 5}}, 400),
    ("logit_bias beyond 100", {"prompt": "hi", "logit_bias": {"5": 101}}, 400),
    ("min_p above 1", {"prompt": "hi", "min_p": 1.5}, 400),
    ("best_of beyond n", {"prompt": "hi", "best_of": 3}, 400),
    ("guided_choice", {"prompt": "hi", "guided_choice": ["a", "b"]}, 400),
    ("priority", {"prompt": "hi", "priority": 5}, 400),
    # echo's prompt logprobs ran the model on ids the engine had not checked (a 500; on a GPU a device assert)
    ("echoed token id out of range", {"prompt": [99999, 5], "max_tokens": 1, "echo": True, "logprobs": 1}, 400),
    ("echoed negative token id", {"prompt": [-3, 5], "max_tokens": 0, "echo": True, "logprobs": 1}, 400),
    ("echo alone of a token id out of range", {"prompt": [99999, 5], "max_tokens": 0, "echo": True}, 400),
    ("a lone surrogate", b'{"prompt": "hi \\ud800", "max_tokens": 2}', 400),
    ("min_tokens above max_tokens", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400),
    ("allowed_token_ids beyond the vocabulary", {"prompt": "hi", "allowed_token_ids": [5, 10 ** 7]}, 400),
    ("empty allowed_token_ids", {"prompt": "hi", "allowed_token_ids": []}, 400),
    ("truncate_prompt_tokens zero", {"prompt": "hi", "truncate_prompt_tokens": 0}, 400),
    ("bad_words not a list", {"prompt": "hi", "bad_words": "x"}, 400),
    # a lone surrogate reached the tokenizer, whose TypeError was a 500
    ("bad word with a lone surrogate", b'{"prompt": "hi", "max_tokens": 2, "bad_words": ["\\ud800"]}', 400),
    ("empty bad word", {"prompt": "hi", "bad_words": [""]}, 400),
    # vLLM refuses empty stop strings; they were dropped
    ("empty stop string", {"prompt": "hi", "stop": ""}, 400),
    ("empty stop string in a list", {"prompt": "hi", "stop": ["", "x"]}, 400),
    # the key's id is read as SamplingParams reads it (" 7" is 7): its range error named the prompt
    ("logit_bias key with a space beyond the vocabulary", {"prompt": "hi", "logit_bias": {" 99999999": 5}}, 400),
    ("detokenize false", {"prompt": "hi", "detokenize": False}, 400),
    ("truncate_prompt_tokens beyond the model", lambda state: {"prompt": "hi",
                                                               "truncate_prompt_tokens": state.max_model_len + 1}, 400),
]
BAD_CHATS = [
    ("empty messages", {"messages": []}, 400),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("content of the wrong type", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("JSON mode", {**CHAT, "response_format": {"type": "json_object"}}, 400),
    ("tools", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("continuing the last message and adding a generation prompt", {**CHAT, "continue_final_message": True}, 400),
    ("documents", {**CHAT, "documents": [{"title": "a", "text": "b"}]}, 400),
    ("reasoning_effort", {**CHAT, "reasoning_effort": "high"}, 400),
    ("chat prompt too long", lambda state: {"messages": [{"role": "user", "content": "hi " * state.max_model_len}]},
     400),
    ("unknown model", {**CHAT, "model": "no-such-model"}, 404),
    ("top_logprobs without logprobs", {**CHAT, "top_logprobs": 3}, 400),
]
PARAMS = {"token id out of range": "prompt", "echoed token id out of range": "prompt", "a lone surrogate": "prompt",
          "logit_bias beyond the vocabulary": "logit_bias", "min_tokens above max_tokens": "min_tokens",
          "allowed_token_ids beyond the vocabulary": "allowed_token_ids", "empty allowed_token_ids": "allowed_token_ids",
          "truncate_prompt_tokens zero": "truncate_prompt_tokens", "bad_words not a list": "bad_words",
          "bad word with a lone surrogate": "bad_words", "empty bad word": "bad_words", "empty stop string": "stop",
          "empty stop string in a list": "stop", "logit_bias key with a space beyond the vocabulary": "logit_bias",
          "detokenize false": "detokenize",
          "truncate_prompt_tokens beyond the model": "truncate_prompt_tokens",
          "min_p above 1": "min_p", "seed beyond torch's range": "seed",
          "top_logprobs without logprobs": "top_logprobs",
          "suffix": "suffix", "best_of beyond n": "best_of", "guided_choice": "guided_choice", "priority": "priority",
          "documents": "documents", "reasoning_effort": "reasoning_effort", "prompt too long": "prompt",
          "chat prompt too long": "messages", "huge max_tokens": "max_tokens", "seed beyond int64": "seed"}


async def post_raw(client, path: str, body, state) -> httpx.Response:
    body = body(state) if callable(body) else body
    if isinstance(body, bytes):
        return await client.post(path, content=body, headers={"content-type": "application/json"})
    return await client.post(path, json=body)


def test_bad_inputs_get_vllm_errors_while_a_stream_completes(served):
    url, state = served
    table = [("/v1/completions", *row) for row in BAD_COMPLETIONS] + [("/v1/chat/completions", *r) for r in BAD_CHATS]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            good = asyncio.create_task(stream_text(client, {**GOOD, "max_tokens": 12}))
            responses = await asyncio.gather(*(post_raw(client, path, body, state) for path, _, body, _ in table))
            return responses, await good

    responses, (text, chunks) = asyncio.run(main())
    for (path, name, _, status), r in zip(table, responses):
        assert r.status_code == status, (name, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, name
        assert isinstance(error["message"], str) and len(error["message"]) > 5, name
        assert error["param"] == PARAMS.get(name, error["param"]), (name, error)
    assert chunks == 12 and text
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/tokenize", content=b'{"prompt": "hi \\ud800"}', headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert client.post("/v1/completions", json=GOOD).status_code == 200


def test_disconnecting_clients_free_their_kv_and_others_finish(served):
    url, state = served
    engine = state.engine

    held = []  # the engine's accounting while the first client still holds its stream

    async def start_then_leave(client, i: int) -> None:
        async with client.stream("POST", "/v1/completions",
                                 json={**GOOD, "prompt": f"Story {i}:", "max_tokens": 400, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    if not held:
                        held.append(await state.loop.snapshot())
                    return  # the first chunk arrived: hang up mid-stream

    async def leave_without_streaming(client) -> None:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json={**GOOD, "max_tokens": 400}, timeout=2)

    async def main():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            before = await scrape(client)
            await asyncio.gather(leave_without_streaming(client), *(start_then_leave(client, i) for i in range(200)))
            for _ in range(200):  # the aborts are queued to the engine thread; wait for them to land
                snap = await state.loop.snapshot()
                if snap["running"] == snap["waiting"] == snap["tracked"] == 0:
                    break
                await asyncio.sleep(0.05)
            after = await scrape(client)
            text, chunks = await stream_text(client, GOOD)
            return before, after, snap, chunks

    before, after, snap, chunks = asyncio.run(main())
    assert held[0]["running"] > 0 and held[0]["host_kv_bytes_used"] > 0
    assert snap["kv_blocks_used"] == 0 and snap["host_kv_bytes_used"] == 0 and snap["gpu_working_set_rows_used"] == 0
    assert engine.allocator.num_free == engine.allocator.num_blocks and not engine.requests
    assert metric(after, "oasiskv:num_requests_running") == metric(after, "oasiskv:num_requests_waiting") == 0
    assert metric(after, "oasiskv:kv_cache_used_blocks") == 0
    aborted = 'finished_reason="abort"'
    assert metric(after, "oasiskv:request_success_total", aborted) - metric(before, "oasiskv:request_success_total",
                                                                            aborted) == 201
    assert chunks == GOOD["max_tokens"]


def test_64_concurrent_clients_complete_and_counters_match(served):
    url, state = served
    prompts = [f"Fact number {i}:" for i in range(64)]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=None)) as client:
            before = await scrape(client)
            responses = await asyncio.gather(*(client.post("/v1/completions", json={**GOOD, "prompt": p,
                                                                                     "max_tokens": 3})
                                               for p in prompts))
            return before, responses, await scrape(client)

    before, responses, after = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 64
    assert all(r.json()["usage"]["completion_tokens"] == 3 for r in responses)

    def delta(name, labels=""):
        return metric(after, name, labels) - metric(before, name, labels)

    assert delta("oasiskv:request_success_total", 'finished_reason="length"') == 64
    assert delta("oasiskv:generation_tokens_total") == 64 * 3
    assert delta("oasiskv:prompt_tokens_total") == sum(len(state.tokenizer.encode(p)) for p in prompts)
    assert delta("oasiskv:time_to_first_token_seconds_count") == 64
    assert delta("oasiskv:e2e_request_latency_seconds_count") == 64
    assert delta("oasiskv:inter_token_latency_seconds_count") == 64 * 2


@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_a_port_that_cannot_be_listened_on_fails_before_weights_load(command, monkeypatch):
    """uvicorn found a busy port only after the engine was built (minutes for a large model)."""
    import socket

    from oasiskv import cli
    from oasiskv.engine import engine

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the port was checked")

    monkeypatch.setattr(engine, "load_model", no_loading)
    extra = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"] if command == "proxy" else []
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}: .*in use"):
            cli.main([command, "--port", str(port), *extra])
    with pytest.raises(SystemExit, match="--port must be in 0..65535"):
        cli.main([command, "--port", "70000", *extra])
    with pytest.raises(SystemExit, match="cannot listen on no-such-host.invalid"):
        cli.main([command, "--host", "no-such-host.invalid", "--port", "0", *extra])


def test_chat_options_on_completions_are_ignored_as_vllm_ignores_them(served):
    """add_generation_prompt and friends are chat's fields; on /v1/completions vLLM ignores them as unknown."""
    url, _ = served
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v1/completions", json={**GOOD, "add_generation_prompt": False,
                                                 "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text


def test_a_refusal_that_may_pass_later_is_a_503():
    """The engine loop keeps the `retry_later` mark of a refusal (a decode instance without room now) through its
    prompt-index prefix; the submission answers 503 for it and 400 for the rest."""
    import asyncio

    from oasiskv.server.engine_loop import EngineLoop
    from oasiskv.server.generation import Submission
    from oasiskv.server.protocol import APIError

    class Full(ValueError):
        retry_later = True

    class Engine:
        def __init__(self, error):
            self.error = error

        def add_request(self, *args, **kwargs):
            raise self.error

        def abort(self, rid):
            pass

    for error, status in ((Full("no room now"), 503), (ValueError("bad prompt"), 400)):
        loop = EngineLoop.__new__(EngineLoop)  # only its _add_all, on this thread
        loop.engine = Engine(error)
        with pytest.raises(ValueError) as raised:
            loop._add_all(["a", "b"], [[1], [2]], [None, None], None, None, {})
        assert raised.value.retry_later == (status == 503) and str(raised.value).startswith("prompt 0: ")

        class Loop:
            async def add(self, *args):
                raise raised.value

        with pytest.raises(APIError) as answered:
            asyncio.run(Submission.start(Loop(), [[1]], [None], None))
        assert answered.value.status == status
