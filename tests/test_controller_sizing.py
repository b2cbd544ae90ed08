"""controller.sizing.RealisedSizes: counterfactual tokens per tree size from accepted paths, and
the cap of best measured throughput."""
from __future__ import annotations

import math

import numpy as np
import pytest

from controller.sizing import RealisedSizes


def test_a_tree_says_what_each_of_its_best_first_prefixes_would_have_committed():
    rs = RealisedSizes(sizes=(2, 3, 4, 8, 16), min_weight=1)
    # a 10-node tree (uncapped: the policy stopped it) whose accepted path is nodes 1 -> 2 -> 7:
    # 3 nodes + the bonus = 4 tokens; cut at 2 nodes only node 1 is in (2 tokens), at 3 and 4
    # nodes nodes 1, 2 (3 tokens), at 8 all three; a 16-node cap would have built the same tree.
    rs.record(10, None, [1, 2, 7], 4)
    assert rs.mean_tokens().tolist() == [2, 3, 3, 4, 4]
    # a committed count cut by max_tokens caps every size
    rs2 = RealisedSizes(sizes=(2, 8), min_weight=1)
    rs2.record(10, None, [1, 2, 7], 2)
    assert rs2.mean_tokens().tolist() == [2, 2]


def test_sizes_above_a_binding_cap_are_not_observed():
    rs = RealisedSizes(sizes=(2, 4, 8, 16), min_weight=1)
    rs.record(4, 4, [1, 3], 3)  # the cap of 4 stopped this tree: what 8 or 16 nodes commit is unknown
    mean = rs.mean_tokens()
    assert mean[:2].tolist() == [2, 3] and math.isnan(mean[2]) and math.isnan(mean[3])
    rs.record(6, 16, [1], 2)  # stopped by the policy below its cap: every size is seen
    assert rs.weight.tolist() == pytest.approx([1.99, 1.99, 1.0, 1.0])


def simulate(rs: RealisedSizes, p: float, costs: list[float], fixed: float, steps: int, seed: int = 0,
             hard: float = 0.0, p_hard: float = 0.2):
    """A drafter whose best-first tree holds the target's next token at node i with probability
    p (1 - p)^(i - 1) along a chain: node i of the tree is depth i (so the path is 1, 2, ...,
    k). A fraction `hard` of the steps are ones the drafter is unsure of: the policy stops
    their tree at 2 nodes and p_hard replaces p. Returns the caps used."""
    rng = np.random.default_rng(seed)
    caps = []
    for _ in range(steps):
        cap = rs.cap(costs, fixed, len(costs) - 1)
        caps.append(cap)
        size, p_step = (min(2, cap), p_hard) if hard and rng.random() < hard else (cap, p)
        k = 0
        while k + 1 < size and rng.random() < p_step:
            k += 1
        rs.record(size, cap, list(range(1, k + 1)), k + 1)
    return caps


def test_the_cap_settles_where_measured_throughput_peaks_and_moves_when_the_drafter_changes():
    # each node costs 5 % of a one-token forward; a good drafter (p = 0.9) makes 16 nodes the
    # best size, a poor one (p = 0.5) 4
    costs = [0.0] + [1.0 + 0.05 * (n - 1) for n in range(1, 257)]
    fixed = 0.3

    def rate(p, n):  # true tokens per second of an n-node chain
        return sum(p ** k for k in range(n)) / (fixed + costs[n])

    def most_used(caps):
        return max(set(caps), key=caps.count)
    sizes = RealisedSizes().sizes
    assert max(sizes, key=lambda n: rate(0.9, n)) == 16 and max(sizes, key=lambda n: rate(0.5, n)) == 4
    rs = RealisedSizes()
    caps = simulate(rs, 0.9, costs, fixed, 400)
    assert caps[0] == 256  # nothing measured yet: the policy alone decides
    cap = most_used(caps[-100:])
    assert rate(0.9, cap) >= 0.95 * rate(0.9, 16), cap
    caps = simulate(rs, 0.5, costs, fixed, 400, seed=1)  # the drafter got worse
    cap = most_used(caps[-100:])
    assert rate(0.5, cap) >= 0.95 * rate(0.5, 4) and cap <= 6, cap
    # probes: every PROBE_EVERY-th cap is one size above the best
    assert sum(c > cap for c in caps[-100:]) >= 100 // rs.probe_every - 1


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        RealisedSizes(sizes=(4, 2))
    with pytest.raises(ValueError):
        RealisedSizes(sizes=(1, 2))
    with pytest.raises(ValueError):
        RealisedSizes(decay=0.0)


def test_steps_the_policy_stops_early_do_not_rate_sizes_above_the_cap_alone():
    """Half the steps are hard (the drafter is unsure: the policy stops at 2 nodes, p = 0.2), half
    easy (it grows to the cap, p = 0.9). Counting the hard steps alone above a binding cap would
    rate larger sizes by them and hold the cap down; observing a size only where the cap reached
    it finds the size of best throughput over all steps."""
    costs = [0.0] + [1.0 + 0.05 * (n - 1) for n in range(1, 257)]
    fixed = 0.3
    rs = RealisedSizes()
    caps = simulate(rs, 0.9, costs, fixed, 600, hard=0.5, p_hard=0.2)

    def rate(n):  # true tokens per second with a cap of n over both kinds of step
        easy = sum(0.9 ** k for k in range(n))
        hard = sum(0.2 ** k for k in range(min(2, n)))
        return 0.5 * (easy + hard) / (fixed + 0.5 * (costs[n] + costs[min(2, n)]))

    best = max(rs.sizes, key=rate)
    cap = max(set(caps[-200:]), key=caps[-200:].count)
    assert best >= 12 and cap >= 8 and rate(cap) >= 0.93 * rate(best), (best, cap)
