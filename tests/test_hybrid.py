"""DFlash + suffix hybrid drafter: the lazy merge against brute force, state handling, well-formed proposals."""
from __future__ import annotations

import math
import random

import pytest
import torch

from drafting.base import Drafter
from drafting.proposal import CandidateTree, Marginals
from drafting.hybrid import HybridDrafter, MergedTrie
from drafting.suffix import SuffixDrafter, SuffixTrie
from engine.tree import ChainPolicy, FixedBudgetPolicy, build_tree
from helpers import expand


class FixedMarginals(Drafter):
    """Returns the same marginals every step; records the calls it gets."""

    def __init__(self, marg: Marginals, feature_layers=(1,)):
        self.marg = marg
        self.max_depth = marg.depth
        self.feature_layers = feature_layers
        self.calls: list = []

    def new_state(self):
        return {"tokens": [], "features": 0, "finished": None}

    def extend(self, state, token_ids, features):
        state["tokens"] += list(token_ids)
        state["features"] += 0 if features is None else features.shape[0]

    def propose(self, state, root, max_depth):
        self.calls.append((root, max_depth))
        return Marginals(self.marg.token_ids[:max_depth], self.marg.logprobs[:max_depth])

    def finish(self, state, final_tokens=()):
        state["finished"] = list(final_tokens)


def random_marginals(depth: int, k: int, vocab: int, rng: random.Random) -> Marginals:
    ids, lps = [], []
    for _ in range(depth):
        row = rng.sample(range(vocab), k)
        p = sorted((rng.random() + 0.01 for _ in range(k)), reverse=True)
        z = sum(p) * (1 + rng.random())  # rows need not sum to 1 (top-K of a larger vocabulary)
        ids.append(row)
        lps.append([math.log(x / z) for x in p])
    return Marginals(torch.tensor(ids), torch.tensor(lps, dtype=torch.float32))


def random_suffix_tree(n: int, depth: int, vocab: int, rng: random.Random) -> CandidateTree:
    toks, pars, lps, dep = [], [], [], []
    kids: dict[int, set] = {}
    while len(toks) < n:
        p = rng.choice([-1] + [i for i in range(len(toks)) if dep[i] < depth])
        t = rng.randrange(vocab)
        if t in kids.setdefault(p, set()):
            continue
        kids[p].add(t)
        toks.append(t)
        pars.append(p)
        dep.append(1 if p < 0 else dep[p] + 1)
        lps.append(math.log(rng.random() * 0.9 + 0.05))
    return CandidateTree(torch.tensor(toks), torch.tensor(pars), torch.tensor(lps, dtype=torch.float32))


def merged_conditionals(marg: Marginals, ct: CandidateTree, use_max: bool, w: float, max_depth: int
                        ) -> dict[tuple[int, ...], float]:
    """Brute force: every path of the merged tree up to max_depth -> its log path score."""
    rows = [dict(zip(r, lp)) for r, lp in zip(marg.token_ids.tolist(), marg.logprobs.tolist())]
    skids: dict[int, dict[int, tuple[float, int]]] = {}
    for i, (t, p, lp) in enumerate(zip(ct.tokens.tolist(), ct.parents.tolist(), ct.logprobs.tolist())):
        skids.setdefault(p, {})[t] = (lp, i)
    out: dict[tuple[int, ...], float] = {}

    def rec(path: tuple[int, ...], score: float, sref):
        d = len(path)
        if d == max_depth:
            return
        row = rows[d] if d < len(rows) else {}
        sk = skids.get(sref, {}) if sref is not None else {}
        for t in set(row) | set(sk):
            if sk:
                qs = math.exp(sk[t][0]) if t in sk else 0.0
                qd = math.exp(row[t]) if t in row else 0.0
                if not row:
                    q = qs
                elif use_max:
                    q = max(qs, qd)
                else:
                    q = w * qs + (1 - w) * qd
            else:
                q = math.exp(row[t])
            child = path + (t,)
            out[child] = score + math.log(q)
            rec(child, out[child], sk[t][1] if t in sk else None)

    rec((), 0.0, -1)
    return out


def paths_of(ct: CandidateTree) -> dict[tuple[int, ...], float]:
    toks, pars, lps = ct.tokens.tolist(), ct.parents.tolist(), ct.logprobs.tolist()
    paths: list[tuple[int, ...]] = []
    scores: list[float] = []
    out = {}
    for t, p, lp in zip(toks, pars, lps):
        assert p < len(paths)
        paths.append((paths[p] if p >= 0 else ()) + (t,))
        scores.append((scores[p] if p >= 0 else 0.0) + lp)
        assert paths[-1] not in out, "duplicate child"
        out[paths[-1]] = scores[-1]
    return out


@pytest.mark.parametrize("use_max", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_merge_is_best_first_over_the_brute_force_union(use_max, seed):
    rng = random.Random(seed)
    D, K, vocab, depth, cap = 3, 3, 6, 4, 12
    marg = random_marginals(D, K, vocab, rng)
    ct = random_suffix_tree(8, depth, vocab, rng)
    full = merged_conditionals(marg, ct, use_max, 0.6, depth)
    got = paths_of(expand(MergedTrie(marg, ct.source(), use_max, 0.6), cap, depth))
    for p, s in got.items():  # every node's score is its merged path score
        assert s == pytest.approx(full[p], abs=1e-5)
    # The builder's `cap` nodes are exactly the top-`cap` paths of the union.
    assert len(got) == min(cap, len(full))
    assert sorted(got.values(), reverse=True) == pytest.approx(sorted(full.values(), reverse=True)[:cap], abs=1e-5)


def test_merge_whole_tree_when_cap_is_large():
    rng = random.Random(7)
    marg = random_marginals(2, 2, 5, rng)
    ct = random_suffix_tree(5, 3, 5, rng)
    full = merged_conditionals(marg, ct, False, 0.5, 3)
    got = paths_of(expand(MergedTrie(marg, ct.source(), False, 0.5), 1000, 3))
    assert set(got) == set(full)


def test_merge_respects_max_depth_and_the_chain_reaches_full_depth():
    rng = random.Random(3)
    marg = random_marginals(4, 8, 50, rng)
    ct = random_suffix_tree(20, 6, 50, rng)
    merged = MergedTrie(marg, ct.source(), False, 0.5)
    tree = build_tree(99, merged, FixedBudgetPolicy(16), 2)
    assert tree.size == 16 and int(tree.depths.max()) <= 2
    # The chain (top-1 child per node) needs no completion: the lazy source always has a next row.
    chain = build_tree(99, merged, ChainPolicy(max_nodes=5), 4)
    assert chain.depths.tolist() == list(range(5))
    full = merged_conditionals(marg, ct, False, 0.5, 4)
    path: tuple[int, ...] = ()
    for tok in chain.tokens[1:].tolist():  # each chain node is its parent's best child
        kids = {p: v for p, v in full.items() if len(p) == len(path) + 1 and p[:-1] == path}
        assert path + (tok,) == max(kids, key=kids.get)
        path = path + (tok,)


def test_tree_size_is_the_policy_s_alone():
    """Neither drafter caps the tree: a budget beyond the old 64-candidate cap is filled."""
    rng = random.Random(11)
    marg = random_marginals(6, 32, 200, rng)
    ct = random_suffix_tree(30, 6, 200, rng)
    tree = build_tree(1, MergedTrie(marg, ct.source(), False, 0.9), FixedBudgetPolicy(200), 6)
    assert tree.size == 200


@pytest.mark.parametrize("merge", ["mix-tree", "max-tree"])
def test_hybrid_state_flow_and_fallback(merge):
    rng = random.Random(0)
    marg = random_marginals(5, 4, 40, rng)
    fd = FixedMarginals(marg)
    h = HybridDrafter(fd, SuffixDrafter(max_depth=8, global_tokens=100), merge=merge)
    assert h.feature_layers == (1,) and h.max_depth == 8
    st = h.new_state()
    h.extend(st, [1, 2, 3, 4], torch.zeros(4, 3))
    assert st.dflash["tokens"] == [1, 2, 3, 4] and st.dflash["features"] == 4
    assert st.suffix.tokens == [1, 2, 3, 4]
    # No suffix match (root 30 never seen): DFlash's marginals come back unchanged.
    p = h.propose(st, 30, 8)
    assert isinstance(p, Marginals) and torch.equal(p.token_ids, marg.token_ids)
    assert fd.calls[-1] == (30, 5)
    # A match: root 2 is followed by 3, 4 in the context.
    p = h.propose(st, 2, 8)
    assert isinstance(p, MergedTrie) and p.use_max == (merge == "max-tree")
    tree = build_tree(2, p, FixedBudgetPolicy(64), 8)
    assert tree.tokens[1:].tolist().count(3) >= 1
    assert st.proposals == 2 and st.merged == 1
    assert h.finish(st, [5]) == 0
    assert st.dflash["finished"] == [5]
    assert h.suffix.global_index.tokens(0) == [5]


def test_hybrid_skips_dflash_on_long_matches():
    rng = random.Random(1)
    fd = FixedMarginals(random_marginals(4, 4, 40, rng))
    h = HybridDrafter(fd, SuffixDrafter(), skip_dflash_match=3)
    st = h.new_state()
    h.extend(st, [5, 6, 7, 8, 9, 5, 6], torch.zeros(7, 3))
    p = h.propose(st, 7, 4)  # match "5 6 7" (3 tokens): suffix alone, DFlash not called
    assert isinstance(p, SuffixTrie) and expand(p, 64, 4).tokens.tolist()[:2] == [8, 9]
    assert fd.calls == [] and st.skipped == 1
    h.extend(st, [7], torch.zeros(1, 3))
    h.propose(st, 1, 4)  # no match: DFlash runs and sees every pending feature row
    assert fd.calls == [(1, 4)] and st.dflash["features"] == 8


def test_hybrid_options_validated():
    fd = FixedMarginals(random_marginals(2, 2, 10, random.Random(0)))
    with pytest.raises(ValueError):
        HybridDrafter(fd, SuffixDrafter(), merge="sum")
    with pytest.raises(ValueError):
        HybridDrafter(fd, SuffixDrafter(), weight=0.0)
    with pytest.raises(ValueError):
        HybridDrafter(fd, SuffixDrafter(), skip_dflash_match=-1)


def test_hybrid_proposal_well_formed_on_the_default_target(target_f32, random_drafter):
    """Random DFlash + suffix on real prompts: parents first, unique children, finite scores, depth cap."""
    from engine.engine import Engine

    h = HybridDrafter(random_drafter, SuffixDrafter())
    eng = Engine(target_f32)
    ids = eng.chat_prompt_ids([{"role": "user", "content": "Copy this list twice: apple, pear, plum, fig."}])
    st = h.new_state()
    from reference import gather_features, hf_forward

    with torch.inference_mode():
        out = hf_forward(target_f32.model, torch.tensor([ids]), output_hidden_states=True, logits_to_keep=1)
        h.extend(st, ids, gather_features(out.hidden_states, h.feature_layers))
    merged = 0
    for root in ids[-12:]:  # roots that occur in the context: the suffix index matches
        for depth in (15, 4):
            p = h.propose(st, root, depth)
            assert isinstance(p, MergedTrie)
            ct = expand(p, 64, depth)
            toks, pars, lps = ct.tokens.tolist(), ct.parents.tolist(), ct.logprobs.tolist()
            assert len(toks) == 64
            seen, dep = set(), []
            for i, (t, q) in enumerate(zip(toks, pars)):
                assert -1 <= q < i and (q, t) not in seen
                seen.add((q, t))
                dep.append(1 if q < 0 else dep[q] + 1)
            assert max(dep) <= depth
            assert all(math.isfinite(x) and x <= 1e-6 for x in lps)
            merged += 1
    assert st.merged == merged


def test_factory_specs_resolve_to_the_hybrid(target_f32, random_drafter, tmp_path):
    """'suffix' and 'X+suffix' through bastion.factory.load_drafter (X: a DFlash folder)."""
    from drafting.dflash import save_dflash
    from drafting.hybrid import DEFAULT_MERGE
    from bastion.factory import load_drafter

    assert isinstance(load_drafter("suffix", target_f32), SuffixDrafter)
    save_dflash(random_drafter.model, tmp_path / "d")
    h = load_drafter(f"{tmp_path / 'd'}+suffix", target_f32)
    assert isinstance(h, HybridDrafter) and h.merge == DEFAULT_MERGE
    assert h.feature_layers == random_drafter.feature_layers
    assert h.max_depth == max(random_drafter.max_depth, h.suffix.max_depth)


def test_propose_cheap_is_the_suffix_tree_alone_and_keeps_dflash_state():
    """With the full drafter gated off, the hybrid still offers the suffix tree (never running
    DFlash); DFlash's queued context features reach its next real proposal."""
    rng = random.Random(3)
    dfl = FixedMarginals(random_marginals(4, 3, 50, rng))
    hyb = HybridDrafter(dfl, SuffixDrafter(max_depth=4))
    st = hyb.new_state()
    ctx = [7, 8, 9, 10, 11, 7, 8]
    hyb.extend(st, ctx, torch.zeros(len(ctx), 3))
    assert hyb.propose_cheap(st, 42, 4) is None  # 42 never occurred: nothing to offer
    cheap = hyb.propose_cheap(st, 9, 4)  # ... 9 10 11 7 8 seen before: the suffix continues it
    assert isinstance(cheap, SuffixTrie) and dfl.calls == []
    got = expand(cheap, 64, 4)
    assert got.tokens.tolist()[:1] == [10]
    ref = SuffixDrafter(max_depth=4)
    rs = ref.new_state()
    ref.extend(rs, ctx, None)
    want = expand(ref.propose(rs, 9, 4), 64, 4)
    assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
    hyb.extend(st, [9], torch.zeros(1, 3))
    hyb.propose(st, 10, 4)
    assert dfl.calls == [(10, 4)] and st.dflash["features"] == len(ctx) + 1
    assert Drafter.propose_cheap(dfl, st.dflash, 1, 4) is None  # the base default
