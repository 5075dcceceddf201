"""The server with async scheduling (its default on a GPU; asked for here on the CPU): streamed and whole
completions, stop strings and concurrent requests give what the offline API gives without it."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from oasiskv.config import SamplingParams
from oasiskv.server.app import BackgroundServer, build_app

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
STOP = [","]


@pytest.fixture(scope="module")
def served(smollm_llm):
    engine = smollm_llm.engine
    assert not engine.async_scheduling  # the CPU default: the references are synchronous
    refs = {"greedy": smollm_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False),
            "stop": smollm_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, stop=STOP),
                                        use_tqdm=False)}
    engine.async_scheduling = True
    try:
        app = build_app(engine)
        with BackgroundServer(app) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="none"), app.state.server.model_name, refs, engine
    finally:
        engine.async_scheduling = False


def streamed_text(client, model, prompt, **kw) -> tuple[str, str]:
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            **kw))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].choices[0].finish_reason


def test_async_completions_equal_the_synchronous_ones(served):
    client, model, refs, engine = served
    steps = engine.stats.steps
    out = client.completions.create(model=model, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in out.choices] == [r.outputs[0].text for r in refs["greedy"]]
    assert engine.stats.steps > steps and engine.overlap_now()  # the requests ran with async scheduling


def test_async_streams_with_stop_strings_and_concurrent_requests(served):
    client, model, refs, _ = served
    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        plain = list(pool.map(lambda p: streamed_text(client, model, p), PROMPTS))
        stopped = list(pool.map(lambda p: streamed_text(client, model, p, stop=STOP), PROMPTS))
    assert [t for t, _ in plain] == [r.outputs[0].text for r in refs["greedy"]]
    assert [t for t, _ in stopped] == [r.outputs[0].text for r in refs["stop"]]
    assert [f for _, f in stopped] == [r.outputs[0].finish_reason for r in refs["stop"]]
