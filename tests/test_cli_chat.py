"""`oasiskv chat`: a conversation that outgrows --max-model-len drops its oldest exchanges instead of ending the
session, and a message that cannot fit alone is refused with the conversation kept."""
from __future__ import annotations

from oasiskv.cli import chat_turn
from oasiskv.config import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)


def test_the_oldest_exchange_goes_when_the_conversation_outgrows_the_limit(smollm_llm, monkeypatch, capsys):
    monkeypatch.setattr(smollm_llm.engine, "max_model_len", 90)
    system, latest = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}
    old = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "hello, " * 40}]
    messages = [system, *old, latest]
    assert len(smollm_llm.tokenizer.apply_chat_template(messages)) >= 90  # it does not fit as it is
    reply = chat_turn(smollm_llm, messages, GREEDY, first=1)
    assert messages == [system, latest] and "oldest exchange is dropped" in capsys.readouterr().err
    assert reply == smollm_llm.chat([system, latest], GREEDY, use_tqdm=False)[0].outputs[0].text


def test_a_message_that_cannot_fit_alone_is_refused_and_the_conversation_kept(smollm_llm, monkeypatch, capsys):
    monkeypatch.setattr(smollm_llm.engine, "max_model_len", 90)
    kept = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    messages = [*kept, {"role": "user", "content": "word " * 200}]
    assert chat_turn(smollm_llm, messages, GREEDY, first=0) is None
    assert messages[:2] == kept and len(messages) == 3  # the caller drops the refused message
    assert "does not fit --max-model-len 90" in capsys.readouterr().err
