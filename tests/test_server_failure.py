"""An engine whose step fails: in-flight requests get a 500 (or an error event in their stream),
/health turns 503, and new requests are refused. A stand-in engine, no model."""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from oasiskv.models.generation_config import GenerationDefaults
from oasiskv.server.app import BackgroundServer, build_app


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(ids).decode(errors="replace")

    def text_context(self, prompt_ids) -> list[int]:
        return []

    def decode_after(self, context, ids) -> str:
        return self.decode(ids)


class BrokenEngine:
    """Takes requests like LLMEngine; its step raises."""

    def __init__(self):
        self.tokenizer, self.max_model_len, self.model_source = ByteTokenizer(), 64, "fake"
        self.generation = GenerationDefaults()  # no default sampling params of its own
        self.config, self.model_config = SimpleNamespace(model="fake"), SimpleNamespace(vocab_size=256)
        self.sampler = SimpleNamespace(sample=None, forget=lambda rid: None)
        self.requests: dict = {}

    def add_request(self, prompt, params, request_id):
        self.requests[request_id] = prompt

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self):
        raise RuntimeError("the device fell over")


@pytest.fixture(scope="module")
def url():
    with BackgroundServer(build_app(BrokenEngine())) as base:
        yield base


def test_a_failing_engine_fails_requests_cleanly_and_reports_unhealthy(url):
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        streamed = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
        lines = [line[6:] for line in streamed.text.split("\n") if line.startswith("data: ")]
        assert lines[-1] == "[DONE]" and "device fell over" in json.loads(lines[-2])["error"]["message"]
        assert client.get("/health").status_code == 503
        for body in ({"prompt": "hi", "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2, "stream": True}):
            refused = client.post("/v1/completions", json=body)
            assert refused.status_code == 500 and refused.json()["error"]["code"] == 500
