"""One global tree budget over a batched step (docs/method.md, section 9): the merged best-first
order against brute force, the batched cost model, the batch policy's rule and the controller's
batched bookkeeping."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from controller.budget import BudgetController
from controller.ceilings import Ceilings
from controller.cost_model import ModelShape
from controller.latency_model import LatencyModel, LatencyParams
from controller.policy import BatchAdaptivePolicy, PolicySettings
from engine.accounting import StepStats
from engine.tree import FixedBudgetPolicy, build_tree, build_trees
from test_tree import random_marginals

SHAPE = ModelShape(layers=30, hidden=576, n_q=9, n_kv=3, head_dim=64, ffn=1536, vocab=49152, bytes_per_param=4,
                   tied_embeddings=True)
CEIL = Ceilings(60e9, 12e9, "synthetic cpu")
PARAMS = LatencyParams(1.6, 4e-3, 1.3, 6e-3)


class TotalCap:
    """Add every candidate up to `max_nodes` nodes in all (a fixed global N)."""

    def __init__(self, max_nodes: int, per_tree: int = 64, top_k: int | None = 3):
        self.max_nodes, self.max_nodes_per_tree, self.top_k = max_nodes, per_tree, top_k

    def should_add(self, n, a_hat, p):
        return True


def best_by_size(m, depth: int, width: int, max_n: int) -> list[float]:
    """Brute force: best A_hat of a prefix-closed tree of n nodes (n = 1..max_n) over the marginals."""
    lp = m.logprobs.tolist()
    cands = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
    score = {p: math.exp(sum(lp[d][r] for d, r in enumerate(p))) for p in cands}
    best = [0.0, 1.0]
    for n in range(2, max_n + 1):
        top = 0.0
        for subset in itertools.combinations(cands, n - 1):
            s = set(subset)
            if all(len(p) == 1 or p[:-1] in s for p in s):
                top = max(top, 1 + sum(score[p] for p in s))
        best.append(top)
    return best


@pytest.mark.parametrize("seeds", [(1, 2), (3, 4, 5), (6, 6)])
def test_merged_best_first_order_maximises_the_sum_of_a_hat(seeds):
    """For every total N, the global heap's split of N nodes over the sequences gives the largest
    sum of A_hat of any split into prefix-closed trees (brute force over every tree and split)."""
    margs = [random_marginals(2, 3, vocab=10, seed=s) for s in seeds]
    per_seq = [best_by_size(m, 2, 3, 7) for m in margs]
    b = len(seeds)
    for total in range(b, b + 9):
        brute = max(sum(per_seq[r][k] for r, k in enumerate(split))
                    for split in itertools.product(range(1, 8), repeat=b) if sum(split) == total)
        trees = build_trees([0] * b, margs, TotalCap(total), [2] * b)
        assert sum(t.size for t in trees) == total
        assert math.isclose(sum(t.a_hat for t in trees), brute, rel_tol=1e-6), total
        # Each tree is the best-first tree of its own size (a prefix of the merged order).
        for t, m in zip(trees, margs):
            alone = build_tree(0, m, FixedBudgetPolicy(t.size, top_k=3), max_depth=2)
            assert t.tokens.tolist() == alone.tokens.tolist() and t.parents.tolist() == alone.parents.tolist()


def test_every_sequence_keeps_its_root_and_a_missing_proposal_stays_a_root():
    margs = [random_marginals(4, 4, seed=1), None, random_marginals(4, 4, seed=2)]
    trees = build_trees([5, 6, 7], margs, TotalCap(3), [4, 4, 4])
    assert [t.size for t in trees] == [1, 1, 1] and [int(t.tokens[0]) for t in trees] == [5, 6, 7]
    trees = build_trees([5, 6, 7], margs, TotalCap(20), [4, 0, 4])
    assert trees[1].size == 1 and sum(t.size for t in trees) == 20
    with pytest.raises(ValueError, match="roots"):
        build_trees([1, 2], margs, TotalCap(4), [1, 1, 1])


def test_per_tree_cap_holds():
    margs = [random_marginals(4, 4, seed=1), random_marginals(4, 4, seed=2)]
    trees = build_trees([0, 0], margs, TotalCap(40, per_tree=5), [4, 4])
    assert [t.size for t in trees] == [5, 5]


def test_batched_cost_of_one_sequence_is_the_single_cost_and_kv_bytes_add_up():
    model = LatencyModel(SHAPE, CEIL, PARAMS, ((1.0, -0.3), (8.0, 0.0)))
    for n, c in [(1, 64), (16, 512), (64, 1024)]:
        assert math.isclose(model.predict_batch(n, 1, c), model.predict(n, c), rel_tol=1e-12)
    # Memory-bound at small n: 8 sequences of 1024 cached tokens read 8x the KV bytes of one.
    one, eight = model.predict_batch(8, 8, 1024), model.predict_batch(8, 8, 8 * 1024)
    kv = SHAPE.kv_bytes(0, 7 * 1024) / CEIL.bytes_per_s * PARAMS.alpha_m
    assert math.isclose(eight - one, kv, rel_tol=1e-6)
    assert math.isclose(model.predict_batch(8, 8, 512, 2e-3) - model.predict_batch(8, 8, 512), 7 * 2e-3)
    costs = model.batch_costs(32, 4, 2048, 1e-3)
    assert costs[:4] == [0.0] * 4 and len(costs) == 33
    assert math.isclose(costs[10], model.predict_batch(10, 4, 2048, 1e-3))
    with pytest.raises(ValueError):
        model.predict_batch(4, 0, 100)


def test_batch_policy_rule_and_trees_shrink_as_the_batch_grows():
    costs = [0.0] + [0.05 + 0.001 * n for n in range(1, 65)]
    pol = BatchAdaptivePolicy(costs, 0.02, max_nodes=64)
    # p * (fixed + C(N)) > A * (C(N+1) - C(N)): at N = 10, A = 10, dC = 1 ms, fixed + C = 80 ms.
    assert pol.should_add(10, 10.0, 0.2) and not pol.should_add(10, 10.0, 0.1)
    assert not pol.should_add(64, 1.0, 1.0)
    assert math.isclose(pol.theta(10, 10.0), 10.0 / 0.08)
    # With the calibrated-shape model, more sequences leave fewer nodes per sequence.
    model = LatencyModel(SHAPE, CEIL, PARAMS)
    per_seq = []
    for b in (1, 2, 4, 8):
        pol = BatchAdaptivePolicy(model.batch_costs(256, b, 512 * b), 0.02, 256, 256)
        trees = build_trees([0] * b, [random_marginals(15, 8, seed=s) for s in range(b)], pol, [15] * b)
        per_seq.append(sum(t.size for t in trees) / b)
    assert per_seq[0] > per_seq[-1] and all(x >= 1 for x in per_seq)


def _controller(**kw) -> BudgetController:
    kw.setdefault("registry", CollectorRegistry())
    return BudgetController(LatencyModel(SHAPE, CEIL, PARAMS), PolicySettings(1, 256, 1, 64), t_draft_init=0.01, **kw)


def test_controller_batch_policy_and_online_sequence_overhead():
    reg = CollectorRegistry()
    ctl = _controller(seq_overhead=1e-3, registry=reg)
    pol = ctl.batch_policy([100, 200, 300])
    assert math.isclose(pol.cost(3), ctl.model.predict_batch(3, 3, 600, 1e-3))
    # The class's gate has tried nothing yet: its first draft is a probe, a small batch of nodes
    # (at most 1.5 x the roots-only step's cost, at least 7 speculative nodes).
    costs = ctl.batch_costs(3, 600)
    probe = ctl.probe_nodes(costs, roots=3)
    assert pol.max_nodes == probe and probe >= 3 + 7 and (probe == 10 or costs[probe] <= 1.5 * costs[3])
    gate = ctl.gate_for(3)
    gate.record("draft", 2.0, 1.2)
    gate.record("cheap", 0.5, 1.1)
    assert gate.choice() == gate.best() == "draft" and ctl.batch_policy([100, 200, 300]).max_nodes == 256
    # Batched steps that each cost 5 ms per extra sequence over the roofline: the estimate moves there.
    tree = build_tree(0, None, FixedBudgetPolicy(1), 0)
    for _ in range(60):
        base = ctl.model.predict_batch(4, 4, 2000)
        stats = [StepStats(tree_size=1, accepted=1, accepted_depth=0, context_len=500, a_hat=1.0, drafted=False,
                           draft_s=0.0, verify_s=base + 3 * 5e-3, other_s=1e-3) for _ in range(4)]
        ctl.observe_batch(stats, [tree] * 4)
    assert abs(ctl.seq_overhead.value - 5e-3) < 2e-4
    assert ctl.step_kinds["plain"] == 240 and ctl.batch_steps == 60
    # Batched steps alone keep the latency-table gauge current, at the batch's mean context.
    assert reg.get_sample_value("bastion_context_tokens") == 500
    assert reg.get_sample_value("bastion_predicted_verify_seconds", {"s": "64"}) == pytest.approx(ctl.model.predict(64, 500))
    with pytest.raises(ValueError):
        ctl.observe_batch(stats[:1], [tree])


def test_each_batch_size_class_has_its_own_gate():
    ctl = _controller()
    assert ctl.gate_for(1) is ctl.gate and ctl.gate_for(3) is ctl.gate_for(4) and ctl.gate_for(5) is not ctl.gate_for(4)
    tree = build_tree(0, random_marginals(4, 4), FixedBudgetPolicy(8), 4)
    # A drafted batched step of 8 that accepts nothing beyond the bonus: the class of 5-8 stops drafting ...
    assert ctl.should_draft(8)
    stats = [StepStats(tree_size=8, accepted=1, accepted_depth=0, context_len=500, a_hat=tree.a_hat, drafted=True,
                       draft_s=0.04, verify_s=0.4, other_s=1e-3) for _ in range(8)]
    ctl.observe_batch(stats, [tree] * 8)
    g8 = ctl.gate_for(8)
    assert g8.gain["draft"] < 1 and not ctl.should_draft(8) and not ctl.should_draft(6)
    # ... and single-sequence steps still draft.
    assert ctl.should_draft(1) and ctl.should_draft(2)
    snap = ctl.snapshot()
    assert snap["batch_gates"]["8"]["samples"]["draft"] == 1 and snap["batch_gates"]["8"]["choice"] == "cheap"
    assert snap["batch_gates"]["2"]["samples"]["draft"] == 0
    # A larger class, first seen after the class of 8 found a loss, starts from its averages.
    assert not ctl.should_draft(12) and ctl.gate_for(16).gain["draft"] == g8.gain["draft"]


def test_losing_cheap_proposals_are_turned_off_and_plain_steps_are_measured():
    """The drafter's free trees are judged like drafted ones: cheap steps that accept nothing
    while costing twice a plain step switch them off; plain steps set the measured baseline."""
    ctl = _controller()
    for _ in range(5):
        ctl.record_step(1, 500, 0.05, 0.0, 0.01, 1.0, 1, drafted=False)
    assert abs(ctl.plain_step_seconds(500) - 0.06) < 1e-9  # measured, not the model's C(1)
    # At a longer context the measured ratio scales the model's C(1) there.
    ratio = 0.06 / ctl.model.predict(1, 500)
    assert abs(ctl.plain_step_seconds(900) - ratio * ctl.model.predict(1, 900)) < 1e-9
    assert ctl.should_draft(1)  # never tried: drafted first
    ctl.record_step(8, 500, 0.11, 0.02, 0.01, 2.0, 2, drafted=True)
    draft_gain = ctl.gate.gain["draft"]
    assert abs(draft_gain - 2 * 0.06 / 0.14) < 1e-9 and not ctl.should_draft(1)
    assert ctl.allow_cheap(1)  # the free proposals next, never tried either
    for _ in range(3):
        if not ctl.allow_cheap(1):
            break
        ctl.record_step(8, 500, 0.11, 0.0, 0.01, 2.0, 1, drafted=False, cheap=True)
    assert not ctl.allow_cheap(1) and ctl.gate.best() == "plain"
    assert ctl.gate.gain["draft"] == draft_gain  # each arm has its own average
    # Batched: the class of 8 has its own gate, started from the single-sequence averages.
    assert ctl.gate_for(8).gain["cheap"] == ctl.gate.gain["cheap"] and ctl.gate_for(8).samples["cheap"] == 0


def test_marginal_gains_split_the_excess_by_draft_share_and_speculative_nodes():
    mk = lambda n, a, d: StepStats(tree_size=n, accepted=a, accepted_depth=a - 1, context_len=500, a_hat=1.0,
                                   drafted=d, draft_s=0.02, verify_s=0.08, other_s=0.0)
    # plain batch of 4: 0.05 s. Step 0.10 s: draft 0.02 split by 3 drafting sequences, verify
    # excess 0.03 split by speculative nodes 7 : 3 : 0.
    gains = BudgetController.marginal_gains([mk(8, 4, True), mk(4, 1, True), mk(1, 1, True), mk(1, 1, False)], 0.05)
    m0 = 0.02 / 3 + 0.03 * 7 / 10
    assert math.isclose(gains[0][1], 1 + m0 / 0.05) and math.isclose(gains[0][0], (1 + 3 / 4) / (1 + m0 / 0.05))
    m1 = 0.02 / 3 + 0.03 * 3 / 10
    assert math.isclose(gains[1][0], 1 / (1 + m1 / 0.05))
    assert math.isclose(gains[2][0], 1 / (1 + 0.02 / 3 / 0.05))  # paid its share of the drafter for nothing
    assert gains[3] is None
    assert BudgetController.marginal_gains([mk(1, 1, False)] * 2, 0.05) == [None, None]


def test_each_request_has_its_own_gate_inside_a_batch():
    """In drafted batched steps, a request whose drafts are never accepted stops drafting while a
    request whose drafts pay keeps drafting; the one kept out is sampled again later."""
    ctl = _controller()
    states = [ctl.sequence_state() for _ in range(4)]
    assert all(ctl.sequence_drafts(s, 4) for s in states) and ctl.sequence_drafts(None, 4)
    tree = build_tree(0, random_marginals(4, 4), FixedBudgetPolicy(8), 4)
    for _ in range(5):  # plain batched steps set the measured baseline: 0.05 s for 4 sequences
        ctl.observe_batch([StepStats(tree_size=1, accepted=1, accepted_depth=0, context_len=500, a_hat=1.0,
                                     drafted=False, draft_s=0.0, verify_s=0.049, other_s=0.001)] * 4,
                          [tree] * 4, states)
    assert all(s.batch.samples["draft"] == 0 for s in states)  # undrafted steps leave the request gates alone

    def drafted_step():
        cls = ctl.should_draft(4)  # the class's gate samples plain steps now and then (its bar is above 1)
        drafting = [cls and ctl.sequence_drafts(s, 4) for s in states]
        stats = [StepStats(tree_size=8 if d else 1, accepted=(6 if r == 0 else 1) if d else 1,
                           accepted_depth=0, context_len=500, a_hat=2.0, drafted=d, draft_s=0.01,
                           verify_s=0.06, other_s=0.001) for r, d in enumerate(drafting)]
        ctl.observe_batch(stats, [tree] * 4, states)
        return drafting

    assert drafted_step() == [True] * 4
    assert states[0].batch.gain["draft"] > 1 > states[1].batch.gain["draft"]
    history = [drafted_step() for _ in range(40)]
    assert sum(h[0] for h in history) >= 36  # the paying request drafts whenever the class's gate does
    for r in (1, 2, 3):
        drafted = sum(h[r] for h in history)
        assert 1 <= drafted <= 8, (r, drafted)  # kept out, but re-sampled now and then


def test_batched_steps_feed_each_proposal_kind_its_own_surrogate_check():
    """In a batched step a drafted tree goes to the full drafter's surrogate check and a tree
    of the drafter's free proposal to the free proposals' own; plain rows to neither."""
    ctl = _controller()
    tree = build_tree(0, random_marginals(4, 4), FixedBudgetPolicy(8), 4)
    plain = build_tree(0, None, FixedBudgetPolicy(1), 0)

    def stats(drafted, cheap, size):
        return StepStats(tree_size=size, accepted=2 if size > 1 else 1, accepted_depth=1 if size > 1 else 0,
                         context_len=500, a_hat=tree.a_hat if size > 1 else 1.0, drafted=drafted, cheap=cheap,
                         draft_s=0.01 if drafted else 0.0, verify_s=0.05, other_s=1e-3)
    ctl.observe_batch([stats(False, True, 8), stats(False, False, 1)], [tree, plain])
    assert (ctl.surrogate.steps, ctl.surrogate_cheap.steps) == (0, 1)
    ctl.observe_batch([stats(True, False, 8), stats(True, False, 8), stats(False, False, 1)], [tree, tree, plain])
    assert (ctl.surrogate.steps, ctl.surrogate_cheap.steps) == (2, 1)
    assert ctl.surrogate_cheap.real_depth[0] == 1.0 and ctl.surrogate.real_depth[0] == pytest.approx(1.995)  # decay 0.995


def test_batched_gates_need_drafting_to_beat_plain_decoding_by_the_bar():
    """In batched steps of three or four plain decoding counts as BATCH_SPECULATION_BAR: a
    drafter measured at 1.05 x a plain batched step is left off, one at 1.2 x is used;
    single-sequence steps still take the near-tie (their gate counts plain decoding below 1)."""
    from controller.budget import BATCH_SPECULATION_BAR

    assert 1.05 < BATCH_SPECULATION_BAR < 1.2
    for gain, drafts in ((1.05, False), (1.2, True)):
        ctl = _controller()
        state = ctl.sequence_state()
        ctl.sequence_drafts(state, 4)
        for gate in (ctl.gate_for(4), state.batch):
            for _ in range(6):
                gate.record("draft", gain, 1.1)
            assert gate.value("plain") == pytest.approx(BATCH_SPECULATION_BAR)
            assert (gate.best() == "draft") is drafts, (gain, gate.snapshot())
        for _ in range(6):
            ctl.gate.record("draft", 1.05, 1.1)
        assert ctl.gate.best() == "draft"


def test_each_batch_size_class_counts_plain_decoding_at_its_bar():
    """Batches of two judge drafting against PAIR_SPECULATION_BAR, of three or four against
    BATCH_SPECULATION_BAR, of five or more against WIDE_SPECULATION_BAR: a drafter measured at
    1.05 x a plain batched step drafts only in the class of two, one at 1.2 x in the classes of
    two and four, one at 1.4 x in every class; one request's own gate follows the size of each step."""
    from controller.budget import BATCH_SPECULATION_BAR, PAIR_SPECULATION_BAR, WIDE_SPECULATION_BAR

    assert PAIR_SPECULATION_BAR < 1.05 < BATCH_SPECULATION_BAR < 1.2 < WIDE_SPECULATION_BAR < 1.4
    ctl = _controller()
    assert ctl.batch_bar(2) == PAIR_SPECULATION_BAR
    assert ctl.batch_bar(3) == ctl.batch_bar(4) == BATCH_SPECULATION_BAR
    assert ctl.batch_bar(5) == ctl.batch_bar(8) == ctl.batch_bar(16) == WIDE_SPECULATION_BAR
    for gain, drafting in ((1.05, {2}), (1.2, {2, 4}), (1.4, {2, 4, 8})):
        ctl = _controller()
        gates = {k: ctl.gate_for(k) for k in (2, 4, 8)}
        for k, bar in ((2, PAIR_SPECULATION_BAR), (4, BATCH_SPECULATION_BAR), (8, WIDE_SPECULATION_BAR)):
            assert gates[k].value("plain") == pytest.approx(bar)
            for _ in range(6):
                gates[k].record("draft", gain, 1.1)
        assert {k for k, g in gates.items() if g.best() == "draft"} == drafting, gain
    state = ctl.sequence_state()
    for _ in range(6):
        state.batch.record("draft", 1.2, 1.1)
    assert ctl.sequence_drafts(state, 2) and state.batch.best() == "draft"
    assert ctl.sequence_drafts(state, 3)
    ctl.sequence_drafts(state, 6)
    assert state.batch.best() == "plain"
    assert ctl.sequence_drafts(state, 4)


def test_plain_steps_of_a_busy_start_stop_setting_the_baseline():
    """Plain steps timed at twice the model's prediction (a second process ran), then the
    machine goes quiet and only drafted steps run: within PLAIN_MAX_AGE steps the busy plain
    steps no longer set the baseline, and the model's level, which the drafted steps brought
    back down, stands in for them. Drafted steps are then judged against the quiet baseline."""
    from controller.budget import PLAIN_MAX_AGE

    ctl = _controller()
    quiet = ctl.model.predict(1, 500)
    for _ in range(8):
        ctl.record_step(1, 500, 2 * quiet - 1e-3, 0.0, 1e-3, 1.0, 1, drafted=False)
    assert ctl.plain_step_seconds(500) == pytest.approx(2 * quiet, rel=0.02)
    busy_model = ctl.model
    step = float(busy_model.predict(8, 500)) / busy_model.predict(1, 500) * quiet  # an 8-node tree, quiet
    for i in range(PLAIN_MAX_AGE):
        ctl.record_step(8, 500, step, 1e-4, 1e-4, 2.0, 2, drafted=True)
        if i == 40:  # the level is quiet again, but the busy plain steps still count
            assert ctl.model.predict(1, 500) < 0.6 * busy_model.predict(1, 500)
            assert ctl.plain_step_seconds(500) > 1.6 * quiet
    assert ctl.plain_step_seconds(500) == pytest.approx(quiet, rel=0.1)
    ctl.record_step(8, 500, step, 1e-4, 1e-4, 2.0, 2, drafted=True)
    assert ctl.gate.last_gain["draft"] == pytest.approx(2 * quiet / (step + 2e-4), rel=0.1)
    # A new plain step sets the baseline again (at the quiet machine's speed).
    ctl.record_step(1, 500, 1.05 * quiet - 1e-3, 0.0, 1e-3, 1.0, 1, drafted=False)
    assert ctl.plain_step_seconds(500) == pytest.approx(1.05 * quiet)


def test_a_plain_step_refreshes_the_baseline_every_plain_refresh_steps():
    """Drafting pays 2x and the gate keeps drafting: still, once no plain step has run for
    PLAIN_REFRESH steps, the next step is plain, so the baseline stays measured; batched steps
    of each batch size likewise. The refresh is one step, then drafting resumes."""
    from controller.budget import PLAIN_REFRESH

    ctl = _controller()
    t1 = ctl.model.predict(1, 500)
    kinds = []
    for _ in range(4 * PLAIN_REFRESH):
        pol = ctl.policy_for_step(500)
        if pol.max_nodes == 1:
            kinds.append("plain")
            ctl.record_step(1, 500, t1 - 1e-3, 0.0, 1e-3, 1.0, 1, drafted=False)
        else:
            assert ctl.should_draft(1) or ctl.allow_cheap(1)
            kinds.append("spec")
            ctl.record_step(4, 500, 1.2 * t1, 1e-4, 1e-4, 2.4, 3, drafted=ctl.should_draft(1), cheap=ctl.allow_cheap(1))
    plain_at = [i for i, k in enumerate(kinds) if k == "plain"]
    assert 3 <= len(plain_at) <= 8, plain_at
    assert all(b - a <= PLAIN_REFRESH + 1 for a, b in zip(plain_at, plain_at[1:])) and plain_at[-1] >= 3 * PLAIN_REFRESH - 1
    assert all(kinds[i + 1] == "spec" for i in plain_at[1:] if i + 1 < len(kinds))
    # A batch of 4: its class's gate gets a plain step once the size has none for PLAIN_REFRESH steps.
    gate = ctl.gate_for(4)
    for _ in range(5):
        gate.record("draft", 2.0, 1.2)
        gate.record("cheap", 1.0, 1.1)
    assert gate.choice() == "draft"
    ctl.batch_policy([500] * 4)
    assert gate.choice() == "plain" and not ctl.should_draft(4)
    gate.tick()
    assert gate.choice() == "draft"
