"""Lossless sampling: tree speculative sampling reproduces the target's distribution exactly."""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

import engine.verifier as verifier_mod
from drafting.dflash import random_dflash
from engine.engine import Engine, make_controller
from engine.sampling import SamplingParams, processed_probs
from reference import accept_greedy
from helpers import ShuffledMarginalsDrafter, tiny_target

PROMPT = [1, 5, 2, 7]
SAMPLES = 1500
PARAMS = dict(temperature=1.0, top_k=6)


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(vocab=8, seed=4, sharpen=10.0)


def exact_joint(target, params: SamplingParams) -> dict[tuple[int, int, int], float]:
    """P(x1, x2, x3 | PROMPT) under the processed target distribution, by enumeration."""
    model = target.model
    out = {}
    with torch.no_grad():
        p1 = processed_probs(model(torch.tensor([PROMPT])).logits[0, -1], params)
        for a in range(8):
            if p1[a] == 0:
                continue
            p2 = processed_probs(model(torch.tensor([PROMPT + [a]])).logits[0, -1], params)
            for b in range(8):
                if p2[b] == 0:
                    continue
                p3 = processed_probs(model(torch.tensor([PROMPT + [a, b]])).logits[0, -1], params)
                for c in range(8):
                    out[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return out


def sample_first3(engine: Engine, n: int) -> dict[tuple[int, int, int], int]:
    counts: dict = {}
    for i in range(n):
        seq = engine.start(PROMPT, SamplingParams(max_tokens=16, seed=i, **PARAMS))
        while len(seq.output_ids) < 3:
            engine.step(seq)
        key = tuple(seq.output_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi2_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for key, p in probs.items():
        if p * n >= 5:
            obs.append(counts.get(key, 0))
            exp.append(p * n)
        else:
            rest_o += counts.get(key, 0)
            rest_e += p * n
    assert sum(counts.values()) == n and set(counts) <= set(probs)
    obs.append(rest_o)
    exp.append(rest_e)
    scale = n / sum(exp)  # float rounding of the enumerated probabilities
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def biased_accept(tree, logits, params, generator):
    """The reference code's rule: match the target's argmax even when sampling (not lossless)."""
    path, _ = accept_greedy(tree, logits)
    probs = processed_probs(logits[path[-1]], params)
    return path, int(torch.multinomial(probs, 1, generator=generator))


@pytest.fixture(scope="module")
def setup(tiny):
    drafter = ShuffledMarginalsDrafter(vocab=8, seed=2)
    probs = exact_joint(tiny, SamplingParams(**PARAMS))
    return drafter, probs


@pytest.mark.parametrize("draw_all", [False, True], ids=["lazy-walk", "draw-every-node"])
def test_tree_sampling_matches_target_distribution(tiny, setup, draw_all):
    drafter, probs = setup
    eng = Engine(tiny, drafter, make_controller("tree", 24))
    eng.draw_all = draw_all
    counts = sample_first3(eng, SAMPLES)
    p = chi2_pvalue(counts, probs, SAMPLES)
    assert p > 1e-3, p
    # Speculation really happened: steps committed more than one token on average.
    seq = eng.start(PROMPT, SamplingParams(max_tokens=16, seed=0, **PARAMS))
    while seq.finish_reason is None:
        eng.step(seq)
    assert sum(s.accepted for s in seq.steps) / len(seq.steps) > 1.5


def test_biased_acceptance_fails_the_same_test(tiny, setup, monkeypatch):
    drafter, probs = setup
    monkeypatch.setattr(verifier_mod, "accept_sample", biased_accept)
    eng = Engine(tiny, drafter, make_controller("tree", 24))
    p = chi2_pvalue(sample_first3(eng, SAMPLES), probs, SAMPLES)
    assert p < 1e-3, p


def test_processed_probs_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.count_nonzero(p) == 2 and torch.isclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))
    # Smallest prefix of sorted tokens whose mass reaches 0.9.
    k = int((torch.cumsum(full, 0) < 0.9).sum()) + 1
    assert torch.count_nonzero(p) == k
    assert torch.allclose(p[:k], full[:k] / full[:k].sum())


@pytest.mark.parametrize("draw_all", [False, True], ids=["lazy-walk", "draw-every-node"])
def test_a_seeded_output_does_not_depend_on_the_tree(tiny, draw_all):
    """Each output position has its own draw, whatever tree verified it: the same seed gives the
    same tokens through a chain, 4-node and 24-node trees (what a global budget varies)."""
    outs = []
    for mode, budget in (("ar", 1), ("chain", 16), ("tree", 4), ("tree", 24)):
        eng = Engine(tiny, ShuffledMarginalsDrafter(vocab=8, seed=2), make_controller(mode, budget))
        eng.draw_all = draw_all
        outs.append(eng.generate(PROMPT, SamplingParams(max_tokens=24, seed=7, **PARAMS)).token_ids)
    assert outs[0] == outs[1] == outs[2] == outs[3] and len(outs[0]) == 24


def test_seeded_sampling_is_reproducible(tiny):
    drafter = random_dflash(tiny.model, seed=2, num_layers=1, mask_token_id=0)
    eng = Engine(tiny, drafter, make_controller("tree", 8))
    a = eng.generate(PROMPT, SamplingParams(max_tokens=20, seed=11, temperature=0.8)).token_ids
    b = eng.generate(PROMPT, SamplingParams(max_tokens=20, seed=11, temperature=0.8)).token_ids
    assert a == b and len(a) == 20
