"""Step accounting: the one owner of speedup, histograms and token counts, and its Prometheus export."""
from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from engine.accounting import StepAccounting, StepStats, summarize
from server.metrics import StepCollector


def step(tree_size: int, accepted: int, depth: int, drafted: bool = True, cheap: bool = False,
         draft_s: float = 0.0, verify_s: float = 0.01, other_s: float = 0.0) -> StepStats:
    return StepStats(tree_size=tree_size, accepted=accepted, accepted_depth=depth, context_len=10, a_hat=1.0,
                     drafted=drafted, draft_s=draft_s, verify_s=verify_s, other_s=other_s, cheap=cheap)


def test_speedup_uses_the_probe_then_measured_root_only_steps():
    from engine.accounting import SPEEDUP_DECAY as d

    acc = StepAccounting(ar_probe_s=0.010)
    assert acc.speedup() == 1.0  # nothing measured yet
    acc.record(step(16, 3, 2, draft_s=0.002, verify_s=0.015, other_s=0.003))  # 3 tokens in 20 ms
    assert acc.speedup() == pytest.approx(0.010 * 3 / 0.020)  # the probe stands in for the AR step
    acc.record(step(1, 1, 0, drafted=False, verify_s=0.008, other_s=0.001))  # a whole plain step: 9 ms
    assert acc.ar_step_s == pytest.approx(0.009)
    assert acc.speedup() == pytest.approx(0.009 * (3 * d + 1) / (0.020 * d + 0.009))  # every step counts
    assert StepAccounting().speedup() == 1.0  # no probe, no AR step: undefined


def test_speedup_is_exactly_one_for_plain_decoding_and_follows_recent_steps():
    acc = StepAccounting(ar_probe_s=0.5)
    times = random.Random(0).choices([0.0123, 0.0137, 0.0191, 0.04, 0.011], k=50)
    for i, t in enumerate(times):
        acc.record(step(1, 1, 0, drafted=False, verify_s=t, other_s=0.002 + 1e-4 * (i % 3)))
        assert acc.speedup() == 1.0  # exactly: no rounding of a ratio of equal sums
    for _ in range(10):  # a few early losing speculative steps ...
        acc.record(step(16, 1, 0, verify_s=0.05))
    assert acc.speedup() < 0.9
    for _ in range(2000):  # ... are forgotten once decoding is plain again
        acc.record(step(1, 1, 0, drafted=False, verify_s=0.01, other_s=0.002))
    assert acc.speedup() == pytest.approx(1.0, abs=1e-3)


def test_totals_histograms_and_kinds():
    acc = StepAccounting()
    acc.record(step(8, 3, 2))                      # 2 drafted tokens accepted + bonus
    acc.record(step(4, 1, 0, drafted=False, cheap=True))
    acc.record(step(1, 1, 0, drafted=False))
    acc.record(step(8, 2, 3))                      # a stop cut the path: only 2 tokens committed
    assert acc.steps == 4 and acc.steps_by_kind == {"draft": 2, "cheap": 1, "plain": 1}
    assert acc.draft_tokens == 7 + 3 + 0 + 7 and acc.accepted_tokens == 2 + 0 + 0 + 2
    assert acc.accepted_per_depth[:3] == [2, 2, 0]
    assert acc.tree_size.n == 4 and acc.tree_size.total == 21
    assert dict(acc.tree_size.cumulative())["8.0"] == 4 and dict(acc.tree_size.cumulative())["4.0"] == 2
    accepted = dict(acc.accepted_length.cumulative())
    assert (accepted["1.0"], accepted["2.0"], accepted["3.0"], accepted["+Inf"]) == (2, 3, 4, 4)
    snap = acc.snapshot()
    acc.record(step(2, 2, 1))
    assert snap.steps == 4 and acc.steps == 5  # a snapshot does not move with the original


def test_summarize_one_request():
    s = summarize([step(8, 3, 2), step(1, 1, 0, drafted=False), step(8, 2, 3)])
    assert (s.steps, s.draft_tokens, s.accepted_tokens) == (3, 14, 4)
    assert s.tau == pytest.approx(2.0) and s.mean_tree_size == pytest.approx(17 / 3)
    assert summarize([]).tau == 0.0 and summarize([]).steps == 0


def test_collector_exports_the_accounting_it_reads():
    reg = CollectorRegistry()
    acc = StepAccounting(ar_probe_s=0.01)
    col = StepCollector()
    reg.register(col)
    get = reg.get_sample_value
    assert get("bastion_estimated_speedup") == 1.0 and get("bastion_drafts_total") == 0  # no engine yet
    col.source = lambda: acc
    acc.record(step(8, 3, 2, verify_s=0.015))
    acc.record(step(1, 1, 0, drafted=False, verify_s=0.012))
    assert get("bastion_drafts_total") == 2 and get("bastion_draft_tokens_total") == 7
    assert get("bastion_accepted_tokens_total") == 2
    assert get("bastion_accepted_tokens_per_depth_total", {"depth": "2"}) == 1
    assert get("bastion_steps_total", {"mode": "plain"}) == 1 and get("bastion_steps_total", {"mode": "draft"}) == 1
    assert get("bastion_tree_size_nodes_count") == 2 and get("bastion_tree_size_nodes_sum") == 9
    assert get("bastion_tree_size_nodes_bucket", {"le": "1.0"}) == 1
    assert get("bastion_accepted_length_tokens_bucket", {"le": "+Inf"}) == 2
    assert get("bastion_estimated_speedup") == pytest.approx(acc.speedup())
    assert 1.0 < acc.speedup() < 3 * 0.012 / 0.015
