"""DFlash + suffix hybrid drafter: one proposal merged from a model and a suffix index (issue 9).

`HybridDrafter(dflash, suffix, merge)` runs both drafters every step and merges their
proposals into one. When the suffix index has nothing to propose, the DFlash marginals
go to the tree builder unchanged, so the hybrid costs DFlash exactly what DFlash alone
costs on text that does not repeat. Otherwise, by `merge`:

``mix-tree`` (default) and ``max-tree``: the union of both candidate trees, grown lazily.
    The DFlash marginals define an implicit product tree (every node at depth d-1 has
    the row-d tokens as children, q_d(c)); the suffix drafter's CandidateTree gives
    conditionals q_s(c | path) on its own paths. A merged node whose path is still a
    suffix-tree node with children gets the children of both; its conditional is
        mix-tree:  q(c) = w q_s(c | path) + (1 - w) q_d(c)
        max-tree:  q(c) = max(q_s(c | path), q_d(c))
    and a node whose path left the suffix tree gets the DFlash row alone (renormalised
    mixture over the sources that still propose). The merged tree is grown best-first
    by path probability up to `max_candidates` nodes without materialising the product
    tree: each expanded node keeps two sorted streams (its suffix children, rescored, and
    the shared DFlash row minus those tokens), and a node's children are listed only when
    it is popped for expansion, so leaves cost nothing. The top-1 chain (the best child
    at every depth) is completed to full depth afterwards, so 'chain' mode keeps its depth.
    Result: a CandidateTree (parents before children, log conditionals).

``mix-depth``: per-depth mixing of marginals. The suffix tree is reduced to position-wise
    marginals m_d(c) = sum of path probabilities of its depth-d nodes with token c, and
    row d becomes w m_d(c) + (1 - w) q_d(c) (top K kept), for depths where the suffix
    tree has nodes. Cheapest, but drops the suffix tree's conditional structure.

Skipping DFlash. With `skip_dflash_match = L > 0`, a step whose suffix match (context
suffix ending at the root, as the suffix drafter matches it) is at least L tokens long
returns the suffix tree alone and does not run DFlash; DFlash's pending context features
are consumed by its next proposal, so its state stays consistent. This saves the drafter
forward where copying is all but certain.

Measured in docs/suffix.md (tokens/s decides the default).
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from drafting.base import CandidateTree, Drafter, Marginals, Proposal
from drafting.suffix import SuffixDrafter, SuffixState

MERGES = ("mix-tree", "max-tree", "mix-depth")
DEFAULT_MERGE = "mix-tree"


@dataclass
class HybridState:
    """Per-request state: both drafters' states, plus counters: proposals made, how many
    were merged (suffix match and DFlash), how many skipped DFlash, and seconds spent in
    DFlash, in the suffix drafter and in merging."""

    dflash: Any
    suffix: SuffixState
    proposals: int = 0
    merged: int = 0
    skipped: int = 0
    dflash_s: float = 0.0
    suffix_s: float = 0.0
    merge_s: float = 0.0


class HybridDrafter(Drafter):
    """DFlash marginals merged with suffix-index candidate trees (see the module docstring).

    dflash: a Drafter returning Marginals (normally `DFlashDrafter`); suffix: a SuffixDrafter.
    merge: one of MERGES. weight: w, the suffix source's mixture weight in (0, 1]
    (mix-tree, mix-depth). max_candidates: node cap of a merged CandidateTree (the chain
    completion may add up to max_depth more); it should cover the largest tree the
    controller builds. skip_dflash_match: suffix match length from which DFlash is not
    run (0: always run it).
    Raises ValueError on an unknown merge, a weight outside (0, 1] or a negative length.
    """

    def __init__(self, dflash: Drafter, suffix: SuffixDrafter, merge: str = DEFAULT_MERGE,
                 weight: float = 0.9, max_candidates: int = 64, skip_dflash_match: int = 0) -> None:
        if merge not in MERGES:
            raise ValueError(f"unknown merge '{merge}' (choose from {', '.join(MERGES)})")
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        if max_candidates < 1:
            raise ValueError("max_candidates must be >= 1")
        if skip_dflash_match < 0:
            raise ValueError("skip_dflash_match must be >= 0")
        self.dflash = dflash
        self.suffix = suffix
        self.merge = merge
        self.weight = float(weight)
        self.max_candidates = int(max_candidates)
        self.skip_dflash_match = int(skip_dflash_match)
        self.feature_layers = tuple(dflash.feature_layers)
        self.max_depth = max(dflash.max_depth, suffix.max_depth)

    # -- Drafter interface -------------------------------------------------------------

    def new_state(self) -> HybridState:
        return HybridState(dflash=self.dflash.new_state(), suffix=self.suffix.new_state())

    def extend(self, state: HybridState, token_ids: list[int], features: torch.Tensor | None) -> None:
        """Tokens go to both drafters, features to DFlash only."""
        self.dflash.extend(state.dflash, token_ids, features)
        self.suffix.extend(state.suffix, token_ids, None)

    def finish(self, state: HybridState, final_tokens: list[int] | tuple[int, ...] = ()) -> Any:
        """Forwards to both; returns the suffix drafter's result (its global request id or None)."""
        self.dflash.finish(state.dflash, final_tokens)
        return self.suffix.finish(state.suffix, final_tokens)

    def propose_cheap(self, state: HybridState, root: int, max_depth: int) -> Proposal | None:
        """The suffix drafter's candidate tree alone (about 0.1 ms), or None without a match.

        DFlash's pending context features stay queued and are consumed by its next proposal.
        """
        depth = min(int(max_depth), self.suffix.max_depth)
        t0 = time.perf_counter()
        ct = self.suffix.propose(state.suffix, root, depth)
        state.suffix_s += time.perf_counter() - t0
        return ct if ct.tokens.numel() else None

    def propose(self, state: HybridState, root: int, max_depth: int) -> Proposal:
        """Both proposals, merged: Marginals when the suffix index has no match (DFlash
        alone, or nothing when `max_depth` exceeds only the DFlash depth), else a
        CandidateTree (tree merges) or Marginals (mix-depth)."""
        state.proposals += 1
        depth = min(int(max_depth), self.max_depth)
        clock = time.perf_counter
        t0 = clock()
        ct = self.suffix.propose(state.suffix, root, min(depth, self.suffix.max_depth))
        t1 = clock()
        state.suffix_s += t1 - t0
        if ct.tokens.numel() and self.skip_dflash_match and self._match_len(state.suffix, root) >= self.skip_dflash_match:
            state.skipped += 1
            return ct
        marg = self.dflash.propose(state.dflash, root, min(depth, self.dflash.max_depth))
        t2 = clock()
        state.dflash_s += t2 - t1
        if ct.tokens.numel() == 0:
            return marg
        if marg.depth == 0:
            return ct
        marg = marg.to_host()  # the merges walk host lists; one transfer when DFlash runs on a GPU
        state.merged += 1
        if self.merge == "mix-depth":
            out = mix_depth(marg, ct, self.weight)
        else:
            out = merge_trees(marg, ct, self.merge == "max-tree", self.weight, self.max_candidates, depth)
        state.merge_s += clock() - t2
        return out

    def _match_len(self, st: SuffixState, root: int) -> int:
        """Length of the request index's longest match of the context suffix ending at `root`."""
        m = self.suffix.max_match_len
        window = st.tokens[max(0, len(st.tokens) - (m - 1)):] if m > 1 else []
        window.append(int(root))
        return st.index.match(window)[1]


# -- per-depth mixing -------------------------------------------------------------------

def suffix_depth_marginals(ct: CandidateTree) -> list[dict[int, float]]:
    """Per depth d (index d-1), token -> total path probability of the tree's depth-d nodes."""
    toks, pars, lps = ct.tokens.tolist(), ct.parents.tolist(), ct.logprobs.tolist()
    pp: list[float] = []
    dep: list[int] = []
    out: list[dict[int, float]] = []
    for t, p, lp in zip(toks, pars, lps):
        q = math.exp(lp) * (1.0 if p < 0 else pp[p])
        d = 0 if p < 0 else dep[p] + 1
        pp.append(q)
        dep.append(d)
        if d == len(out):
            out.append({})
        row = out[d]
        row[t] = row.get(t, 0.0) + q
    return out


def mix_depth(marg: Marginals, ct: CandidateTree, weight: float) -> Marginals:
    """Row d := w m_d + (1 - w) q_d over the union of tokens, top K kept (K = marg's width),
    for the depths where the suffix tree has nodes; other rows unchanged. marg: [D, K]."""
    masses = suffix_depth_marginals(ct)
    D, K = marg.token_ids.shape
    rows = min(D, len(masses))
    E = max(len(m) for m in masses[:rows])
    ext_ids = torch.zeros((rows, E), dtype=torch.long)
    ext_p = torch.zeros((rows, E), dtype=torch.float32)
    for d in range(rows):
        m = masses[d]
        ext_ids[d, :len(m)] = torch.tensor(list(m.keys()), dtype=torch.long)
        ext_p[d, :len(m)] = torch.tensor(list(m.values()), dtype=torch.float32)
    ids = marg.token_ids[:rows]
    p = marg.logprobs[:rows].float().exp() * (1.0 - weight)
    eq = ids[:, :, None] == ext_ids[:, None, :]          # [rows, K, E]
    eq &= (ext_p > 0)[:, None, :]
    p = p + weight * (eq.float() * ext_p[:, None, :]).sum(-1)
    ext_p = torch.where(eq.any(1), torch.zeros_like(ext_p), ext_p * weight)
    all_ids = torch.cat([ids, ext_ids], dim=1)
    all_p = torch.cat([p, ext_p], dim=1)
    vals, idx = torch.topk(all_p, K, dim=1)
    new_ids = torch.gather(all_ids, 1, idx)
    new_lp = torch.log(vals.clamp_min(1e-30))
    return Marginals(torch.cat([new_ids, marg.token_ids[rows:]]),
                     torch.cat([new_lp, marg.logprobs[rows:].float()]))


# -- union of candidate trees -------------------------------------------------------------

def merge_trees(marg: Marginals, ct: CandidateTree, use_max: bool, weight: float, cap: int,
                max_depth: int) -> CandidateTree:
    """Best-first growth of the merged tree (see the module docstring) to `cap` nodes,
    depth <= max_depth, then completion of the top-1 chain.

    marg: DFlash marginals [D, K] (rows sorted). ct: the suffix CandidateTree (M > 0).
    use_max: max-tree scores, else mix-tree with suffix weight `weight`.
    Returns a CandidateTree; logprobs are the merged conditional log-scores.

    Each node, when added, pushes the first entry of each of its two child streams
    (stream 0: its suffix children rescored, sorted; stream 1: its DFlash row minus those
    tokens); popping an entry adds that child and pushes the stream's next entry. Node
    k + 1 in the per-node lists is candidate k (slot 0 is the root).
    """
    D = marg.depth
    width = min(marg.token_ids.shape[1], cap)
    rtoks: list[list[int]] = marg.token_ids[:, :width].tolist()
    rlps: list[list[float]] = marg.logprobs[:, :width].float().tolist()
    rdict: dict[int, dict[int, float]] = {}  # lazily: row -> token -> log q_d

    # Suffix tree children: suffix index (-1 root) -> [(log q_s, token, suffix index)].
    skids: dict[int, list[tuple[float, int, int]]] = {}
    for i, (t, p, lp) in enumerate(zip(ct.tokens.tolist(), ct.parents.tolist(), ct.logprobs.tolist())):
        skids.setdefault(p, []).append((lp, t, i))

    log_w = math.log(weight)
    log_1w = math.log1p(-weight) if weight < 1.0 else -math.inf
    b_off = 0.0 if use_max else log_1w
    exp, log1p = math.exp, math.log1p

    # Per node slot (0 = root): token, parent slot, log conditional, path score, depth,
    # suffix index (None once the path left the suffix tree), stream A list, stream B skip set.
    toks, pars, lps = [0], [-1], [0.0]
    path, dep = [0.0], [0]
    sref: list[int | None] = [-1]
    a_lists: list[list | None] = [None]
    b_skip: list[frozenset | None] = [None]
    first_child: dict[int, int] = {}
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, tie, slot, stream, rank)
    tie = 0

    def open_node(n: int) -> None:
        """Set node n's streams and push their first entries (children at depth dep[n] + 1)."""
        nonlocal tie
        d = dep[n]
        if d >= max_depth:
            return
        r = sref[n]
        kids = skids.get(r) if r is not None else None
        base = path[n]
        if kids:
            if d < D:
                qd = rdict.get(d)
                if qd is None:
                    qd = rdict[d] = dict(zip(rtoks[d], rlps[d]))
                scored = []
                for lp_s, t, i in kids:
                    lp_d = qd.get(t)
                    if use_max:
                        s = lp_s if lp_d is None or lp_s >= lp_d else lp_d
                    elif lp_d is None:
                        s = log_w + lp_s
                    else:
                        a, b = log_w + lp_s, log_1w + lp_d
                        s = (a + log1p(exp(b - a))) if a >= b else (b + log1p(exp(a - b)))
                    scored.append((s, t, i))
                scored.sort(reverse=True)
                skip = frozenset(t for _, t, _ in kids)
            else:
                scored = sorted(kids, reverse=True)
                skip = None
            a_lists[n] = scored
            heapq.heappush(heap, (-(base + scored[0][0]), tie, n, 0, 0))
            tie += 1
            if d >= D:
                return
            b_skip[n] = skip
            row = rtoks[d]
            k = 0
            while k < width and row[k] in skip:
                k += 1
            if k < width:
                heapq.heappush(heap, (-(base + b_off + rlps[d][k]), tie, n, 1, k))
                tie += 1
        elif d < D and width:
            heapq.heappush(heap, (-(base + rlps[d][0]), tie, n, 1, 0))
            tie += 1

    def add(n: int, stream: int, rank: int, score: float) -> int:
        """Append the rank-th child of slot n from `stream`; push that stream's next entry."""
        nonlocal tie
        if stream == 0:
            lp, t, si = a_lists[n][rank]
            a = a_lists[n]
            if rank + 1 < len(a):
                heapq.heappush(heap, (-(path[n] + a[rank + 1][0]), tie, n, 0, rank + 1))
                tie += 1
        else:
            d = dep[n]
            skip = b_skip[n]
            off = b_off if skip is not None else 0.0
            t, lp, si = rtoks[d][rank], off + rlps[d][rank], None
            row = rtoks[d]
            k = rank + 1
            if skip:
                while k < width and row[k] in skip:
                    k += 1
            if k < width:
                heapq.heappush(heap, (-(path[n] + off + rlps[d][k]), tie, n, 1, k))
                tie += 1
        c = len(toks)
        toks.append(t)
        pars.append(n)
        lps.append(lp)
        path.append(score)
        dep.append(dep[n] + 1)
        sref.append(si)
        a_lists.append(None)
        b_skip.append(None)
        if n not in first_child:
            first_child[n] = c
        return c

    open_node(0)
    limit = cap + 1
    while heap and len(toks) < limit:
        neg, _, n, stream, rank = heapq.heappop(heap)
        open_node(add(n, stream, rank, -neg))

    # Complete the top-1 chain to full depth. A node's best child is its first emitted one;
    # a node without children yet has its streams' heads at the top of the heap's entries
    # for it, so take the better head directly.
    n = 0
    while dep[n] < max_depth:
        c = first_child.get(n)
        if c is None:
            heads = [e for e in heap if e[2] == n]
            if not heads:
                break
            neg, _, _, stream, rank = min(heads)
            c = add(n, stream, rank, -neg)
            open_node(c)
        n = c

    return CandidateTree(
        tokens=torch.tensor(toks[1:], dtype=torch.long),
        parents=torch.tensor([p - 1 for p in pars[1:]], dtype=torch.long),
        logprobs=torch.tensor(lps[1:], dtype=torch.float32),
    )
