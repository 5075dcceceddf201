"""A step's last budget token can start a prompt (or continue one) with a one-token chunk that does not end it. Such
a chunk is a prefill: the runner once took every one-token chunk for a decode, so the tiered modes wrote its K/V to
the tail block only, never to the host store where the prompt's later chunks read their prefix (retrieval read
zeros there; oasis took the request for a decoding one and failed its next step). A prompt's last token alone is a
prefill too: as a decode it attended to the sparse modes' selection, so with the budget below the context the chunking
changed the output. Checked against the unchunked run of dense, on the embedded SmolLM2, with every sparse mode's
budget above the context (where each must produce exactly what dense produces), and against each sparse mode's own
unchunked run with the budget below the context."""
from __future__ import annotations

import pytest

from oasiskv.api import LLM, SamplingParams
from oasiskv.engine.runner import is_decode, order_decodes_first
from oasiskv.engine.scheduler import ScheduledChunk

TEXT = ("Once upon a time there was a little dragon who lived in a cave near the sea. Every morning the dragon "
        "flew over the village and the children waved at it from the hills.")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def engine_kwargs(mode: str) -> dict:
    sparse = {} if mode == "dense" else dict(kv_budget=256, fetch_cap=1.0)
    return dict(show_progress=False, kv_cache_gb=0.25, kv_mode=mode, **sparse)


@pytest.fixture(scope="module")
def prompts_and_reference():
    llm = LLM(**engine_kwargs("dense"))
    ids = llm.get_tokenizer().encode(TEXT)
    prompts = [ids[:31], ids[:22], ids[:40]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


def test_only_a_sampling_one_token_chunk_is_a_decode():
    def chunk(n: int, sample: bool) -> ScheduledChunk:
        return ScheduledChunk(f"{n}{sample}", list(range(n)), 0, [0], sample)

    piece, decode, prompt = chunk(1, False), chunk(1, True), chunk(5, True)
    assert [is_decode(c) for c in (piece, decode, prompt)] == [False, True, False]
    assert order_decodes_first([piece, prompt, decode]) == [decode, piece, prompt]


@pytest.mark.parametrize("mode", ["dense", "quest", "retrieval", "oasis"])
def test_a_one_token_first_chunk_changes_no_output(mode, prompts_and_reference):
    # 32 tokens a step: the 31-token prompt leaves the 22-token one a single token at position 0; the 40-token prompt
    # then waits, and starts in what later steps leave
    prompts, want = prompts_and_reference
    llm = LLM(max_num_batched_tokens=32, **engine_kwargs(mode))
    plans = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        plans.append([(c.request_id, c.start, len(c.token_ids), c.sample) for c in out.chunks])
        return out

    llm.engine.scheduler.schedule = recording
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert any(n == 1 and not sample for plan in plans for _, _, n, sample in plan)  # the case under test happened
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize("mode", ["retrieval", "oasis"])
def test_the_keep_lets_go_of_a_prompt_whose_last_token_came_alone(mode):
    llm = LLM(max_num_batched_tokens=32, prefill_keep_tokens=64, **engine_kwargs(mode))
    ids = llm.get_tokenizer().encode(TEXT)[:33]  # 32 tokens, then the last alone
    engine = llm.engine
    engine.add_request(ids, GREEDY)
    keep = engine.runner.policy.keep
    engine.step()
    assert keep.holder is not None  # the first chunk is kept for the next one
    engine.step()
    assert keep.holder is None
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("mode", ["quest", "retrieval", "oasis", "oracle"])
def test_a_prompts_last_token_alone_changes_no_output_below_the_budget(mode, tmp_path):
    """A 73-token prompt in chunks of 18 (its last token alone) against one chunk, the budget (32 tokens) below the
    context, on a tiny random model: the last token ran as a decode over the selection, and the first output token
    changed in every sparse mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)  # weights of a wide spread: the selection decides the tokens
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True, initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    prompt = [(7 * i * i + 3 * i + 11) % 250 + 3 for i in range(73)]
    sparse = dict(model=str(tmp_path / "model"), dtype="float32", show_progress=False, kv_cache_gb=0.05,
                  kv_mode=mode, kv_budget=32, sink_blocks=0, local_blocks=1, fetch_cap=1.0,
                  **({"host_kv_gb": 0.02} if mode in ("retrieval", "oasis") else {}))
    outs = {}
    for chunk in (4096, 18):
        llm = LLM(max_num_batched_tokens=chunk, **sparse)
        outs[chunk] = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[18] == outs[4096]
