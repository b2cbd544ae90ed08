"""The adaptive stopping rule against brute force over tree sizes, through the real tree builder."""
import math

import numpy as np
import pytest
import torch

from controller.ceilings import Ceilings
from controller.cost_model import ModelShape
from controller.latency_model import LatencyModel, LatencyParams
from controller.policy import CPU_SETTINGS, GPU_SETTINGS, AdaptivePolicy, PolicySettings, default_settings
from drafting.proposal import Marginals
from engine.tree import FixedBudgetPolicy, build_tree

DEPTH, K, MAX = 8, 12, 80


def random_marginals(seed: int, sharpness: float = 3.0) -> Marginals:
    """[DEPTH, K] top-K log-probs of random softmaxes over a 50-token vocabulary, rows sorted."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(sharpness * torch.randn(DEPTH, 50, generator=g), dim=-1)
    lp, idx = logp.sort(dim=-1, descending=True)
    return Marginals(token_ids=idx[:, :K].long(), logprobs=lp[:, :K].float())


def brute_force_peak(marg: Marginals, costs: list[float], fixed: float) -> tuple[int, list[float]]:
    """argmax over n of Theta(n) = A_hat(T_n) / (fixed + C(n)), T_n the best-first tree of n nodes."""
    thetas = []
    for n in range(1, MAX + 1):
        tree = build_tree(0, marg, FixedBudgetPolicy(budget=n, top_k=None), DEPTH)
        assert tree.size == n
        thetas.append(tree.a_hat / (fixed + costs[n]))
    return int(np.argmax(thetas)) + 1, thetas


def convex_costs(rng) -> tuple[list[float], float]:
    """Roofline-like C(n): flat (memory-bound) up to a knee, then linear + quadratic (compute-bound)."""
    base, knee = rng.uniform(5e-3, 2e-2), rng.integers(2, 40)
    slope = base / knee * rng.uniform(0.5, 3.0)
    quad = slope * rng.uniform(0, 0.02)
    costs = [0.0] + [max(base, base + slope * (n - knee) + quad * max(n - knee, 0) ** 2) for n in range(1, MAX + 1)]
    return costs, rng.uniform(0.05, 1.0) * base


@pytest.mark.parametrize("seed", range(12))
def test_stops_exactly_at_theta_peak(seed):
    rng = np.random.default_rng(seed)
    marg = random_marginals(seed, sharpness=float(rng.uniform(1.0, 4.0)))
    costs, fixed = convex_costs(rng)
    peak, thetas = brute_force_peak(marg, costs, fixed)
    policy = AdaptivePolicy(costs, fixed, min_nodes=1, max_nodes=MAX, bucket=1, top_k=None)
    tree = build_tree(0, marg, policy, DEPTH)
    assert tree.size == peak, (tree.size, peak, thetas[max(peak - 3, 0): peak + 2])
    assert policy.theta(tree.size, tree.a_hat) == pytest.approx(max(thetas))


def test_stops_at_peak_with_calibrated_roofline_costs():
    shape = ModelShape(layers=30, hidden=576, n_q=9, n_kv=3, head_dim=64, ffn=1536, vocab=49152,
                       bytes_per_param=4, tied_embeddings=True)
    model = LatencyModel(shape, Ceilings(60e9, 12e9, "cpu"), LatencyParams(1.6, 4e-3, 1.3, 6e-3))
    marg = random_marginals(123, sharpness=4.0)
    costs = model.verify_costs(MAX, 700)
    assert costs[5] == pytest.approx(model.predict(5, 700))
    for t_draft in (1e-3, 0.02, 0.2):
        peak, _ = brute_force_peak(marg, costs, t_draft + 2e-3)
        policy = AdaptivePolicy.from_model(model, 700, t_draft, 2e-3,
                                           PolicySettings(min_nodes=1, max_nodes=MAX, bucket=1, top_k=None))
        assert build_tree(0, marg, policy, DEPTH).size == peak
    # a slower drafter makes a step dearer, so bigger trees pay: the peak moves out
    sizes = [build_tree(0, marg, AdaptivePolicy.from_model(model, 700, t, 0.0, PolicySettings(1, MAX, 1, None)),
                        DEPTH).size for t in (1e-3, 0.05, 0.5)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_flat_cost_grows_to_max():
    costs = [0.0] + [0.01] * MAX
    policy = AdaptivePolicy(costs, 0.001, min_nodes=1, max_nodes=40, bucket=1, top_k=None)
    assert build_tree(0, random_marginals(1), policy, DEPTH).size == 40


def test_steep_cost_stays_at_min():
    costs = [0.0] + [0.01 * n ** 4 for n in range(1, MAX + 1)]
    policy = AdaptivePolicy(costs, 0.001, min_nodes=4, max_nodes=MAX, bucket=1, top_k=None)
    tree = build_tree(0, random_marginals(2, sharpness=8.0), policy, DEPTH)
    assert tree.size == 4
    # without the minimum the rule alone stops at the root: a 2nd node costs 0.15 s for <= 1 token
    assert build_tree(0, random_marginals(2, 8.0), AdaptivePolicy(costs, 0.001, 1, MAX), DEPTH).size == 1


def test_bucket_rounding_and_minimum():
    p = AdaptivePolicy([0.0] + [1.0] * 64, 0.0, min_nodes=4, max_nodes=64, bucket=8)
    assert [p.finalize(n) for n in (1, 3, 5, 8, 21, 64)] == [1, 3, 4, 8, 16, 64]
    assert AdaptivePolicy([0.0] * 65, 0.0, bucket=1).finalize(21) == 21
    # flat cost with bucket 8 and max 45: grows to 45, keeps 40
    p = AdaptivePolicy([0.0] + [0.01] * 64, 0.001, min_nodes=1, max_nodes=45, bucket=8, top_k=None)
    assert build_tree(0, random_marginals(3), p, DEPTH).size == 40


def test_rule_matches_theta_comparison_and_settings():
    costs = [0.0, 1.0, 1.2, 1.5, 2.0]
    p = AdaptivePolicy(costs, 0.5, min_nodes=1, max_nodes=4)
    # adding p=0.4 to (n=2, A=1.5): 0.4*(0.5+1.2)=0.68 > 1.5*0.3=0.45 -> add; Theta 1.9/2.0 > 1.5/1.7
    assert p.should_add(2, 1.5, 0.4) and (1.9 / 2.0 > 1.5 / 1.7)
    assert not p.should_add(2, 1.5, 0.2) and not (1.7 / 2.0 > 1.5 / 1.7)
    assert not p.should_add(4, 1.0, 1.0)  # at max_nodes
    with pytest.raises(ValueError):
        AdaptivePolicy(costs, 0.5, max_nodes=10)
    with pytest.raises(ValueError):
        PolicySettings(min_nodes=5, max_nodes=4)
    assert default_settings("cpu") == CPU_SETTINGS and CPU_SETTINGS.bucket == 1
    assert default_settings("cuda") == GPU_SETTINGS and GPU_SETTINGS == PolicySettings(32, 8192, 32, 128)


def test_should_add_is_cheap():
    import time
    p = AdaptivePolicy([0.0] + [0.01 + 1e-4 * n for n in range(1, 257)], 0.002, 1, 256)
    t0 = time.perf_counter()
    for i in range(20000):
        p.should_add(100, 5.0, 0.01)
    assert (time.perf_counter() - t0) / 20000 < 20e-6
    assert math.isfinite(p.theta(100, 5.0))
