"""CPU tests for the sampler and SamplingParams validation, against brute-force references."""
import dataclasses
import math
import random

import pytest
import torch

from oasiskv.config import SamplingParams
from oasiskv.engine.sampler import Sampler, apply_top_k_top_p, sample_row

CPU = torch.device("cpu")


# ---------------------------------------------------------------- brute-force references
def ref_kept(logits, top_k, top_p):
    """Set of kept token ids, and the smallest distance between a prefix mass and top_p.

    Sort descending; keep the first k (all if k == -1 or k >= V); renormalise over them and keep the
    smallest prefix whose mass reaches top_p (all of them when top_p == 1). The top token is always kept.
    """
    vals = [float(x) for x in logits]
    order = sorted(range(len(vals)), key=lambda i: -vals[i])
    if top_k != -1:
        order = order[:top_k]
    if top_p >= 1.0:
        return set(order), math.inf
    m = max(vals[i] for i in order)
    w = [math.exp(vals[i] - m) for i in order]
    z = sum(w)
    kept, mass, margin = [], 0.0, math.inf
    for i, wi in zip(order, w):
        kept.append(i)
        mass += wi / z
        margin = min(margin, abs(mass - top_p))
        if mass >= top_p:
            break
    return set(kept), margin


def ref_probs(logits, temperature, top_k, top_p):
    """softmax(logits / T) restricted to the top-k / top-p set (computed on the scaled logits)."""
    scaled = [float(x) / temperature for x in logits]
    kept, margin = ref_kept(scaled, top_k, top_p)
    m = max(scaled[i] for i in kept)
    w = {i: math.exp(scaled[i] - m) for i in kept}
    z = sum(w.values())
    return [w.get(i, 0.0) / z for i in range(len(scaled))], margin


def chi2_critical(df, z=4.753):
    """Wilson-Hilferty upper quantile of chi-square(df); z=4.753 is the 1e-6 normal tail."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# ---------------------------------------------------------------- greedy / temperature 0
def test_greedy_params():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy  # below vLLM's 1e-5, as vLLM and SGLang take it
    assert not SamplingParams(temperature=1e-5).greedy
    assert not SamplingParams().greedy


def test_a_temperature_below_1e_5_takes_the_first_of_tied_maxima_and_draws_nothing():
    logits = torch.tensor([0.0, 5.0, 1.0, 5.0, 5.0])  # argmax's first of the ties: index 1
    s = Sampler(CPU, seed=0)
    for seed in range(12):
        params = SamplingParams(temperature=9e-6, seed=seed)
        assert sample_row(logits, params, torch.Generator().manual_seed(seed)) == 1
        assert s.sample(logits[None], [f"r{seed}"], [params]) == [1]
    assert not s.generators  # no generator was made: greedy rows draw nothing


@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 1e-300])
def test_a_vanishing_temperature_samples_the_argmax(temperature):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1000, generator=g) * 3
        assert sample_row(logits, SamplingParams(temperature=temperature), g) == int(logits.argmax())


def test_greedy_sample_row_is_argmax_and_ignores_top_k_top_p():
    g = torch.Generator().manual_seed(0)
    for i in range(50):
        v = 1 + i * 7
        logits = torch.randn(v, generator=g) * 3
        want = max(range(v), key=lambda j: float(logits[j]))
        for p in (SamplingParams(temperature=0), SamplingParams(temperature=0, top_k=1, top_p=0.1),
                  SamplingParams(temperature=0, top_k=3, top_p=0.5, seed=5)):
            assert sample_row(logits, p, None) == want


def test_greedy_batch_is_argmax_and_draws_no_randomness():
    s = Sampler(CPU, seed=3)
    logits = torch.randn(7, 100, generator=torch.Generator().manual_seed(1))
    p0 = SamplingParams(temperature=0)
    ids = [f"r{i}" for i in range(7)]
    out = s.sample(logits, ids, [p0] * 7)
    assert out == [int(logits[i].argmax()) for i in range(7)]
    assert all(isinstance(t, int) for t in out)
    assert s.generators == {}  # no generator made, none drawn from
    # a mixed batch: greedy rows are argmax, and do not consume the generator the others use
    pt = SamplingParams(temperature=1.0)
    mixed = s.sample(logits[:3], ids[:3], [p0, pt, p0])
    assert mixed[0] == int(logits[0].argmax()) and mixed[2] == int(logits[2].argmax())
    ref = Sampler(CPU, seed=3)
    assert mixed[1] == ref.sample(logits[1:2], ids[1:2], [pt])[0]


def test_tiny_top_p_draws_the_top_token():
    logits = torch.tensor([0.0, 1.0, 3.0, 2.0, -1.0])
    g = torch.Generator().manual_seed(0)
    assert all(sample_row(logits, SamplingParams(top_p=1e-300), g) == 2 for _ in range(50))


def test_small_temperature_concentrates_on_argmax():
    logits = torch.tensor([0.0, 1.0, 3.0, 2.0, -1.0])
    g = torch.Generator().manual_seed(0)
    p = SamplingParams(temperature=0.01)
    assert all(sample_row(logits, p, g) == 2 for _ in range(200))


# ---------------------------------------------------------------- top-k / top-p
def _check_against_ref(logits, k, p):
    got = apply_top_k_top_p(logits, k, p)
    kept, margin = ref_kept(logits.tolist(), k, p)
    if margin < 1e-4:
        return False  # fp32 cumsum vs float64 reference can disagree right at the boundary
    finite = torch.isfinite(got)
    assert set(torch.nonzero(finite).flatten().tolist()) == kept, (logits, k, p)
    assert torch.equal(got[finite], logits[finite])
    assert torch.all(got[~finite] == float("-inf"))
    return True


def test_top_k_top_p_against_brute_force():
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(1500):
        v = rng.randint(1, 40)
        logits = torch.randn(v, generator=g) * rng.choice([0.3, 1.0, 3.0, 8.0])
        k = rng.choice([-1, 1, 2, rng.randint(1, v), v, v + 3])
        p = rng.choice([1.0, rng.uniform(1e-4, 1.0), rng.uniform(0.8, 0.999), rng.uniform(1e-6, 0.2)])
        before = logits.clone()
        checked += _check_against_ref(logits, k, p)
        assert torch.equal(logits, before)  # not modified in place
    assert checked > 1400


def test_top_k_top_p_exact_cases():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # ranks: 1, 3, 2, 0
    logits = probs.log()

    def kept(k, p):
        return torch.nonzero(torch.isfinite(apply_top_k_top_p(logits, k, p))).flatten().tolist()

    assert kept(-1, 1.0) == [0, 1, 2, 3]
    assert kept(1, 1.0) == [1]
    assert kept(2, 1.0) == [1, 3]
    assert kept(3, 1.0) == [1, 2, 3]
    assert kept(4, 1.0) == [0, 1, 2, 3]
    assert kept(10, 1.0) == [0, 1, 2, 3]
    assert kept(-1, 1e-6) == [1]  # the top token is always kept
    assert kept(-1, 1e-300) == [1]  # even where top_p is below fp32's smallest float (it compares as 0)
    assert kept(-1, 0.45) == [1]
    assert kept(-1, 0.55) == [1, 3]
    assert kept(-1, 0.79) == [1, 3]
    assert kept(-1, 0.81) == [1, 2, 3]
    assert kept(-1, 0.96) == [0, 1, 2, 3]
    # top-p applies to the distribution renormalised over the top-k survivors:
    # over {0.5, 0.3, 0.15} the masses are 0.526, 0.842, 1.0
    assert kept(3, 0.80) == [1, 3]
    assert kept(3, 0.86) == [1, 2, 3]
    assert kept(2, 0.5) == [1]
    assert kept(2, 0.7) == [1, 3]


def test_top_k_larger_than_vocab_or_off_is_identity():
    logits = torch.randn(9, generator=torch.Generator().manual_seed(4))
    assert torch.equal(apply_top_k_top_p(logits, -1, 1.0), logits)
    assert torch.equal(apply_top_k_top_p(logits, 9, 1.0), logits)
    assert torch.equal(apply_top_k_top_p(logits, 50, 1.0), logits)


# ---------------------------------------------------------------- seeded reproducibility
def _run(sampler, schedule):
    """schedule: list of steps, each a list of (request_id, params, logits_row). Returns tokens by id."""
    got = {}
    for rows in schedule:
        ids = [r[0] for r in rows]
        toks = sampler.sample(torch.stack([r[2] for r in rows]), ids, [r[1] for r in rows])
        for rid, t in zip(ids, toks):
            got.setdefault(rid, []).append(t)
    return got


def test_seeded_request_is_independent_of_batch():
    v, steps = 64, 30
    g = torch.Generator().manual_seed(11)
    mine = [torch.randn(v, generator=g) for _ in range(steps)]
    ps = SamplingParams(temperature=1.0, seed=1234)
    pk = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    alone = _run(Sampler(CPU, seed=0), [[("s", ps, mine[t]), ("k", pk, mine[t])] for t in range(steps)])

    rng = random.Random(5)
    others = [("u1", SamplingParams(temperature=1.0)), ("u2", SamplingParams(temperature=0.5, top_k=5)),
              ("t", SamplingParams(temperature=1.0, seed=7)), ("gr", SamplingParams(temperature=0))]
    sched = []
    for t in range(steps):
        rows = [("s", ps, mine[t]), ("k", pk, mine[t])]
        rows += [(rid, p, torch.randn(v, generator=g)) for rid, p in rng.sample(others, rng.randint(0, 4))]
        rng.shuffle(rows)
        sched.append(rows)
    crowded = _run(Sampler(CPU, seed=99), sched)
    assert crowded["s"] == alone["s"]
    assert crowded["k"] == alone["k"]
    # each request has its own generator: same seed, same logits, same params -> same draws
    twin = _run(Sampler(CPU, seed=0), [[("a", ps, mine[t]), ("b", ps, mine[t])] for t in range(steps)])
    assert twin["a"] == twin["b"] == alone["s"]
    # a different seed gives a different sequence
    other = _run(Sampler(CPU, seed=0), [[("s", dataclasses.replace(ps, seed=1235), mine[t])] for t in range(steps)])
    assert other["s"] != alone["s"]
    # forget() drops the generator: the same id restarts its sequence
    s = Sampler(CPU, seed=0)
    first = _run(s, [[("s", ps, mine[t])] for t in range(steps)])
    s.forget("s")
    s.forget("never-seen")
    again = _run(s, [[("s", ps, mine[t])] for t in range(steps)])
    assert first["s"] == again["s"] == alone["s"]


def test_an_unseeded_request_draws_alike_beside_any_other():
    """Each request has its own generator: the draws of "a" do not depend on whether "b" sampled beside it (async
    scheduling's extra step for a request that stopped drew from a shared generator and moved the others')."""
    rows = torch.randn(10, 2, 32, generator=torch.Generator().manual_seed(5))
    p = SamplingParams(temperature=1.0)
    alone, beside = Sampler(CPU, seed=1), Sampler(CPU, seed=1)
    a_alone = [alone.sample(r[:1], ["a"], [p])[0] for r in rows]
    beside.sample(rows[0, :1], ["a"], [p])  # "a" gets its generator first in both, as in the engine's plan order
    a_beside = [a_alone[0]] + [beside.sample(r, ["a", "b"], [p, p])[0] for r in rows[1:]]
    assert a_beside == a_alone


def test_unseeded_sampling_reproducible_from_sampler_seed():
    v = 32
    g = torch.Generator().manual_seed(2)
    rows = [torch.randn(3, v, generator=g) for _ in range(20)]
    p = [SamplingParams(temperature=1.0), SamplingParams(top_k=4), SamplingParams(top_p=0.7)]

    def run(seed):
        s = Sampler(CPU, seed=seed)
        return [s.sample(r, ["a", "b", "c"], p) for r in rows]

    assert run(7) == run(7)
    assert run(7) != run(8)


# ---------------------------------------------------------------- empirical distribution
DIST_LOGITS = torch.tensor([1.2, -0.3, 0.5, 2.0, -1.5, 0.9, 0.1, -0.7])


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, -1, 1.0),
    (0.6, 5, 1.0),
    (1.7, -1, 0.8),
    (0.8, 6, 0.9),
])
def test_sample_row_distribution(temperature, top_k, top_p):
    n = 20000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    want, margin = ref_probs(DIST_LOGITS.tolist(), temperature, top_k, top_p)
    assert margin > 1e-3
    g = torch.Generator().manual_seed(12345)
    counts = [0] * len(want)
    for _ in range(n):
        counts[sample_row(DIST_LOGITS, params, g)] += 1
    kept = [i for i, w in enumerate(want) if w > 0]
    for i, w in enumerate(want):
        if w == 0:
            assert counts[i] == 0, f"token {i} is outside top-k/top-p but was drawn {counts[i]} times"
    if top_k != -1 or top_p < 1:
        assert len(kept) < len(want)  # the case really restricts something
    chi2 = sum((counts[i] - n * want[i]) ** 2 / (n * want[i]) for i in kept)
    assert chi2 < chi2_critical(len(kept) - 1), (counts, [round(n * w) for w in want], chi2)
    for i in kept:  # and no single bin is far off (5 sigma)
        sd = math.sqrt(n * want[i] * (1 - want[i]))
        assert abs(counts[i] - n * want[i]) < 5 * sd + 1


def test_sample_row_top_k_1_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g)
    p = SamplingParams(temperature=2.0, top_k=1)
    assert {sample_row(logits, p, g) for _ in range(200)} == {int(logits.argmax())}


# ---------------------------------------------------------------- SamplingParams validation
@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=0), dict(max_tokens=-3),
    dict(temperature=-0.01), dict(temperature=-1.0),
    dict(top_p=0.0), dict(top_p=-0.5), dict(top_p=1.0001), dict(top_p=2.0), dict(top_p=float("nan")),
    dict(top_k=-2), dict(top_k=-100), dict(stop=5), dict(stop=["a", 3]), dict(max_tokens=2, min_tokens=3),
])
def test_sampling_params_rejects(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(max_tokens=1), dict(temperature=0.0), dict(temperature=5.0), dict(top_p=1.0),
    dict(top_p=1e-9), dict(top_k=-1), dict(top_k=1), dict(top_k=100000), dict(seed=0),
])
def test_sampling_params_accepts(kwargs):
    SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 1.0, 1.0, -1, None)
    assert p.stop is None and p.stop_token_ids is None and p.ignore_eos is False
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    # vLLM's spellings: top_k 0 is off, seed -1 is no seed, logprobs True is 1, max_tokens None is up to the limit
    assert SamplingParams(top_k=0).top_k == -1 and SamplingParams(seed=-1).seed is None
    assert SamplingParams(logprobs=True).logprobs == 1 and SamplingParams(max_tokens=None, min_tokens=5).min_tokens == 5
    with pytest.raises(TypeError):
        SamplingParams(4)  # vLLM's first field is n: keywords only, never a silent max_tokens
    assert SamplingParams(top_k=3).clone() == SamplingParams(top_k=3)
    # vLLM's fields at values that change nothing are taken; others refused by name
    taken = SamplingParams(n=2, best_of=2, seed=1, skip_special_tokens=True, detokenize=True, bad_words=[])
    assert taken.bad_words is None and SamplingParams(bad_words=["a b"]).bad_words == ("a b",)
    assert hash(taken) and [c.seed for c in taken.choices()] == [1, 2]
    for field, value in [("spaces_between_special_tokens", False), ("bad_words", "x"), ("best_of", 3),
                         ("skip_special_tokens", "no"), ("detokenize", 0),
                         ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", "ab"),
                         ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("truncate_prompt_tokens", 1.5)]:
        with pytest.raises(ValueError, match=f"{field}"):
            SamplingParams(**{field: value})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5
    # dataclasses.replace re-validates
    with pytest.raises(ValueError):
        dataclasses.replace(p, top_k=-2)


def test_allowed_token_ids_leave_the_other_tokens_out_of_every_draw():
    """vLLM's allowed_token_ids: greedy picks the best allowed token (a brute-force argmax over the allowed ids);
    a sampled row draws what the same generator draws from logits with every other token at -inf; the caller's
    logits (reported as logprobs) are not changed."""
    assert SamplingParams(allowed_token_ids=[4, 2]).allowed_token_ids == (4, 2) and hash(SamplingParams(
        allowed_token_ids=[4, 2]))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen)
    raw = logits.clone()
    allowed = [3, 17, 41, 8]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed),
              SamplingParams(temperature=0.9, top_p=0.8, seed=5, allowed_token_ids=allowed),
              SamplingParams(temperature=0)]
    tokens = Sampler(torch.device("cpu"), 0).sample(logits, ["a", "b", "c"], params)
    assert tokens[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert tokens[2] == int(logits[2].argmax())
    masked = torch.full_like(logits[1], float("-inf"))
    masked[allowed] = logits[1, allowed]
    assert tokens[1] == sample_row(masked, params[1], torch.Generator().manual_seed(5))
    assert torch.equal(logits, raw)
    for seed in range(30):  # (and no draw ever leaves the set)
        p = SamplingParams(temperature=1.5, seed=seed, allowed_token_ids=allowed)
        assert Sampler(torch.device("cpu"), 0).sample(logits[1:2], ["r"], [p])[0] in allowed


def test_sampling_on_the_device_draws_what_sample_draws():
    """sample_on_device (async scheduling) returns a tensor without a sync; its draws are sample's: two samplers of
    one seed, one per path, over rows of every kind (greedy, seeded, the engine's generator)."""
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3, top_k=5),
              SamplingParams(temperature=1.2, top_p=0.7), SamplingParams(temperature=0.5, seed=9)]
    ids = ["a", "b", "c", "d"]
    host, device = Sampler(CPU, seed=1), Sampler(CPU, seed=1)
    for _ in range(5):
        logits = torch.randn(4, 50, generator=gen)
        drawn = device.sample_on_device(logits, ids, params)
        assert drawn.dtype == torch.long and drawn.shape == (4,)
        assert drawn.tolist() == host.sample(logits, ids, params)
