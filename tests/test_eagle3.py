"""EAGLE-3 heads: both checkpoint layouts load, and the head and the draft source compute what an
independent plain-torch reading of ../shared/reference/eagle3.md §2 computes."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from oasiskv.lookahead.base import DraftChunk
from oasiskv.lookahead.eagle3 import Eagle3Draft
from oasiskv.models.eagle3 import load_eagle3
from oasiskv.models.loader import load_model
from oasiskv.policies.dense import causal_attention

VOCAB, TARGET_HIDDEN, TARGET_LAYERS = 300, 64, 8
SEQ = 29

# name: (architecture, weights file, own embedding, draft hidden, draft vocab, rope_theta, aux ids,
#        norm_before_residual)
LAYOUTS = {
    "eagle": ("LlamaForCausalLMEagle3", "model.safetensors", False, 64, 40, 5000.0, None, False),
    "eagle-bin-own-embed": ("Eagle3LlamaForCausalLM", "pytorch_model.bin", True, 48, 64, None, [1, 4, 7], False),
    "speculators-sharded": ("Eagle3Speculator", "sharded", False, 64, 56, None, [2, 3, 6], True),
    # the draft as wide as the 3 target features: whether to fuse them cannot be read from the input's width
    "eagle-3x-wide-own-embed": ("LlamaForCausalLMEagle3", "model.safetensors", True, 3 * 64, 40, None, None, False),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: a second thread only adds synchronisation (and stalls on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the target ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama, in transformers (for hidden_states) and ours (loaded from its directory)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=TARGET_HIDDEN, intermediate_size=112,
                      num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, rope_theta=1e5, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("target")
    hf.save_pretrained(path, safe_serialization=True)
    ours = load_model(str(path), "auto", torch.device("cpu"), torch.float32, show_progress=False).model
    return hf, ours


def hf_hidden_states(hf, ids: list[int]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [h[0] for h in hf(torch.tensor([ids]), output_hidden_states=True).hidden_states]


class Causal:
    def attend(self, layer, q, k, v):
        return causal_attention(q, k, v, q.shape[-1] ** -0.5)


# -- writing heads ------------------------------------------------------------------------------------


def head_config(layout: str) -> dict:
    arch, _, _, hidden, draft_vocab, theta, ids, nbr = LAYOUTS[layout]
    layer = dict(model_type="llama", hidden_size=hidden, intermediate_size=96, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-5,
                 vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False)
    if theta is not None:
        layer["rope_theta"] = theta
    extra = {"draft_vocab_size": draft_vocab, "target_hidden_size": TARGET_HIDDEN, "norm_before_residual": nbr}
    if arch == "Eagle3Speculator":
        return {"architectures": [arch], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
                "eagle_aux_hidden_state_layer_ids": ids, **extra}
    eagle = {} if ids is None else {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}
    return {"architectures": [arch], **layer, **extra, **eagle}


def random_weights(layout: str, seed: int) -> dict[str, torch.Tensor]:
    """Canonical (EAGLE) names. Norm weights are not 1 so that a missed norm shows."""
    _, _, own_embed, h, dv, _, _, _ = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    heads, kv, d, inter = 4, 2, h // 4, 96

    def rnd(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    w = {"fc.weight": rnd(h, 3 * TARGET_HIDDEN), "midlayer.self_attn.q_proj.weight": rnd(heads * d, 2 * h),
         "midlayer.self_attn.k_proj.weight": rnd(kv * d, 2 * h), "midlayer.self_attn.v_proj.weight": rnd(kv * d, 2 * h),
         "midlayer.self_attn.o_proj.weight": rnd(h, heads * d), "midlayer.mlp.gate_proj.weight": rnd(inter, h),
         "midlayer.mlp.up_proj.weight": rnd(inter, h), "midlayer.mlp.down_proj.weight": rnd(h, inter),
         "lm_head.weight": rnd(dv, h, scale=1.0)}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        w[name + ".weight"] = 1 + rnd(h, scale=0.3)
    if own_embed:
        w["embed_tokens.weight"] = rnd(VOCAB, h, scale=1.0)
    vocab_ids = torch.randperm(VOCAB, generator=g)[:dv].sort().values
    w["d2t"] = vocab_ids - torch.arange(dv)
    w["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, vocab_ids, True)
    return w


def write_head(path, layout: str, weights: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(head_config(layout)))
    arch, fmt = LAYOUTS[layout][:2]
    if arch == "Eagle3Speculator":
        weights = {n.replace("midlayer.", "layers.0."): t for n, t in weights.items()}
        weights["verifier_lm_head.weight"] = torch.zeros(VOCAB, TARGET_HIDDEN)  # present in training exports
    if fmt == "pytorch_model.bin":
        torch.save(weights, path / fmt)
    elif fmt == "sharded":
        names = sorted(weights)
        save_file({n: weights[n] for n in names[::2]}, str(path / "model-00001-of-00002.safetensors"))
        save_file({n: weights[n] for n in names[1::2]}, str(path / "model-00002-of-00002.safetensors"))
    else:
        save_file(weights, str(path / fmt))


# -- the reference ------------------------------------------------------------------------------------


def rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, theta):
    """x [T, heads, D] at positions 0..T-1, rotate-half convention."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = (torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv[None]).float()
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1)[:, None], torch.cat((ang.sin(), ang.sin()), -1)[:, None]
    return x * cos + torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1) * sin


def reference_logits(layout, w, hidden_states, next_ids, target_embed) -> torch.Tensor:
    """Draft logits at every slot of one sequence, one shot: slot t reads (embed(x_{t+1}), fc(g_t))."""
    _, _, own_embed, h, _, theta, ids, nbr = LAYOUTS[layout]
    ids = ids or [2, TARGET_LAYERS // 2, TARGET_LAYERS - 3]
    theta = theta or 10000.0
    m = lambda name: w["midlayer." + name + ".weight"]  # noqa: E731
    g = torch.cat([hidden_states[i] for i in ids], -1) @ w["fc.weight"].T
    e = (w["embed_tokens.weight"] if own_embed else target_embed)[torch.tensor(next_ids)]
    b = rms(g, m("hidden_norm"))
    x = torch.cat((rms(e, m("input_layernorm")), b), -1)
    t, d = x.shape[0], h // 4
    q = rope((x @ m("self_attn.q_proj").T).view(t, 4, d), theta)
    k = rope((x @ m("self_attn.k_proj").T).view(t, 2, d), theta).repeat_interleave(2, dim=1)
    v = (x @ m("self_attn.v_proj").T).view(t, 2, d).repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, 4 * d)
    out = (b if nbr else g) + attn @ m("self_attn.o_proj").T
    y = rms(out, m("post_attention_layernorm"))
    out = out + (F.silu(y @ m("mlp.gate_proj").T) * (y @ m("mlp.up_proj").T)) @ m("mlp.down_proj").T
    return rms(out, w["norm.weight"]) @ w["lm_head.weight"].T


def target_id(w, draft_id: int) -> int:
    return int(torch.nonzero(w["t2d"]).flatten()[draft_id])  # the draft vocabulary is the sorted member ids


# -- tests --------------------------------------------------------------------------------------------


def sequence(seed: int, n: int = SEQ) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_head_logits_match_reference(target, tmp_path, layout):
    hf, ours = target
    w = random_weights(layout, seed=1)
    write_head(tmp_path, layout, w)
    head = load_eagle3(str(tmp_path), ours)
    ids = sequence(2)
    hs = hf_hidden_states(hf, ids)
    next_ids = ids[1:] + [7]
    ref = reference_logits(layout, w, hs, next_ids, ours.model.embed_tokens.weight)
    features = torch.cat([hs[i + 1] for i in head.capture_layers], -1)  # our ids -> HF indices
    with torch.no_grad():
        got = head.logits(head(torch.tensor(next_ids), features, torch.arange(len(ids)), Causal()))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_embedding_shared_not_copied_when_absent(target, tmp_path):
    _, ours = target
    write_head(tmp_path, "eagle", random_weights("eagle", seed=3))
    head = load_eagle3(str(tmp_path), ours)
    assert head.embed_tokens is None
    assert head.target_embedding.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    assert not any(p.data_ptr() == ours.model.embed_tokens.weight.data_ptr() for p in head.parameters())


def test_capture_convention(target, tmp_path):
    _, ours = target
    write_head(tmp_path / "default", "eagle", random_weights("eagle", seed=4))
    write_head(tmp_path / "explicit", "speculators-sharded", random_weights("speculators-sharded", seed=4))
    assert load_eagle3(str(tmp_path / "default"), ours).capture_layers == (1, 3, 4)  # HF 2, L//2, L-3
    assert load_eagle3(str(tmp_path / "explicit"), ours).capture_layers == (1, 2, 5)  # HF 2, 3, 6


def run_draft(draft: Eagle3Draft, ours, requests: dict[str, tuple[list[int], list[int]]]) -> dict[str, list[int]]:
    """Drives the draft source as the engine would: requests[rid] = (token ids, chunk sizes); the rest
    of each sequence after the chunks is decoded one token per step, all requests in the same steps.
    Returns the drafts proposed for each request after each of its sampled chunks."""
    captured = {}
    for rid, (ids, _) in requests.items():
        with torch.no_grad():
            captured[rid] = ours(torch.tensor(ids), torch.arange(len(ids)), Causal(), draft.capture_layers)[1]
    plans = {rid: sizes + [1] * (len(ids) - 1 - sum(sizes)) for rid, (ids, sizes) in requests.items()}
    drafts, starts = {rid: [] for rid in requests}, dict.fromkeys(requests, 0)
    for step in range(max(len(p) for p in plans.values())):
        chunks, rows, row_start = [], [], 0
        for rid, (ids, sizes) in requests.items():
            if step >= len(plans[rid]):
                continue
            s, n = starts[rid], plans[rid][step]
            sampled = s + n >= sum(sizes)  # the prompt's last chunk samples, and every decode
            chunks.append(DraftChunk(rid, s, ids[s:s + n], ids[s + 1:s + n + 1], row_start, sampled, ids[:s + n + 1]))
            row_start += n
            rows.append([h[s:s + n] for h in captured[rid]])
            starts[rid] += n
        step_captured = [torch.cat([r[i] for r in rows]) for i in range(len(draft.capture_layers))]
        for rid, tok in draft.propose(chunks, step_captured).items():
            drafts[rid].append(tok)
    return drafts


def test_draft_over_chunks_equals_one_shot(target, tmp_path):
    hf, ours = target
    layout = "speculators-sharded"
    w = random_weights(layout, seed=5)
    write_head(tmp_path, layout, w)
    draft = Eagle3Draft.from_dir(str(tmp_path), ours)
    requests = {"a": (sequence(6, 40), [11, 9, 5]), "b": (sequence(7, 33), [20])}
    drafts = run_draft(draft, ours, requests)
    for rid, (ids, sizes) in requests.items():
        ref = reference_logits(layout, w, hf_hidden_states(hf, ids[:-1]), ids[1:], ours.model.embed_tokens.weight)
        expected = [target_id(w, int(d)) for d in ref[sum(sizes) - 1:].argmax(-1)]
        assert drafts[rid] == expected
    assert all(draft.caches[rid].length == len(ids) - 1 for rid, (ids, _) in requests.items())


def test_draft_restart_and_continuity_errors(target, tmp_path):
    _, ours = target
    write_head(tmp_path, "eagle", random_weights("eagle", seed=8))
    draft = Eagle3Draft.from_dir(str(tmp_path), ours, torch.device("cpu"), torch.float32)
    ids = sequence(9, 12)
    requests = {"r": (ids, [6])}
    first = run_draft(draft, ours, requests)
    assert run_draft(draft, ours, requests) == first  # start 0 again: a recompute resets the cache
    draft.release("r")
    assert "r" not in draft.caches
    h = [torch.zeros(1, TARGET_HIDDEN)] * 3
    with pytest.raises(ValueError, match="position 5 .* holds 0"):
        draft.propose([DraftChunk("r", 5, [1], [2], 0, True, [1] * 7)], h)


def test_errors_are_clear(target, tmp_path):
    _, ours = target
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_eagle3(str(tmp_path / "nowhere"), ours)
    w = random_weights("eagle", seed=10)
    cfg = head_config("eagle")
    write_head(tmp_path, "eagle", w)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "target_hidden_size": 96}))
    with pytest.raises(ValueError, match="target hidden size 96, the target has 64"):
        load_eagle3(str(tmp_path), ours)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 80}))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight: checkpoint shape"):
        load_eagle3(str(tmp_path), ours)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "norm_before_fc": True}))
    with pytest.raises(ValueError, match="norm_before_fc"):
        load_eagle3(str(tmp_path), ours)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        load_eagle3(str(tmp_path), ours)


def test_an_input_of_the_wrong_width_is_refused(target, tmp_path):
    _, ours = target
    write_head(tmp_path, "eagle", random_weights("eagle", seed=12))
    head = load_eagle3(str(tmp_path), ours)
    ids, positions = torch.tensor([1, 2]), torch.arange(2)
    with pytest.raises(ValueError, match="width 64; 3 target features should be 192 wide"):
        head(ids, torch.zeros(2, TARGET_HIDDEN), positions, Causal())
    with pytest.raises(ValueError, match="width 192; its own output should be 64 wide"):
        head(ids, torch.zeros(2, 3 * TARGET_HIDDEN), positions, Causal(), fed_back=True)


def broken_head(path, what: str) -> None:
    """A head broken in one way: its files, its d2t or its weights."""
    w, cfg = random_weights("eagle", seed=11), head_config("eagle")
    if what == "d2t past the vocabulary":
        w["d2t"] = w["d2t"] + VOCAB
    elif what == "float d2t":
        w["d2t"] = w["d2t"].float()
    elif what == "NaN weights":
        w["fc.weight"][0, 0] = float("nan")
    write_head(path, "eagle", w)
    if what == "draft vocabulary above the target's":
        (path / "config.json").write_text(json.dumps({**cfg, "draft_vocab_size": VOCAB + 1}))
    elif what == "config not JSON":
        (path / "config.json").write_text("{not json")
    elif what == "config a list":
        (path / "config.json").write_text("[1, 2]")
    elif what == "truncated weights":
        with open(path / "model.safetensors", "r+b") as f:
            f.truncate(2000)


@pytest.mark.parametrize("what, message", [
    ("d2t past the vocabulary", "d2t maps draft ids to target ids in .* outside the target vocabulary"),
    ("float d2t", "d2t must hold integer offsets"),
    ("NaN weights", "fc.weight holds NaN or infinite values"),
    ("draft vocabulary above the target's", "draft_vocab_size .* must be in \\[1, the target's"),
    ("config not JSON", "config.json cannot be read as JSON"),
    ("config a list", "config.json must hold a JSON object, got list"),
    ("truncated weights", "model.safetensors cannot be read"),
])
def test_a_broken_head_is_refused_at_load(target, tmp_path, what, message):
    """Each loaded before and failed later (d2t past the vocabulary: an IndexError in the next step's embedding), or
    failed with a traceback; found by a helper's audit of the drafts."""
    _, ours = target
    broken_head(tmp_path, what)
    with pytest.raises(ValueError, match=message):
        load_eagle3(str(tmp_path), ours)
