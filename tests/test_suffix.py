"""Suffix index and suffix drafter: counts, incrementality, global eviction, the lazy trie."""
from __future__ import annotations

import math
import random

import pytest
import torch

from drafting.proposal import CandidateTree
from drafting.suffix import SuffixDrafter, SuffixTrie
from drafting.suffix_index import SEPARATOR, GlobalSuffixIndex, SuffixAutomaton
from engine.tree import FixedBudgetPolicy, build_tree
from helpers import expand


#: Candidates materialised per proposal in these tests (the old suffix node cap).
CAP = 64


# -- brute-force references -------------------------------------------------------------

def naive_ends(text: list[int], s: list[int]) -> list[int]:
    """End positions of every occurrence of s in text."""
    k = len(s)
    return [e for e in range(k - 1, len(text)) if text[e - k + 1:e + 1] == s]


def naive_match_len(text: list[int], window: list[int]) -> int:
    for k in range(len(window), 0, -1):
        if naive_ends(text, window[-k:]):
            return k
    return 0


def naive_next(text: list[int], s: list[int]) -> dict[int, tuple[int, int]]:
    """token -> (count, most recent end position of s+token), over occurrences with a successor."""
    out: dict[int, tuple[int, int]] = {}
    for e in naive_ends(text, s):
        if e + 1 < len(text) and text[e + 1] >= 0:
            c = text[e + 1]
            n, _ = out.get(c, (0, -1))
            out[c] = (n + 1, e + 1)
    return out


def naive_paths(text: list[int], s: list[int], depth: int) -> dict[tuple[int, ...], float]:
    """Every continuation path up to `depth` with its log conditional probability."""
    out: dict[tuple[int, ...], float] = {}

    def rec(prefix: list[int], path: tuple[int, ...]) -> None:
        if len(path) == depth:
            return
        nxt = naive_next(text, prefix)
        total = sum(n for n, _ in nxt.values())
        for c, (n, _) in nxt.items():
            out[path + (c,)] = math.log(n / total)
            rec(prefix + [c], path + (c,))

    rec(list(s), ())
    return out


def tree_paths(ct: CandidateTree) -> dict[tuple[int, ...], float]:
    toks, pars, lps = ct.tokens.tolist(), ct.parents.tolist(), ct.logprobs.tolist()
    paths: list[tuple[int, ...]] = []
    out = {}
    for t, p, lp in zip(toks, pars, lps):
        path = (paths[p] if p >= 0 else ()) + (t,)
        paths.append(path)
        out[path] = lp
    return out


def assert_well_formed(ct: CandidateTree, max_depth: int, cap: int) -> None:
    m = ct.tokens.shape[0]
    assert ct.tokens.dtype == torch.long and ct.parents.dtype == torch.long
    assert ct.logprobs.dtype == torch.float32
    assert ct.parents.shape == (m,) and ct.logprobs.shape == (m,)
    assert m <= cap
    depth = []
    seen = set()
    for i, (t, p) in enumerate(zip(ct.tokens.tolist(), ct.parents.tolist())):
        assert -1 <= p < i
        depth.append(1 if p < 0 else depth[p] + 1)
        assert depth[-1] <= max_depth
        assert (p, t) not in seen  # siblings are distinct tokens
        seen.add((p, t))
    assert bool((ct.logprobs <= 1e-6).all())
    # Conditionals under one parent sum to at most 1.
    sums: dict[int, float] = {}
    for p, lp in zip(ct.parents.tolist(), ct.logprobs.tolist()):
        sums[p] = sums.get(p, 0.0) + math.exp(lp)
    assert all(v <= 1 + 1e-5 for v in sums.values())


def random_text(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Random tokens with copied chunks, so repeats of all lengths occur."""
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < 0.5:
            a = rng.randrange(len(out))
            out.extend(out[a:a + rng.randint(1, 12)])
        else:
            out.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))
    return out[:n]


# -- the automaton --------------------------------------------------------------------

def test_hand_made_counts():
    text = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    sam = SuffixAutomaton(horizon=8, tokens=text)
    state, length = sam.match([7, 7, 1, 2])
    assert length == 2
    cont = {c: (n, rec) for c, n, rec, _ in sam.continuations(state)}
    # "1 2" is followed by 3 at positions 2 and 8 and by 4 at position 5.
    assert cont == {3: (2, 8), 4: (1, 5)}
    # Continuations of "1 2 3": only "1" (the final "1 2 3" has no successor).
    s3 = sam.next[state][3]
    assert {c: n for c, n, _, _ in sam.continuations(s3)} == {1: 1}
    # Longest match is "2 3 1 2" for context [.., 2, 3, 1, 2].
    assert sam.match([9, 2, 3, 1, 2])[1] == 4
    assert sam.match([5])[1] == 0 and sam.match([])[1] == 0


@pytest.mark.parametrize("seed,vocab,horizon", [(0, 3, 4), (1, 2, 3), (2, 5, 8), (3, 1, 5), (4, 8, 1)])
def test_counts_match_brute_force(seed, vocab, horizon):
    rng = random.Random(seed)
    text = random_text(rng, 300, vocab)
    sam = SuffixAutomaton(horizon)
    for t in text:
        sam.append(t)
    n = len(text)
    checked = 0
    for start in range(n):
        for k in range(1, horizon + 1):
            if start + k > n:
                break
            s = text[start:start + k]
            state, length = sam.match(s)
            assert length == k  # every substring is found in full
            ends = naive_ends(text, s)
            assert sam.occ[state] == len(ends), (s, ends)
            assert sam.recent[state] == ends[-1]
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("seed,vocab,horizon", [(0, 2, 3), (1, 3, 6), (2, 1, 4), (3, 6, 2)])
def test_count_window_tracks_the_horizon_suffix(seed, vocab, horizon):
    """The bounded count update starts at the state of the length-min(H, n) suffix, never longer."""
    rng = random.Random(seed)
    sam = SuffixAutomaton(horizon)
    for i, t in enumerate(random_text(rng, 400, vocab)):
        sam.append(t)
        w, k = sam._win, min(horizon, i + 1)
        assert sam.length[sam.link[w]] < k <= sam.length[w]


def test_match_is_longest_suffix():
    rng = random.Random(7)
    text = random_text(rng, 400, 4)
    sam = SuffixAutomaton(16, text)
    for _ in range(200):
        window = [rng.randrange(5) for _ in range(rng.randint(1, 16))]
        state, length = sam.match(window)
        assert length == naive_match_len(text, window)
        if length:
            assert sam.occ[state] == len(naive_ends(text, window[-length:]))


def test_incremental_equals_rebuild():
    rng = random.Random(11)
    for trial in range(5):
        text = random_text(rng, 500, 6)
        whole = SuffixAutomaton(20, text)
        inc = SuffixAutomaton(20)
        i = 0
        while i < len(text):
            j = i + rng.randint(1, 40)
            inc.extend(text[i:j])
            i = j
        assert (inc.next, inc.link, inc.length, inc.occ, inc.recent) == \
            (whole.next, whole.link, whole.length, whole.occ, whole.recent)


def test_degenerate_run_is_exact_within_horizon():
    sam = SuffixAutomaton(horizon=5, tokens=[4] * 200)
    for k in range(1, 6):
        state, length = sam.match([4] * k)
        assert length == k
        assert sam.occ[state] == 200 - k + 1
        assert sam.recent[state] == 199


# -- the drafter ----------------------------------------------------------------------

def test_drafter_hand_made_tree():
    d = SuffixDrafter(max_depth=4)
    st = d.new_state()
    text = [1, 2, 3, 1, 2, 4, 1, 2, 3, 0, 1]
    d.extend(st, text, None)
    ct = expand(d.propose(st, root=2, max_depth=4), CAP, 4)  # context ".. 0 1 2": longest match "1 2"
    assert_well_formed(ct, 4, CAP)
    paths = tree_paths(ct)
    assert ct.tokens[0].item() == 3 and ct.parents[0].item() == -1  # most frequent first
    assert paths[(3,)] == pytest.approx(math.log(2 / 3))
    assert paths[(4,)] == pytest.approx(math.log(1 / 3))
    # "1 2 3" is followed by 1 and by 0 once each; 0 is more recent so it ranks first.
    assert paths[(3, 0)] == pytest.approx(math.log(0.5))
    assert paths[(3, 1)] == pytest.approx(math.log(0.5))
    assert ct.tokens.tolist().index(0) < ct.tokens.tolist().index(1)
    assert paths[(3, 1, 2, 4)] == pytest.approx(0.0)
    assert paths[(4, 1, 2, 3)] == pytest.approx(0.0)
    assert (3, 0, 1, 2) not in paths  # "1 2 3 0 1" only ends the text
    assert set(paths) == set(naive_paths(text, [1, 2], 4))


def test_recent_wins_ties():
    d = SuffixDrafter(max_depth=2)
    st = d.new_state()
    d.extend(st, [5, 1, 5, 2, 5, 3], None)
    ct = expand(d.propose(st, root=5, max_depth=2), CAP, 2)
    # 5 -> 1, 5 -> 2, 5 -> 3 once each: the most recent (3) comes first.
    assert ct.tokens[:3].tolist() == [3, 2, 1]
    assert ct.parents[:3].tolist() == [-1, -1, -1]
    assert ct.logprobs[:3].tolist() == pytest.approx([math.log(1 / 3)] * 3)


def test_drafter_matches_brute_force_paths():
    rng = random.Random(3)
    for _ in range(10):
        text = random_text(rng, 200, 5)
        root = rng.randrange(5)
        d = SuffixDrafter(max_depth=3, max_match_len=6)
        st = d.new_state()
        d.extend(st, text, None)
        ct = expand(d.propose(st, root, max_depth=3), 10_000, 3)
        window = (text + [root])[-6:]
        k = naive_match_len(text, window)
        want = naive_paths(text, window[-k:], 3) if k else {}
        got = tree_paths(ct)
        assert got.keys() == want.keys()
        for p, lp in want.items():
            assert got[p] == pytest.approx(lp, abs=1e-6)


def test_drafter_incremental_equals_rebuild_outputs():
    rng = random.Random(5)
    text = random_text(rng, 1500, 12)
    d = SuffixDrafter(max_depth=6, max_match_len=16)
    inc = d.new_state()
    d.extend(inc, text[:100], None)
    pos = 100
    while pos < len(text) - 1:
        root = text[pos]
        ct_inc = expand(d.propose(inc, root, max_depth=6), 32, 6)
        fresh = d.new_state()
        d.extend(fresh, text[:pos], None)
        ct_new = expand(d.propose(fresh, root, max_depth=6), 32, 6)
        for a, b in ((ct_inc.tokens, ct_new.tokens), (ct_inc.parents, ct_new.parents),
                     (ct_inc.logprobs, ct_new.logprobs)):
            assert torch.equal(a, b)
        assert_well_formed(ct_inc, 6, 32)
        step = rng.randint(1, 8)  # root plus some "accepted" tokens
        d.extend(inc, text[pos:pos + step], None)
        pos += step


def test_policy_cap_and_empty():
    # The suffix drafter has no node cap of its own: the tree builder's policy decides.
    d = SuffixDrafter(max_depth=15)
    st = d.new_state()
    d.extend(st, list(range(50)) * 3, None)
    trie = d.propose(st, root=10, max_depth=15)
    assert isinstance(trie, SuffixTrie) and not trie.empty
    ct = expand(trie, 8, 15)
    assert ct.tokens.tolist() == list(range(11, 19))  # one chain, cut at the builder's 8 nodes
    assert ct.logprobs.tolist() == [0.0] * 8
    assert expand(trie, 100, 15).tokens.tolist() == list(range(11, 26))  # the whole depth-15 chain
    ct = expand(d.propose(st, root=10, max_depth=3), CAP, 3)
    assert ct.tokens.tolist() == [11, 12, 13]
    assert d.propose(st, root=999, max_depth=5).empty  # unseen root
    assert d.propose(st, root=10, max_depth=0).empty
    assert expand(d.propose(st, root=999, max_depth=5), CAP, 5).tokens.numel() == 0
    # min_match_len=2: a 1-token match ("2") proposes nothing, a 2-token one ("1 2") does.
    d2 = SuffixDrafter(min_match_len=2)
    st2 = d2.new_state()
    d2.extend(st2, [1, 2, 3, 7], None)
    assert d2.propose(st2, root=2, max_depth=5).empty
    d2.extend(st2, [1], None)
    assert expand(d2.propose(st2, root=2, max_depth=5), CAP, 5).tokens.tolist() == [3, 7, 1]


def test_short_context_uses_the_whole_window():
    # Context (28 tokens) shorter than max_match_len (32): the match may reach back anywhere.
    d = SuffixDrafter(max_depth=2, max_match_len=32)
    st = d.new_state()
    d.extend(st, [5, 7, 8, 1, 2, 9, 6, 7, 8, 1, 2, 3] + list(range(30, 42)) + [5, 7, 8, 1], None)
    ct = expand(d.propose(st, root=2, max_depth=2), CAP, 2)  # "5 7 8 1 2" occurred once, followed by 9
    assert ct.tokens.tolist() == [9, 6]
    assert ct.logprobs.tolist() == [0.0, 0.0]


def test_smoothing_discounts_counts():
    d = SuffixDrafter(max_depth=2, smoothing=1.0)
    st = d.new_state()
    d.extend(st, [1, 2, 3, 1, 2, 4, 1], None)
    paths = tree_paths(expand(d.propose(st, root=2, max_depth=2), CAP, 2))
    # "1 2" -> 3 and 4 once each: 1 / (2 + 1); "1 2 3" -> 1 once: 1 / (1 + 1).
    assert paths == pytest.approx({(4,): math.log(1 / 3), (3,): math.log(1 / 3),
                                   (4, 1): math.log(1 / 2), (3, 1): math.log(1 / 2)})


def test_empty_proposal_builds_root_only_tree():
    tree = build_tree(5, SuffixTrie((), (), 0.0, 5), FixedBudgetPolicy(8), max_depth=5)
    assert tree.tokens.tolist() == [5] and tree.a_hat == pytest.approx(1.0)


def test_build_tree_consumes_the_trie():
    d = SuffixDrafter(max_depth=15)
    st = d.new_state()
    chain = [1, 2, 3, 9, 9, 0, 5]
    # After "1 2": "3 9 9 0 5" three times, "4 8" once.
    d.extend(st, chain + chain + [1, 2, 4, 8] + chain + [6, 1], None)
    ct = expand(d.propose(st, root=2, max_depth=5), CAP, 5)
    assert_well_formed(ct, 5, CAP)
    tree = build_tree(2, d.propose(st, root=2, max_depth=5), FixedBudgetPolicy(8), max_depth=5)
    assert tree.size == 8
    toks, pars, deps = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    assert toks[0] == 2 and pars[0] == -1 and deps[0] == 0
    for i in range(1, tree.size):  # prefix-closed, parents first, depth consistent
        assert 0 <= pars[i] < i and deps[i] == deps[pars[i]] + 1 and deps[i] <= 5
    # The chosen (first-child) path is the most frequent continuation.
    node, greedy = 0, []
    while True:
        firsts = [i for i in range(1, tree.size) if pars[i] == node]
        if not firsts:
            break
        node = firsts[0]
        greedy.append(toks[node])
    assert greedy == [3, 9, 9, 0, 5]
    assert toks == [2, 3, 9, 9, 0, 5, 4, 8]
    assert tree.children()[0] == {3: 1, 4: 6}
    assert tree.a_hat == pytest.approx(1 + 5 * 0.75 + 2 * 0.25)


# -- the global index -----------------------------------------------------------------

def test_global_index_limit_and_lru():
    g = GlobalSuffixIndex(max_tokens=100, horizon=8, low_water=1.0)
    ids = [g.add([i] * 30) for i in range(3)]
    assert g.total_tokens == 90 and g.request_ids() == ids and g.rebuilds == 0
    r3 = g.add([7] * 30)  # 120 > 100: evict the oldest request only
    assert g.request_ids() == ids[1:] + [r3]
    assert g.total_tokens == 90 <= g.max_tokens and g.rebuilds == 1
    # The evicted request's tokens are gone from the automaton, the others are counted.
    assert g.automaton.match([0])[1] == 0
    s, length = g.automaton.match([1])
    assert length == 1 and g.automaton.occ[s] == 30
    big = g.add(list(range(10, 160)))  # longer than the limit: keeps its last 100 tokens
    assert g.request_ids() == [big] and g.tokens(big) == list(range(60, 160))
    assert g.total_tokens == 100


def test_global_index_low_water_and_separators():
    g = GlobalSuffixIndex(max_tokens=100, horizon=8, low_water=0.5)
    rng = random.Random(0)
    for _ in range(40):
        g.add([rng.randrange(20) for _ in range(rng.randint(1, 30))])
        assert g.total_tokens <= 100
        assert g.total_tokens == sum(len(g.tokens(r)) for r in g.request_ids())
        assert g.automaton.n == g.total_tokens + len(g)  # one separator per request
    # No continuation ever yields the separator.
    sam = g.automaton
    assert all(c != SEPARATOR for s in range(sam.num_states) for c, *_ in sam.continuations(s))
    with pytest.raises(ValueError):
        g.add([1, -3])


def test_drafter_global_index_and_merge():
    d = SuffixDrafter(max_depth=4, global_tokens=1000)
    a = d.new_state()
    d.extend(a, [100, 101], None)  # prompt
    d.extend(a, [5, 6, 7, 8], None)  # output
    assert d.finish(a, final_tokens=[9]) is not None
    assert d.finish(a) is None  # once only
    assert d.global_index.tokens(d.global_index.request_ids()[0]) == [5, 6, 7, 8, 9]
    # A new request whose own text has nothing: the global index proposes.
    b = d.new_state()
    d.extend(b, [200, 201], None)
    ct = expand(d.propose(b, root=6, max_depth=4), CAP, 4)
    assert ct.tokens.tolist() == [7, 8, 9] and ct.parents.tolist() == [-1, 0, 1]
    # Both sources match: mixture weighted by match length (request 2 tokens, global 1).
    d.extend(b, [5, 6, 3], None)
    ct = expand(d.propose(b, root=5, max_depth=1), CAP, 1)
    paths = tree_paths(ct)
    # request "5" -> 6 and global "5" -> 6, each with probability 1: the mixture gives 1.
    assert paths == pytest.approx({(6,): 0.0})
    ct = expand(d.propose(b, root=6, max_depth=2), CAP, 2)
    # request "6" -> 3 and global "6" -> 7, both matched with length 1: equal weights.
    paths = tree_paths(ct)
    assert paths[(3,)] == pytest.approx(math.log(0.5))
    assert paths[(7,)] == pytest.approx(math.log(0.5))
    assert paths[(7, 8)] == pytest.approx(0.0)
    assert ct.tokens[0].item() == 3  # tie: the request index's (recent) text first
    assert_well_formed(ct, 2, CAP)


def test_drafter_options_validated():
    with pytest.raises(ValueError):
        SuffixDrafter(min_match_len=0)
    with pytest.raises(ValueError):
        SuffixDrafter(max_match_len=4, min_match_len=5)
    with pytest.raises(ValueError):
        SuffixDrafter(global_tokens=-1)
    d = SuffixDrafter()
    assert d.feature_layers == () and not d.needs_features and d.max_depth == 15
    with pytest.raises(ValueError):
        d.extend(d.new_state(), [-2], None)
