"""`oasiskv proxy` against stand-in prefill and decode servers (no model): what it sends to each,
what it passes back (JSON, SSE, errors), and when the prefill's answer is the whole answer."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from oasiskv.bench.serve import server_vocab_size
from oasiskv.disagg.proxy import build_proxy_app
from oasiskv.server.app import BackgroundServer

PARAMS = {"remote_agent": "a", "first_token_id": 7}
TOKENIZER_INFO = {"vocab_size": 151936, "eos_token": "<|im_end|>"}


def stand_ins(seen: dict) -> tuple[FastAPI, FastAPI]:
    """A prefill that answers one token (stopping when the prompt says "stop"), and a decode that
    echoes the body it got, as JSON or as two SSE events."""
    prefill, decode = FastAPI(), FastAPI()

    @prefill.post("/v1/completions")
    @prefill.post("/v1/chat/completions")
    async def prefill_route(request: Request):
        body = seen["prefill"] = await request.json()
        if body.get("prompt") == "bad":
            return JSONResponse({"error": {"message": "prompt too long", "code": 400}}, status_code=400)
        stops = body.get("prompt") == "stop" or body.get("messages", [{}])[0].get("content") == "stop"
        choice = {"index": 0, "finish_reason": "stop" if stops else "length"}
        choice.update({"message": {"role": "assistant", "content": "A"}} if "messages" in body else {"text": "A"})
        params = None if stops or "kv_transfer_params" not in body else PARAMS
        return {"id": "p", "object": "x", "choices": [choice], "usage": {}, "kv_transfer_params": params}

    @decode.get("/tokenizer_info")
    async def tokenizer_info():
        return TOKENIZER_INFO

    @decode.post("/tokenize")
    async def tokenize(request: Request):
        return {"tokens": [len(w) for w in (await request.json())["prompt"].split()]}

    @decode.post("/v1/completions")
    async def decode_route(request: Request):
        body = seen["decode"] = await request.json()
        seen.setdefault("decode bodies", []).append(body)
        if body.get("prompt") in ("full", "full for now") and \
                (body["prompt"] == "full" or len(seen["decode bodies"]) < 3):  # no room on the decode (now)
            return JSONResponse({"error": {"message": "no room; retry later", "code": 503}}, status_code=503)
        if body.get("prompt") == "slow":  # until the proxy drops the request (or 10 s)
            for _ in range(100):
                if await request.is_disconnected():
                    seen["decode dropped"] = True
                    break
                await asyncio.sleep(0.1)
        if not body.get("stream"):
            return {"choices": [{"text": "AB"}], "echo": body}

        async def events():
            for piece in ("A", "B"):
                yield f"data: {json.dumps({'choices': [{'text': piece}]})}\n\n"
                if body.get("prompt") == "die":
                    raise RuntimeError("the decode instance dies mid-stream")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return prefill, decode


@pytest.fixture(scope="module")
def proxied():
    seen: dict = {}
    prefill, decode = stand_ins(seen)
    with BackgroundServer(prefill) as prefill_url, BackgroundServer(decode) as decode_url:
        with BackgroundServer(build_proxy_app(prefill_url, decode_url)) as url:
            with httpx.Client(base_url=url, timeout=30) as client:
                yield client, seen


def test_prefill_then_decode_with_the_prefills_kv_transfer_params(proxied):
    client, seen = proxied
    seen.clear()
    out = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream_options": None}).json()
    assert seen["prefill"]["max_tokens"] == 1 and seen["prefill"]["kv_transfer_params"] == {"do_remote_decode": True}
    assert "stream" not in seen["prefill"]
    assert out["echo"] == {"prompt": "hi", "max_tokens": 5, "stream_options": None, "kv_transfer_params": PARAMS}


def test_streams_pass_through(proxied):
    client, seen = proxied
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.split("\n\n")[:3] == ['data: {"choices": [{"text": "A"}]}',
                                               'data: {"choices": [{"text": "B"}]}', "data: [DONE]"]
    assert seen["prefill"]["kv_transfer_params"] == {"do_remote_decode": True} and seen["decode"]["stream"] is True


def test_the_prefill_alone_answers_one_token_and_a_first_token_stop(proxied):
    client, seen = proxied
    seen.clear()
    one = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()
    assert "kv_transfer_params" not in seen["prefill"] and "decode" not in seen and one["choices"][0]["text"] == "A"
    stopped = client.post("/v1/completions", json={"prompt": "stop", "max_tokens": 5}).json()
    assert ("decode" not in seen and "kv_transfer_params" not in stopped
            and stopped["choices"][0]["finish_reason"] == "stop")
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "stop"}], "stream": True})
    events = [line[6:] for line in chat.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    first = json.loads(events[0])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["content"] == "A"


def test_errors_pass_through(proxied):
    client, _ = proxied
    bad = client.post("/v1/completions", json={"prompt": "bad", "max_tokens": 5})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "prompt too long"
    garbled = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert garbled.status_code == 400 and "not valid JSON" in garbled.json()["error"]["message"]


def test_tokenizer_endpoints_pass_through(proxied):
    """`bench serve` draws its prompts from /tokenizer_info's vocab_size: through a proxy without it, the
    disaggregated GPU run of 2026-11-30 got tokens in [128, 256) where the single instance got the model's."""
    client, _ = proxied
    assert client.get("/tokenizer_info").json() == TOKENIZER_INFO
    assert client.post("/tokenize", json={"prompt": "a bb ccc"}).json() == {"tokens": [1, 2, 3]}
    # the target path is fixed by the route, not read from the query string
    assert client.post("/tokenize?path=/v1/models", json={"prompt": "a"}).json() == {"tokens": [1]}

    async def vocab():
        async with httpx.AsyncClient(base_url=str(client.base_url)) as bench_client:
            return await server_vocab_size(bench_client)

    assert asyncio.run(vocab()) == TOKENIZER_INFO["vocab_size"]


def test_every_route_reports_instances_that_are_down_as_a_502():
    """Nothing listens on ports 1 and 2: each route the proxy forwards answers the API's error body, code 502."""
    with BackgroundServer(build_proxy_app("http://127.0.0.1:1", "http://127.0.0.1:2")) as url:
        answers = [httpx.get(url + "/v1/models"), httpx.get(url + "/tokenizer_info"),
                   httpx.post(url + "/tokenize", json={"prompt": "hi"}),
                   httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})]
        for r in answers:
            assert r.status_code == 502, (r.request.url, r.text)
            error = r.json()["error"]
            assert error["type"] == "BadGatewayError" and "an instance behind the proxy failed" in error["message"]
        assert httpx.get(url + "/health").status_code == 503


def test_the_prefill_keeps_min_tokens_to_its_one_token(proxied):
    """min_tokens 4 on a prefill asked for max_tokens 1 is refused (min_tokens > max_tokens); its one token must
    still not be EOS, so it gets min_tokens 1, and the decode instance the request's own."""
    client, seen = proxied
    seen.clear()
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "min_tokens": 4})
    assert seen["prefill"]["min_tokens"] == 1 and seen["decode"]["min_tokens"] == 4


def test_no_token_to_decode_goes_to_the_prefill_alone(proxied):
    """max_tokens 0 (an echo, or the prefill's own 400): sent on, the prompt's KV would wait at the prefill for a
    decode that never claims it."""
    client, seen = proxied
    for limit in (0, -1):
        seen.clear()
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": limit, "echo": True})
        assert seen["prefill"]["max_tokens"] == limit and "kv_transfer_params" not in seen["prefill"]
        assert "decode" not in seen


def test_a_first_token_stop_streams_its_usage_when_asked(proxied):
    client, _ = proxied
    chat = client.post("/v1/completions", json={"prompt": "stop", "stream": True, "max_tokens": 5,
                                                "stream_options": {"include_usage": True}})
    events = [line[6:] for line in chat.text.split("\n") if line.startswith("data: ")]
    usage_chunk = json.loads(events[-2])
    assert events[-1] == "[DONE]" and usage_chunk["choices"] == [] and "usage" in usage_chunk


def test_a_decode_that_dies_mid_stream_ends_the_stream_with_an_error(proxied):
    client, _ = proxied
    response = client.post("/v1/completions", json={"prompt": "die", "max_tokens": 5, "stream": True})
    events = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "A"
    assert events[-1] == "[DONE]" and "failed mid-stream" in json.loads(events[-2])["error"]["message"]


def test_a_caller_that_leaves_drops_the_decode_request(proxied):
    """Not streamed: closing the connection to the decode instance is what aborts the request there."""
    client, seen = proxied
    seen.clear()
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={"prompt": "slow", "max_tokens": 5}, timeout=1.0)
    for _ in range(50):
        if seen.get("decode dropped"):
            break
        asyncio.run(asyncio.sleep(0.1))
    assert seen.get("decode dropped")


def test_a_decodes_503_is_sent_again_with_the_same_params(monkeypatch):
    """A decode without room now answers 503, and the prefill keeps the prompt's KV for a resend with the same
    kv_transfer_params; the proxy sent none, so that KV waited for its lease. It resends now, for decode_retry_s."""
    from oasiskv.disagg.proxy import Proxy

    monkeypatch.setattr(Proxy, "decode_retry_s", 0.5)
    seen: dict = {}
    prefill, decode = stand_ins(seen)
    with BackgroundServer(prefill) as prefill_url, BackgroundServer(decode) as decode_url:
        with BackgroundServer(build_proxy_app(prefill_url, decode_url)) as url:
            with httpx.Client(base_url=url, timeout=30) as client:
                body = {"prompt": "full for now", "max_tokens": 4}
                out = client.post("/v1/completions", json=body)
                assert out.status_code == 200 and out.json()["choices"][0]["text"] == "AB"
                sent = seen.pop("decode bodies")
                assert len(sent) == 3 and all(b["kv_transfer_params"] == PARAMS for b in sent)
                refused = client.post("/v1/completions", json={**body, "prompt": "full"})
                assert refused.status_code == 503 and len(seen["decode bodies"]) > 2  # resent, then given up

