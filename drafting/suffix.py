"""Training-free suffix drafter: candidate trees from repeated text.

Each request owns a suffix automaton over its prompt and committed output; the drafter
optionally owns a bounded global index over recently finished requests' outputs
(`drafting.suffix_index`). Per step it matches the longest suffix (at most
`max_match_len` tokens, root last) of the context in each index and grows a candidate
proposal over the continuations of the matched occurrences, scored by their counts: a
lazy `SuffixTrie` (a `ChildSource`) whose children are read from the automata only when
the tree builder (`engine.tree.build_tree`) grows that node, so the conditional
structure is kept and the stopping policy alone decides the tree's size.

Prior art read for understanding only: SuffixDecoding (Oliaro et al. 2024, as in
ArcticInference), llama.cpp lookup decoding, transformers' prompt-lookup decoding.

Probabilities. For a tree node reached by path P after the matched string S, a source
(request or global index) whose automaton still holds S P gives the empirical
conditional q_src(c) = n(S P c) / (N + smoothing), with n the occurrence count and
N = sum over c of n(S P c). With both sources active the node's distribution is the
mixture q(c) = sum_src w_src q_src(c), weights proportional to each source's match
length at the root (a longer match is a more specific context) and renormalised over
the sources that still have continuations at that node. Ties are broken by recency:
the candidate whose most recent occurrence (request index first, then global) ends
later comes first, so recent text wins when frequencies tie.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from drafting.base import Drafter
from drafting.proposal import Child, ChildSource
from drafting.suffix_index import GlobalSuffixIndex, SuffixAutomaton

@dataclass
class SuffixState:
    """Per-request drafter state.

    tokens: committed context (prompt then output), the tokens in the target's KV cache.
    index: suffix automaton over `tokens`.
    prompt_len: length of the first `extend` (the prompt); None before it.
    finished: set by `SuffixDrafter.finish` so an output is added to the global index once.
    """

    tokens: list[int]
    index: SuffixAutomaton
    prompt_len: int | None = None
    finished: bool = False
    #: statistics: proposals made and proposals that found a match.
    proposals: int = 0
    matched: int = 0


# One source at a tree node: (automaton, state), or None when the path left that index.
_Src = tuple[SuffixAutomaton, int] | None


def _one_source(sam: SuffixAutomaton, s: int, smoothing: float, limit: int) -> list[tuple[float, int, int]]:
    """Next tokens after state `s` of one index: [(log q(c), c, child state)], best first.

    q(c) = n(c) / (sum n + smoothing); ties broken by the most recent occurrence.
    Keeps at most `limit` entries; [] when `s` has no continuation.
    """
    trans = sam.next[s]
    if len(trans) == 1:  # a single continuation (the common case inside a long match)
        (c, w), = trans.items()
        if c < 0:
            return []
        n = sam.occ[w]
        return [(math.log(n / (n + smoothing)) if smoothing else 0.0, c, w)]
    items = sam.continuations(s)
    if not items:
        return []
    denom = sum(it[1] for it in items) + smoothing
    if len(items) > limit:
        items = heapq.nlargest(limit, items, key=lambda it: (it[1], it[2]))
    else:
        items.sort(key=lambda it: (it[1], it[2]), reverse=True)
    return [(math.log(cnt / denom), c, w) for c, cnt, _, w in items]


def _children(srcs: tuple[_Src, ...], weights: tuple[float, ...], smoothing: float, limit: int
              ) -> list[tuple[float, int, tuple[_Src, ...]]]:
    """Next-token candidates of one tree node, best first.

    srcs: per source, (automaton, state) or None. weights: per source mixture weight.
    limit: keep at most this many children.
    Returns [(log q(c), c, child srcs)] sorted by q descending, ties by recency
    (earlier sources first). Sources without continuations drop out of the mixture.
    """
    nsrc = len(srcs)
    active = [k for k in range(nsrc) if srcs[k] is not None]
    if len(active) == 1:  # fast path: the mixture is that source's distribution
        k = active[0]
        sam, s = srcs[k]
        res = _one_source(sam, s, smoothing, limit)
        if nsrc == 1:
            return [(lp, c, ((sam, w),)) for lp, c, w in res]
        if nsrc == 2:
            if k == 0:
                return [(lp, c, ((sam, w), None)) for lp, c, w in res]
            return [(lp, c, (None, (sam, w))) for lp, c, w in res]
        return [(lp, c, tuple((sam, w) if j == k else None for j in range(nsrc))) for lp, c, w in res]

    if nsrc == 2:  # both active: first the common case of one shared continuation
        (sam0, s0), (sam1, s1) = srcs
        t0, t1 = sam0.next[s0], sam1.next[s1]
        if len(t0) == 1 and len(t1) == 1:
            (c, w0), = t0.items()
            (c1, w1), = t1.items()
            if c == c1 and c >= 0:
                if smoothing:
                    n0, n1 = sam0.occ[w0], sam1.occ[w1]
                    w = weights[0] + weights[1]
                    q = (weights[0] * n0 / (n0 + smoothing) + weights[1] * n1 / (n1 + smoothing)) / w
                    lp = math.log(q)
                else:
                    lp = 0.0
                return [(lp, c, ((sam0, w0), (sam1, w1)))]

    # General mixture. probs/recs/kids are keyed by token; recency compares per source in order.
    probs: dict[int, float] = {}
    recs: dict[int, list[int]] = {}
    kids: dict[int, list[_Src]] = {}
    per_src = []
    wsum = 0.0
    for k in active:
        sam, s = srcs[k]
        trans = [(c, w) for c, w in sam.next[s].items() if c >= 0]
        if trans:
            occ = sam.occ
            per_src.append((k, sam, trans, sum(occ[w] for _, w in trans) + smoothing))
            wsum += weights[k]
    if not per_src:
        return []
    for k, sam, trans, denom in per_src:
        scale = weights[k] / (wsum * denom)
        occ, recent = sam.occ, sam.recent
        for c, w in trans:
            if c in probs:
                probs[c] += occ[w] * scale
            else:
                probs[c] = occ[w] * scale
                recs[c] = [-1] * nsrc
                kids[c] = [None] * nsrc
            recs[c][k] = recent[w]
            kids[c][k] = (sam, w)
    key = lambda c: (probs[c], recs[c])  # noqa: E731
    if len(probs) > limit:
        order = heapq.nlargest(limit, probs, key=key)
    else:
        order = sorted(probs, key=key, reverse=True)
    return [(math.log(probs[c]), c, tuple(kids[c])) for c in order]


class SuffixTrie(ChildSource):
    """The merged continuation trie of the matched indexes, expanded on demand.

    A node's reference is its per-source (automaton, state) tuple (None for a source the
    path has left); `children` computes the node's mixture conditionals from the automata
    (`_children`), so only the nodes the tree builder grows are ever scanned.
    srcs / weights: per matched source at the root, its (automaton, state) and mixture
    weight; empty `srcs` means no match (no children). max_depth: deepest node depth.
    The automata must not change while the trie is read (the engine builds the tree
    before it extends the drafter's state).
    """

    def __init__(self, srcs: tuple[_Src, ...], weights: tuple[float, ...], smoothing: float, max_depth: int):
        self.root_ref = srcs
        self.weights = weights
        self.smoothing = smoothing
        self.max_depth = max_depth

    def children(self, ref: tuple[_Src, ...], depth: int, limit: int) -> list[Child]:
        if depth >= self.max_depth or not ref or limit < 1:
            return []
        return _children(ref, self.weights, self.smoothing, limit)

    @property
    def empty(self) -> bool:
        return not self.root_ref or self.max_depth < 1


class SuffixDrafter(Drafter):
    """Model-free drafter proposing continuations seen earlier in the context or in recent outputs.

    max_depth: deepest candidate depth (default 15).
    max_match_len: longest context suffix matched, root included (M), default 32.
    min_match_len: a source whose longest match is shorter proposes nothing, default 1.
    global_tokens: size limit in tokens of the global index over finished requests'
      outputs; 0 (default) turns it off.
    global_low_water: eviction low-water fraction of the global index (see
      `GlobalSuffixIndex`).
    smoothing: pseudo-count added to each node's total (q = n / (N + smoothing));
      0 (default) gives the raw empirical conditionals.

    Needs no target features (`feature_layers = ()`); `extend` ignores `features`.
    Raises ValueError on inconsistent options.
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(self, max_depth: int = 15, max_match_len: int = 32,
                 min_match_len: int = 1, global_tokens: int = 0, global_low_water: float = 0.75,
                 smoothing: float = 0.0) -> None:
        if max_depth < 1 or max_match_len < 1:
            raise ValueError("max_depth and max_match_len must be >= 1")
        if not 1 <= min_match_len <= max_match_len:
            raise ValueError("need 1 <= min_match_len <= max_match_len")
        if global_tokens < 0 or smoothing < 0:
            raise ValueError("global_tokens and smoothing must be >= 0")
        self.max_depth = int(max_depth)
        self.max_match_len = int(max_match_len)
        self.min_match_len = int(min_match_len)
        self.smoothing = float(smoothing)
        #: counting horizon: the longest string ever queried is a match plus a full-depth path.
        self.horizon = self.max_match_len + self.max_depth
        self.global_index: GlobalSuffixIndex | None = (
            GlobalSuffixIndex(global_tokens, self.horizon, global_low_water) if global_tokens > 0 else None)

    # -- Drafter interface -------------------------------------------------------------

    def new_state(self) -> SuffixState:
        return SuffixState(tokens=[], index=SuffixAutomaton(self.horizon))

    def extend(self, state: SuffixState, token_ids: list[int], features: torch.Tensor | None = None) -> None:
        """Append committed tokens to the request's index (incremental; features ignored).

        The first call's tokens are taken as the prompt (see `finish`).
        Raises ValueError on a negative token id.
        """
        toks = [int(t) for t in token_ids]
        if toks and min(toks) < 0:
            raise ValueError("token ids must be >= 0")
        if state.prompt_len is None:
            state.prompt_len = len(toks)
        state.tokens.extend(toks)
        state.index.extend(toks)

    def propose(self, state: SuffixState, root: int, max_depth: int) -> SuffixTrie:
        """The continuation trie of `root` (committed, not yet in `state`).

        Returns a SuffixTrie of depth <= min(max_depth, self.max_depth) whose conditionals
        are log q; it is `empty` when no index matches at least `min_match_len` tokens.
        The tree builder's stopping policy decides how much of it is used.
        """
        state.proposals += 1
        depth = min(int(max_depth), self.max_depth)
        if depth <= 0:
            return SuffixTrie((), (), self.smoothing, 0)
        m = self.max_match_len
        window = state.tokens[max(0, len(state.tokens) - (m - 1)):] if m > 1 else []
        window.append(int(root))

        srcs: list[_Src] = []
        lens: list[float] = []
        s, length = state.index.match(window)
        if length >= self.min_match_len:
            srcs.append((state.index, s))
            lens.append(float(length))
        g = self.global_index
        if g is not None and g.total_tokens:
            s, length = g.automaton.match(window)
            if length >= self.min_match_len:
                srcs.append((g.automaton, s))
                lens.append(float(length))
        if not srcs:
            return SuffixTrie((), (), self.smoothing, depth)
        state.matched += 1
        return SuffixTrie(tuple(srcs), tuple(lens), self.smoothing, depth)

    # -- global index ----------------------------------------------------------------

    def finish(self, state: SuffixState, final_tokens: list[int] | tuple[int, ...] = ()) -> int | None:
        """Add the request's output (committed tokens after the prompt, then `final_tokens`,
        e.g. the last sampled token that never entered the cache) to the global index.

        Returns the global request id, or None when the index is off, the output is
        empty or the state was already finished. Idempotent per state.
        """
        if state.finished:
            return None
        state.finished = True
        if self.global_index is None:
            return None
        start = state.prompt_len or 0
        return self.global_index.add(state.tokens[start:] + [int(t) for t in final_tokens])
