"""oasis mode: lookahead prefetch under a fetch cap. Exact where it must be, never over the cap, and
outputs that come from the target alone."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from oasiskv.api import LLM, SamplingParams
from oasiskv.config import CacheConfig, EngineConfig, KVConfig, SamplingParams as SP, SchedulerConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.lookahead.ngram import NgramDraft
from oasiskv.lookahead.teacher import TeacherDraft
from oasiskv.lookahead.draft_data import stdlib_prompts

from tests.test_sparse_modes import PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SPARSE = dict(kv_budget=64, sink_blocks=1, local_blocks=1, kv_cache_gb=0.2, host_kv_gb=0.5, max_num_batched_tokens=256)


def run(llm: LLM, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def run_with_perfect_draft(llm: LLM, prompts: list, reference: list[list[int]], params=GREEDY
                           ) -> tuple[list[list[int]], dict]:
    """Greedy tokens of `prompts` (texts or token ids) when every draft is the next token of `reference` (a run's
    outputs), and the engine's stats."""
    engine = llm.engine
    ids = {str(i): p if isinstance(p, list) else engine.tokenizer.encode(p) for i, p in enumerate(prompts)}
    engine.drafter = TeacherDraft({rid: len(p) for rid, p in ids.items()}, {str(i): t for i, t in enumerate(reference)})
    for rid, prompt in ids.items():
        engine.add_request(prompt, params, request_id=rid)
    while engine.has_unfinished():
        engine.step()
    return [engine.requests[str(i)].output_token_ids for i in range(len(prompts))], engine.stats_dict()


@pytest.mark.parametrize("miss_policy", ["skip", "fill"])  # no misses: nothing left out, nothing filled
def test_perfect_draft_with_full_cap_gives_quest_tokens(miss_policy):
    long_prompts = PROMPTS[:2]  # 70 and 120 tokens: both outgrow the 4-block budget
    quest = run(LLM(show_progress=False, kv_mode="quest", **SPARSE), long_prompts)
    llm = LLM(show_progress=False, kv_mode="oasis", fetch_cap=1.0, miss_policy=miss_policy, **SPARSE)
    oasis, stats = run_with_perfect_draft(llm, long_prompts, quest)
    assert oasis == quest
    assert stats["kv_prefetched_blocks"] > 0  # the context outgrows the budget: blocks really moved
    assert stats["kv_agreement"] > 0.9, stats["kv_agreement_per_layer"]
    # every token after a request's first (sampled by its prefill) had a draft, and the teacher was always right
    assert stats["draft_tokens"] == sum(len(t) - 1 for t in quest) and stats["draft_accuracy"] == 1.0


@pytest.mark.parametrize("miss_policy", ["skip", "fill", "fetch"])
def test_a_cap_of_one_fetches_what_even_a_perfect_draft_misses(miss_policy):
    """A perfect draft token still leaves misses: the draft row's query is computed over x_t's selection, not its
    own. A cap of 1 (fetch-all) fetches them under every miss policy, so oasis gives quest's tokens (with skip and
    fill it gave other tokens here: a helper's randomized test found the workload)."""
    from oasiskv.evals.texts import load_corpus

    sparse = dict(kv_budget=48, sink_blocks=1, local_blocks=1, kv_cache_gb=0.2, max_num_batched_tokens=1024)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    quest_llm = LLM(show_progress=False, kv_mode="quest", **sparse)
    ids = quest_llm.get_tokenizer().encode(" ".join(load_corpus("sample")[0].split()[:600]))
    prompts = [ids[11 * k:11 * k + n] for k, n in enumerate([64, 95, 64, 215])]
    quest = [o.outputs[0].token_ids for o in quest_llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                 use_tqdm=False)]
    llm = LLM(show_progress=False, kv_mode="oasis", fetch_cap=1.0, host_kv_gb=0.5, miss_policy=miss_policy, **sparse)
    oasis, stats = run_with_perfect_draft(llm, prompts, quest, params)
    assert oasis == quest
    assert stats["draft_accuracy"] == 1.0 and stats["kv_miss_fetched_blocks"] > 0  # misses happened, and were fetched


class RecordingSampler:
    """Wraps the engine's sampler: keeps every logits row it was given and what it returned."""

    def __init__(self, inner):
        self.inner, self.rows, self.tokens = inner, [], []

    def sample(self, logits, request_ids, params):
        tokens = self.inner.sample(logits, request_ids, params)
        self.rows.append((len(request_ids), logits.shape[0]))
        self.tokens.append((logits.argmax(-1).tolist(), list(tokens)))
        return tokens

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def dense_tokens():
    return run(LLM(show_progress=False, kv_mode="dense", kv_cache_gb=0.2))


@pytest.mark.parametrize("draft", ["repeat", "ngram", "eagle3", "target", "target+eagle3"])  # eagle3: shipped head
def test_outputs_come_from_the_target_and_budget_above_context_is_dense(draft, dense_tokens):
    if draft == "ngram":  # the draft never matters when everything is attended: one source suffices
        roomy = LLM(show_progress=False, kv_mode="oasis", draft=draft, kv_budget=2048, kv_cache_gb=0.2, host_kv_gb=0.5)
        assert run(roomy) == dense_tokens
    llm = LLM(show_progress=False, kv_mode="oasis", draft=draft, fetch_cap=0.25, **SPARSE)
    recorder = llm.engine.sampler = RecordingSampler(llm.engine.sampler)
    run(llm)
    assert all(n == rows for n, rows in recorder.rows)  # one logits row per sampling request, none for drafts
    assert all(argmax == tokens for argmax, tokens in recorder.tokens)  # greedy tokens are the target's argmax
    stats = llm.engine.stats_dict()
    assert stats["kv_max_prefetched_blocks"] <= stats["kv_fetch_cap_blocks"] == 1
    assert len(stats["kv_agreement_per_layer"]) == 30 and 0 < stats["kv_agreement"] <= 1
    assert stats["kv_selected_blocks"] == stats["kv_hits"] + stats["kv_misses"]


def test_shipped_eagle3_head_guesses_the_next_token():
    """Draft acceptance of the shipped head: how often its guess is the token the target emits next."""
    llm = LLM(show_progress=False, kv_mode="oasis", draft="eagle3", kv_cache_gb=0.2, host_kv_gb=0.5)
    engine, guesses = llm.engine, []
    propose = engine.drafter.propose

    def recording(chunks, captured):
        out = propose(chunks, captured)
        guesses.extend((rid, len(next(c for c in chunks if c.request_id == rid).context), tok)
                       for rid, tok in out.items())
        return out

    engine.drafter.propose = recording
    questions = stdlib_prompts(seed=12345)  # the kind of prompt it was trained on, another draw
    chats = [[{"role": "user", "content": next(questions)}] for _ in range(2)]
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    tokens = {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outs}
    judged = [(tokens[rid][pos] == tok) for rid, pos, tok in guesses if pos < len(tokens[rid])]
    acceptance = sum(judged) / len(judged)
    assert len(judged) > 60 and acceptance > 0.3, acceptance  # trained: 0.46 top-1 on held-out chats


def test_target_draft_after_a_draft_that_came_true_is_the_next_token(dense_tokens):
    """--draft target: where the draft that ran beside a step was the token sampled, the next draft is the target's
    argmax on that draft's row. With the budget above the context that row attends exactly what the next step's
    token attends, so the guess must be the token sampled next (greedy); elsewhere prompt lookup proposes."""
    llm = LLM(show_progress=False, kv_mode="oasis", draft="target", kv_budget=2048, kv_cache_gb=0.2, host_kv_gb=0.5)
    engine, proposals = llm.engine, []
    propose = engine.drafter.propose

    def recording(chunks, captured):
        out = propose(chunks, captured)
        proposals.extend((c.request_id, len(c.context), c.ran_draft == c.context[-1], c.target_guess, out[c.request_id])
                         for c in chunks if c.sampled)
        return out

    engine.drafter.propose = recording
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    tokens = {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outs}
    assert [o.outputs[0].token_ids for o in outs] == dense_tokens  # drafts never change the output
    guessed = [(rid, pos, draft) for rid, pos, came_true, guess, draft in proposals
               if came_true and pos < len(tokens[rid])]
    assert len(guessed) > 40
    assert all(draft == guess for _, _, came_true, guess, draft in proposals if came_true)
    assert [tokens[rid][pos] for rid, pos, _ in guessed] == [draft for *_, draft in guessed]
    stats = engine.stats_dict()
    assert stats["draft_accuracy"] > 0.8, stats["draft_accuracy"]  # prompt lookup alone: about 0.4 on these prompts


def tiny_engine(tmp_path, mode: str = "oasis", **kv) -> LLMEngine:
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = EngineConfig(model=str(tmp_path), load_format="dummy", show_progress=False, seed=3,
                       kv=KVConfig(mode=mode, budget=64, sink_blocks=1, local_blocks=1, host_kv_gb=0.01, **kv),
                       cache=CacheConfig(kv_cache_gb=0.05), scheduler=SchedulerConfig(max_num_batched_tokens=512))
    return LLMEngine(cfg)


def run_random_requests(engine: LLMEngine, seed: int, lengths, max_tokens: int) -> None:
    """Random-token prompts of these lengths, sampled at temperature 0.8, run to the end."""
    gen = torch.Generator().manual_seed(seed)
    for i, length in enumerate(lengths):
        engine.add_request(torch.randint(0, 256, (length,), generator=gen).tolist(),
                           SP(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True), request_id=str(i))
    while engine.has_unfinished():
        engine.step()


def resident(engine: LLMEngine) -> dict[tuple[str, int], set[int]]:
    ws = engine.policy.ws
    return {(rid, layer): {b for b in ws.block_of[layer, ws.row(rid)].tolist() if b >= 0}
            for rid, r in engine.requests.items() if not r.finished and r.num_computed_tokens
            for layer in range(ws.block_of.shape[0])}


def test_fetch_cap_holds_for_hundreds_of_steps_and_resident_blocks_equal_the_host(tmp_path):
    engine = tiny_engine(tmp_path, fetch_cap=0.25, draft="ngram")  # cap: 16 tokens = 1 block
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        engine.add_request(torch.randint(0, 256, (150 + 40 * i,), generator=gen).tolist(),
                           SP(temperature=0.8, seed=i, max_tokens=300, ignore_eos=True), request_id=str(i))
    engine.step()  # prefill
    bs, steps, new_blocks = engine.block_size, 0, 0
    while engine.has_unfinished():
        before = resident(engine)
        engine.step()
        steps += 1
        for (rid, layer), now in resident(engine).items():
            req = engine.requests[rid]
            opened = req.num_computed_tokens // bs  # the block the draft of the next position opens
            added = now - before.get((rid, layer), set()) - {opened, (req.num_computed_tokens - 1) // bs}
            if before.get((rid, layer)):  # not the cold start right after the prefill
                assert len(added) <= 1, (steps, rid, layer, added)  # the cap, seen from the working set
                new_blocks += len(added)
        if steps % 50 == 0:
            check_resident_blocks_equal_host(engine)
    stats = engine.stats_dict()
    assert steps >= 300 and new_blocks > 50
    assert stats["kv_max_prefetched_blocks"] == 1 and stats["kv_prefetched_blocks"] >= new_blocks
    assert stats["kv_prefetch_bytes"] == stats["kv_prefetched_blocks"] * engine.host.chunk_bytes


def test_draft_accuracy_counts_the_guesses_that_came_true(tmp_path):
    engine = tiny_engine(tmp_path, fetch_cap=0.25, draft="repeat")  # guesses the token just sampled
    gen = torch.Generator().manual_seed(5)
    prompts = {str(i): torch.randint(0, 4, (40 + 20 * i,), generator=gen).tolist() for i in range(3)}
    for rid, ids in prompts.items():  # a 4-token vocabulary of the prompt, sampled: repeats are common
        engine.add_request(ids, SP(temperature=1.0, top_k=4, seed=int(rid), max_tokens=30, ignore_eos=True),
                           request_id=rid)
    while engine.has_unfinished():
        engine.step()
    outputs = [engine.requests[rid].output_token_ids for rid in prompts]
    right = sum(a == b for out in outputs for a, b in zip(out, out[1:]))
    stats = engine.stats_dict()
    assert stats["draft_tokens"] == sum(len(out) - 1 for out in outputs) == 87
    assert stats["draft_tokens_right"] == right > 0 and stats["draft_accuracy"] == right / 87


def check_resident_blocks_equal_host(engine: LLMEngine) -> None:
    ws, host, gpu, bs = engine.policy.ws, engine.host.kv, engine.pool.kv, engine.block_size
    for rid, req in engine.requests.items():
        if req.finished:
            continue
        full = req.num_computed_tokens // bs
        row = ws.row(rid)
        for layer in range(gpu.shape[0]):
            for j in range(full):
                slot = ws.slot_of[layer, row, j].item()
                if slot >= 0:
                    assert torch.equal(gpu[layer, slot], host[layer, req.block_ids[j]]), (rid, layer, j)


@pytest.mark.parametrize("kv, message", [
    (dict(fetch_cap=0.01), "less than one block"),
    (dict(fetch_cap=1.5), "--fetch-cap must be in"),
    (dict(draft="ngram", draft_model="/some/head"), "--draft-model needs --draft eagle3"),
    (dict(draft="psychic"), "--draft must be one of"),
    (dict(miss_policy="pray"), "--miss-policy"),
])
def test_impossible_oasis_configuration_is_a_clear_error(kv, message):
    with pytest.raises(ValueError, match=message):
        KVConfig(mode="oasis", budget=512, **kv).validate(16, 30)


@pytest.mark.parametrize("budget, cap", [(256, 0.05), (128, 0.1), (512, 0.01), (96, 0.125)])
def test_a_cap_under_one_block_names_the_cap_and_the_budget_that_work(budget, cap):
    with pytest.raises(ValueError, match="less than one block") as err:
        KVConfig(mode="oasis", budget=budget, fetch_cap=cap).validate(16, 30)
    suggested = re.search(r"raise the cap to (\S+) or more, or the budget to (\d+)", str(err.value))
    least_cap, least_budget = suggested.groups()
    KVConfig(mode="oasis", budget=budget, fetch_cap=float(least_cap)).validate(16, 30)
    KVConfig(mode="oasis", budget=int(least_budget), fetch_cap=cap).validate(16, 30)
    with pytest.raises(ValueError, match="less than one block"):  # the least: a block less fails
        KVConfig(mode="oasis", budget=int(least_budget) - 16, fetch_cap=cap).validate(16, 30)


@pytest.mark.parametrize("mode", ["dense", "oasis"])
def test_prefill_first_schedule_gives_the_tokens_of_the_mixed_schedule(tmp_path, mode):
    """Requests arrive while others decode: prefill-first makes the decodes wait instead of sharing steps
    with the prefills, and each request's greedy tokens stay the same."""
    outputs, mixed_steps = {}, {}
    for policy in ("mixed", "prefill-first"):
        engine = tiny_engine(tmp_path, mode, **({"fetch_cap": 0.25, "draft": "ngram"} if mode == "oasis" else {}))
        engine.scheduler.cfg = dataclasses.replace(engine.scheduler.cfg, schedule_policy=policy)
        schedule, mixed_steps[policy] = engine.scheduler.schedule, 0

        def recording():
            out = schedule()
            sizes = {len(c.token_ids) > 1 for c in out.chunks}
            mixed_steps[policy] += sizes == {True, False}  # decodes and prefill chunks in one step
            return out

        engine.scheduler.schedule = recording
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 256, (100 + 30 * i,), generator=gen).tolist() for i in range(4)]
        for step in range(18):
            if step % 6 == 0:
                engine.add_request(prompts[step // 6], SP(temperature=0, max_tokens=20, ignore_eos=True),
                                   request_id=str(step // 6))
            engine.step()
        engine.add_request(prompts[3], SP(temperature=0, max_tokens=20, ignore_eos=True), request_id="3")
        while engine.has_unfinished():
            engine.step()
        outputs[policy] = {rid: r.output_token_ids for rid, r in engine.requests.items()}
    assert mixed_steps == {"mixed": 3, "prefill-first": 0}
    assert outputs["mixed"] == outputs["prefill-first"]
    assert sorted(outputs["mixed"]) == ["0", "1", "2", "3"] and all(len(t) == 20 for t in outputs["mixed"].values())


def test_prediction_deferred_after_the_step_changes_nothing(tmp_path):
    """A captured step leaves its last groups' prediction to a tail graph, queued right after the step's forward
    pass and before the sampling and releases. Run the same way eagerly (every group deferred, predicted once the
    forward pass has returned), oasis gives the tokens, counters and working sets of predicting in the step. The
    tail reads copies in TailBuffers, as on the GPU; the originals are spoiled before it runs."""
    runs = []
    for deferred in (False, True):
        engine = tiny_engine(tmp_path, fetch_cap=0.25, draft="ngram")
        policy, execute, deferred_groups = engine.policy, engine.runner.execute, []
        assert policy.tail_from == 0 and policy.first_deferred == 0  # 3 layers: every group is in the tail
        begin_step = policy.begin_step

        def begin_then_defer(meta, begin_step=begin_step):
            begin_step(meta)
            policy.deferring = deferred  # as begin_capture does in a capture

        def forward_then_tail(plan, pending=None, execute=execute):
            result = execute(plan, pending)
            groups = policy.deferred
            deferred_groups.extend(groups)
            if groups:
                with torch.inference_mode():  # as the runner's forward pass
                    originals = policy.predict_inputs(policy.rows_now)
                    scores = [s for group in groups for _, s in group]
                    policy.end_capture()  # the step graph's end: what the tail reads, into its buffers
                    for t in (originals.rows, originals.host_tables, originals.nblocks, originals.step, *scores):
                        t.fill_(-7)  # what the next step (or another graph) would write there
                    kept, policy.tail_inputs, policy.deferred = policy.tail_inputs, None, []
                    policy.predict_deferred(groups, *kept)
            policy.deferring = False
            return result

        policy.begin_step = begin_then_defer
        engine.runner.execute = forward_then_tail
        run_random_requests(engine, seed=2, lengths=(120, 170, 220), max_tokens=60)
        assert (len(deferred_groups) > 100) == deferred
        stats = {k: v for k, v in engine.stats_dict().items() if k.startswith("kv_") and "time" not in k}
        runs.append(({rid: r.output_token_ids for rid, r in engine.requests.items()}, stats,
                     policy.ws.block_of.clone(), policy.predicted.clone()))
    (tokens, stats, blocks, predicted), (tokens_d, stats_d, blocks_d, predicted_d) = runs
    assert tokens == tokens_d and stats == stats_d and stats["kv_prefetched_blocks"] > 50
    assert torch.equal(blocks, blocks_d) and torch.equal(predicted, predicted_d)


def test_device_ngram_drafts_are_the_host_ngram_drafts(tmp_path):
    """--draft ngram drafts inside each step on the device (lookahead/device_ngram.py). The same run with the host's
    NgramDraft gives the same draft in every decode step, so the same tokens, prefetches and counts. Prompts of a
    4-token vocabulary, sampled: the lookup finds matches of every length, and the drafts steer the prefetch."""
    gen = torch.Generator().manual_seed(11)
    prompts = {str(i): torch.randint(0, 4, (60 + 45 * i,), generator=gen).tolist() for i in range(4)}
    runs = []
    for host in (False, True):
        engine = tiny_engine(tmp_path, fetch_cap=0.25, draft="ngram")
        assert engine.drafter.on_device and engine.runner.fill_inputs is not None
        if host:
            engine.drafter = NgramDraft()
            assert engine.runner.fill_inputs is None
        drafts = record_drafts(engine)
        for rid, ids in prompts.items():
            engine.add_request(ids, SP(temperature=1.0, top_k=4, seed=int(rid), max_tokens=40, ignore_eos=True),
                               request_id=rid)
        while engine.has_unfinished():
            engine.step()
        stats = engine.stats_dict()
        counts = {k: v for k, v in stats.items() if k.startswith(("kv_", "draft_")) and "time" not in k}
        runs.append(({rid: engine.requests[rid].output_token_ids for rid in prompts}, drafts, counts))
    (tokens, drafts, counts), host_run = runs
    assert len(drafts) == sum(len(t) - 1 for t in tokens.values()) == 156  # every decode step had a draft
    assert drafts == host_run[1] and tokens == host_run[0] and counts == host_run[2]
    assert 0 < counts["draft_tokens_right"] < counts["draft_tokens"]


def record_drafts(engine: LLMEngine) -> dict[tuple[str, int], int]:
    """(request, position of the draft) -> the draft token that ran there, as the runner's inputs held it."""
    drafts, execute = {}, engine.runner.execute

    def run(plan, pending=None):
        result = execute(plan, pending)
        decodes = [c for c in result.chunks if len(c.token_ids) == 1]
        ran = result.draft_ids.tolist() if result.draft_ids is not None else [c.draft_token_id for c in decodes]
        for c, d in zip(decodes, ran):
            drafts[c.request_id, c.start + 1] = c.token_ids[0] if d is None else d
        return result

    engine.runner.execute = run
    return drafts


def test_a_layers_first_sparse_step_judges_no_agreement():
    """A layer attends densely while its budget covers the context and predicts nothing then; the first step where
    the context outgrows the budget judged x_t's selection against that missing prediction (0 of every block)."""
    budget = SPARSE["kv_budget"]  # 4 blocks of 16: sparse once a decode row's context reaches a fifth block
    llm = LLM(show_progress=False, kv_mode="oasis", fetch_cap=1.0, **SPARSE)
    engine, policy = llm.engine, llm.engine.policy
    column = policy.counter_index["agree_total"]
    engine.add_request(list(range(3, 53)), GREEDY, request_id="0")  # 50 tokens: dense steps first
    judged = {}
    while engine.has_unfinished():
        before = int(policy.row_counts[0, :, column].sum())
        engine.step()
        length = engine.requests["0"].num_computed_tokens  # the context x_t attended to in this step
        if not engine.requests["0"].finished:
            judged[length] = int(policy.row_counts[0, :, column].sum()) - before
    assert all(judged[n] == 0 for n in judged if n <= budget + 1)  # dense steps, then the first sparse one
    assert all(judged[n] > 0 for n in judged if n > budget + 1)


@pytest.mark.parametrize("shortlist", [0.0, 2.0])
@pytest.mark.parametrize("mode", ["quest", "retrieval", "oasis"])
def test_only_layers_that_select_count_selected_blocks(tmp_path, mode, shortlist):
    """A layer whose budget covers the step's context attends to every block and selects none: retrieval and oasis
    counted its blocks as selected (and as hits once resident), quest never did, so on short contexts their hit rates
    leaned high and the modes' counts differed. With a list (--shortlist 2) retrieval counted the whole list, oasis the
    final selection; now both count the selection. Counted here by hand from each decode step's context lengths."""
    budgets = [6, 3, 3]  # blocks per layer: layer 0 weighs 2 of the 3 layers x 4 blocks of --kv-budget 64
    engine = tiny_engine(tmp_path, mode, layer_weights=((0, 2.0),), shortlist=shortlist,
                         **({"fetch_cap": 0.5} if mode == "oasis" else {}))
    assert engine.policy.layer_budget_blocks == budgets
    lengths, begin = [], engine.policy.begin_step

    def recording(meta):
        lengths.append(meta.decode_seq_lens_host or [])
        begin(meta)

    engine.policy.begin_step = recording
    run_random_requests(engine, seed=2, lengths=(20, 50), max_tokens=60)  # 80 and 110 tokens at the end
    blocks = [[-(-n // engine.block_size) for n in step] for step in lengths if step]
    selected = sum(min(n, budget) for step in blocks for budget in budgets if max(step) > budget for n in step)
    stats = engine.stats_dict()
    assert 0 < selected < sum(map(sum, blocks)) * len(budgets)  # dense steps and layers, and sparse ones
    assert stats["kv_selected_blocks"] == selected
    if mode != "quest":
        assert stats["kv_hits"] + stats["kv_misses"] == selected


def test_the_fetch_cap_is_a_share_of_each_layers_own_budget(tmp_path):
    """--fetch-cap x the layer's budget (DESIGN.md's definition): with --layer-weights every layer was capped at
    --fetch-cap x --kv-budget, so a heavier layer could not prefetch its share even at fetch-all and a lighter one
    prefetched more than its share (found by a helper's audit of the statistics). Weights 2, 1, 1 of a 64-token
    budget over 3 layers: budgets of 96, 48 and 48 tokens; at cap 0.5, 3 blocks for layer 0 and 1 for the others."""
    engine = tiny_engine(tmp_path, fetch_cap=0.5, draft="ngram", layer_weights=((0, 2.0),))
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        engine.add_request(torch.randint(0, 256, (200 + 40 * i,), generator=gen).tolist(),
                           SP(temperature=0.8, seed=i, max_tokens=120, ignore_eos=True), request_id=str(i))
    engine.step()  # prefill
    most = {0: 0, 1: 0, 2: 0}  # blocks a layer added to a request's working set in one step, at most
    while engine.has_unfinished():
        before = resident(engine)
        engine.step()
        for (rid, layer), now in resident(engine).items():
            req = engine.requests[rid]
            opened = {req.num_computed_tokens // engine.block_size, (req.num_computed_tokens - 1) // engine.block_size}
            if before.get((rid, layer)):  # not the cold start right after the prefill
                most[layer] = max(most[layer], len(now - before[(rid, layer)] - opened))
    assert most == {0: 3, 1: 1, 2: 1}
    assert engine.stats_dict()["kv_fetch_cap_blocks"] == 3
