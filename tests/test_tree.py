"""Best-first tree builder over every proposal form, and tree masks (docs/method.md, sections 3 and 5)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from drafting.proposal import CandidateTree, ChildSource, Marginals
from engine.tree import ChainPolicy, FixedBudgetPolicy, SingleNodePolicy, build_tree
from reference import ancestor_matrix, tree_attention_mask


def random_marginals(depth: int, k: int, vocab: int = 50, seed: int = 0) -> Marginals:
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(depth, vocab, generator=g) * 2, dim=-1)
    vals, idx = torch.topk(lp, k, dim=-1)
    return Marginals(token_ids=idx, logprobs=vals)


def paths(tree):
    par, tok = tree.parents.tolist(), tree.tokens.tolist()
    out = []
    for i in range(tree.size):
        p, j = [], i
        while j > 0:
            p.append(tok[j])
            j = par[j]
        out.append(tuple(reversed(p)))
    return out


def test_tree_is_prefix_closed_and_scores_non_increasing():
    m = random_marginals(6, 5)
    t = build_tree(7, m, FixedBudgetPolicy(40), max_depth=6)
    assert t.size == 40 and t.tokens[0] == 7 and t.parents[0] == -1 and t.depths[0] == 0
    par = t.parents.tolist()
    assert all(par[i] < i for i in range(1, t.size))
    assert all(t.depths[i] == t.depths[par[i]] + 1 for i in range(1, t.size))
    scores = t.log_scores.tolist()
    assert all(scores[i] >= scores[i + 1] - 1e-6 for i in range(1, t.size - 1))
    # Each node's score is the sum of its path's log-marginals.
    lp = {(d, tok): v for d in range(6) for tok, v in zip(m.token_ids[d].tolist(), m.logprobs[d].tolist())}
    for i, path in enumerate(paths(t)):
        assert math.isclose(scores[i], sum(lp[(d, tok)] for d, tok in enumerate(path)), abs_tol=1e-5)
    assert len(set(paths(t))) == t.size
    assert math.isclose(t.a_hat, sum(math.exp(s) for s in scores), rel_tol=1e-6)


def test_best_first_maximises_a_hat_against_brute_force():
    # Every prefix-closed tree of n nodes over 3 depths x 3 tokens: best-first is optimal for each n.
    m = random_marginals(3, 3, vocab=10, seed=3)
    lp = m.logprobs.tolist()
    cands = [p for d in range(1, 4) for p in itertools.product(range(3), repeat=d)]
    score = {p: math.exp(sum(lp[d][r] for d, r in enumerate(p))) for p in cands}
    for n in range(2, 9):
        best = 0.0
        for subset in itertools.combinations(cands, n - 1):
            s = set(subset)
            if all(p[:-1] in s or len(p) == 1 for p in s):
                best = max(best, 1 + sum(score[p] for p in s))
        t = build_tree(0, m, FixedBudgetPolicy(n), max_depth=3)
        assert math.isclose(t.a_hat, best, rel_tol=1e-6), n


def test_chain_policy_is_the_top1_path():
    m = random_marginals(15, 8)
    t = build_tree(1, m, ChainPolicy(max_nodes=16), max_depth=15)
    assert t.size == 16
    assert t.tokens[1:].tolist() == m.token_ids[:, 0].tolist()
    assert t.parents.tolist() == list(range(-1, 15))


def test_max_depth_and_single_node():
    m = random_marginals(15, 4)
    t = build_tree(1, m, FixedBudgetPolicy(64), max_depth=3)
    assert int(t.depths.max()) == 3
    assert build_tree(1, m, SingleNodePolicy(), max_depth=15).size == 1
    assert build_tree(1, None, FixedBudgetPolicy(64), max_depth=15).size == 1
    assert build_tree(1, m, FixedBudgetPolicy(64), max_depth=0).size == 1


def test_candidate_tree_keeps_conditional_structure():
    # Root children: 5 (p=.6) and 6 (p=.4); under 5 only 7, under 6 only 8.
    ct = CandidateTree(tokens=torch.tensor([5, 6, 7, 8]), parents=torch.tensor([-1, -1, 0, 1]),
                       logprobs=torch.log(torch.tensor([0.6, 0.4, 1.0, 1.0])))
    t = build_tree(9, ct, FixedBudgetPolicy(5), max_depth=5)
    assert set(paths(t)) == {(), (5,), (6,), (5, 7), (6, 8)}


class CountingSource(ChildSource):
    """A lazy binary tree of depth <= 6: children of node `ref` are 2 ref + 1 and 2 ref + 2
    with conditional probabilities 0.7 and 0.3; records every node it is asked about."""

    root_ref = 0

    def __init__(self):
        self.asked: list[int] = []

    def children(self, ref, depth, limit):
        self.asked.append(ref)
        if depth >= 6:
            return []
        return [(math.log(0.7), 2 * ref + 1, 2 * ref + 1), (math.log(0.3), 2 * ref + 2, 2 * ref + 2)]


def test_lazy_source_is_expanded_only_where_the_tree_grows():
    src = CountingSource()
    t = build_tree(-1, src, FixedBudgetPolicy(10), max_depth=6)
    assert t.size == 10
    # Every expanded node is in the tree; leaves (and nodes never reached) are never asked about.
    assert len(src.asked) == len(set(src.asked)) <= t.size
    assert set(src.asked) <= set(t.tokens.tolist()[1:]) | {0}
    # The result is the best-first tree: same A_hat as the explicit product tree would give.
    probs = sorted((math.exp(x) for x in t.log_scores.tolist()), reverse=True)
    every = [1.0]
    frontier = [(1.0, 0)]
    for _ in range(6):
        frontier = [(p * q, d + 1) for p, d in frontier for q in (0.7, 0.3)]
        every += [p for p, _ in frontier]
    assert probs == pytest.approx(sorted(every, reverse=True)[:10])


def test_policy_cap_is_the_only_cap():
    m = random_marginals(15, 64, vocab=500, seed=4)
    for n in (1, 2, 64, 65, 200, 900):
        assert build_tree(0, m, FixedBudgetPolicy(n, top_k=64), max_depth=15).size == n
    # top_k bounds children per node: 3 tokens per depth over 2 depths gives at most 1 + 3 + 9 nodes.
    assert build_tree(0, m, FixedBudgetPolicy(100, top_k=3), max_depth=2).size == 13


def test_tree_mask_rows_see_prefix_self_and_ancestors():
    m = random_marginals(4, 3)
    t = build_tree(0, m, FixedBudgetPolicy(12), max_depth=4)
    mask = tree_attention_mask(t, prefix_len=5, dtype=torch.float32)
    assert mask.shape == (1, 1, 12, 17)
    visible = (mask[0, 0] == 0).numpy()
    assert visible[:, :5].all()
    anc = ancestor_matrix(t.parents)
    par = t.parents.tolist()
    for i in range(12):
        expect = {i}
        j = i
        while par[j] >= 0:
            j = par[j]
            expect.add(j)
        assert set(np.nonzero(visible[i, 5:])[0].tolist()) == expect
        assert set(np.nonzero(anc[i])[0].tolist()) == expect
    assert t.position_ids(5).tolist() == [(5 + t.depths).tolist()]
