"""DFlash + suffix hybrid drafter: one proposal merged from a model and a suffix index.

`HybridDrafter(dflash, suffix, merge)` runs both drafters every step and merges their
proposals into one. When the suffix index has nothing to propose, the DFlash marginals
go to the tree builder unchanged, so the hybrid costs DFlash exactly what DFlash alone
costs on text that does not repeat. Otherwise the proposal is a `MergedTrie`, the union
of both candidate trees, expanded lazily by the tree builder:

The DFlash marginals define an implicit product tree (every node at depth d-1 has the
row-d tokens as children, q_d(c)); the suffix drafter's trie gives conditionals
q_s(c | path) on its own paths. A merged node whose path is still a suffix-trie node with
children gets the children of both; its conditional is
    mix-tree (default):  q(c) = w q_s(c | path) + (1 - w) q_d(c)
    max-tree:            q(c) = max(q_s(c | path), q_d(c))
and a node whose path left the suffix trie gets the DFlash row alone (the renormalised
mixture over the sources that still propose). Only the nodes the builder grows are
expanded, so the policy's node cap is the only cap.

(A third merge, per-depth mixing of the suffix trie into the marginals, lost to both tree
merges on tau and tokens/s, docs/suffix.md, and was removed.)

Skipping DFlash. With `skip_dflash_match = L > 0`, a step whose suffix match (context
suffix ending at the root, as the suffix drafter matches it) is at least L tokens long
returns the suffix trie alone and does not run DFlash; DFlash's pending context features
are consumed by its next proposal, so its state stays consistent. This saves the drafter
forward where copying is all but certain.

Measured in docs/suffix.md (tokens/s decides the default).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from drafting.base import Drafter
from drafting.proposal import Child, ChildSource, Marginals, Proposal
from drafting.suffix import SuffixDrafter, SuffixState, SuffixTrie

MERGES = ("mix-tree", "max-tree")
#: Suffix children read per merged node before rescoring.
SUFFIX_CHILDREN = 64
DEFAULT_MERGE = "mix-tree"


@dataclass
class HybridState:
    """Per-request state: both drafters' states, plus counters: proposals made, how many
    were merged (suffix match and DFlash), how many skipped DFlash, and seconds spent in
    DFlash and in the suffix drafter (merging happens lazily inside the tree builder)."""

    dflash: Any
    suffix: SuffixState
    proposals: int = 0
    merged: int = 0
    skipped: int = 0
    dflash_s: float = 0.0
    suffix_s: float = 0.0


class HybridDrafter(Drafter):
    """DFlash marginals merged with suffix-index candidate trees (see the module docstring).

    dflash: a Drafter returning Marginals (normally `DFlashDrafter`); suffix: a SuffixDrafter.
    merge: one of MERGES. weight: w, the suffix source's mixture weight in (0, 1] (mix-tree).
    skip_dflash_match: suffix match length from which DFlash is not run (0: always run it).
    Raises ValueError on an unknown merge, a weight outside (0, 1] or a negative length.
    """

    def __init__(self, dflash: Drafter, suffix: SuffixDrafter, merge: str = DEFAULT_MERGE,
                 weight: float = 0.9, skip_dflash_match: int = 0) -> None:
        if merge not in MERGES:
            raise ValueError(f"unknown merge '{merge}' (choose from {', '.join(MERGES)})")
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        if skip_dflash_match < 0:
            raise ValueError("skip_dflash_match must be >= 0")
        self.dflash = dflash
        self.suffix = suffix
        self.merge = merge
        self.weight = float(weight)
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

    def linear_layers(self) -> list:
        """DFlash's linear layers (the suffix index has none)."""
        return self.dflash.linear_layers()

    def propose_cheap(self, state: HybridState, root: int, max_depth: int) -> Proposal | None:
        """The suffix drafter's trie alone (about 0.1 ms), or None without a match.

        DFlash's pending context features stay queued and are consumed by its next proposal.
        """
        depth = min(int(max_depth), self.suffix.max_depth)
        t0 = time.perf_counter()
        trie = self.suffix.propose(state.suffix, root, depth)
        state.suffix_s += time.perf_counter() - t0
        return None if trie.empty else trie

    def propose(self, state: HybridState, root: int, max_depth: int) -> Proposal:
        """Both proposals, merged: the DFlash Marginals when the suffix index has no match,
        the SuffixTrie alone when DFlash has no row (or is skipped on a long match), else
        a MergedTrie."""
        return self.propose_batch([state], [root], [max_depth])[0]

    def propose_batch(self, states: list[HybridState], roots: list[int], max_depths: list[int]
                      ) -> list[Proposal | Exception]:
        """`propose` for several requests: the suffix tries one by one, then one DFlash pass
        (`propose_batch`) over the requests that need it, then the merges (a request whose
        DFlash proposal failed gets its exception). A DFlash pass of b requests is charged
        b-th to each state's `dflash_s`."""
        clock = time.perf_counter
        tries, need = [], []
        for r, (state, root, max_depth) in enumerate(zip(states, roots, max_depths)):
            state.proposals += 1
            depth = min(int(max_depth), self.max_depth)
            t0 = clock()
            trie = self.suffix.propose(state.suffix, root, min(depth, self.suffix.max_depth))
            state.suffix_s += clock() - t0
            tries.append(trie)
            if not trie.empty and self.skip_dflash_match and self._match_len(state.suffix, root) >= self.skip_dflash_match:
                state.skipped += 1
            else:
                need.append((r, min(depth, self.dflash.max_depth)))
        margs = {}
        if need:
            t0 = clock()
            out = self.dflash.propose_batch([states[r].dflash for r, _ in need], [roots[r] for r, _ in need],
                                            [d for _, d in need])
            share = (clock() - t0) / len(need)
            for (r, _), marg in zip(need, out):
                states[r].dflash_s += share
                margs[r] = marg
        proposals: list[Proposal | Exception] = []
        for r, trie in enumerate(tries):
            marg = margs.get(r)
            if isinstance(marg, Exception):
                proposals.append(marg)
            elif marg is None:
                proposals.append(trie)
            elif trie.empty:
                proposals.append(marg)
            elif marg.depth == 0:
                proposals.append(trie)
            else:
                states[r].merged += 1
                proposals.append(MergedTrie(marg, trie, self.merge == "max-tree", self.weight))
        return proposals

    def _match_len(self, st: SuffixState, root: int) -> int:
        """Length of the request index's longest match of the context suffix ending at `root`."""
        m = self.suffix.max_match_len
        window = st.tokens[max(0, len(st.tokens) - (m - 1)):] if m > 1 else []
        window.append(int(root))
        return st.index.match(window)[1]


class MergedTrie(ChildSource):
    """Lazy union of the DFlash product tree and a suffix trie (see the module docstring).

    marginals: DFlash Marginals [D, K] (rows sorted; moved to the host once). suffix: a
    non-empty SuffixTrie (any ChildSource works). use_max: max-tree scores, else mix-tree with suffix weight
    `weight` in (0, 1]. A node's reference is its suffix-trie reference, or None once its
    path has left the trie. Children: for a node on a suffix path with continuations, its
    suffix children rescored with row d, then row d's other tokens (scaled by 1 - w for
    mix-tree), merged best first; else row d alone (shared by every such node of depth d).
    """

    def __init__(self, marginals: Marginals, suffix: ChildSource, use_max: bool, weight: float):
        host = marginals.to_host()
        self.root_ref = suffix.root_ref
        self.suffix = suffix
        self.use_max = use_max
        self.log_w = math.log(weight)
        self.log_1w = math.log1p(-weight) if weight < 1.0 else -math.inf
        self._ids: list[list[int]] = host.token_ids.tolist()
        self._lps: list[list[float]] = host.logprobs.float().tolist()
        self._rows: dict[int, list[Child]] = {}
        self._dicts: dict[int, dict[int, float]] = {}

    def _row(self, d: int) -> list[Child]:
        """Row d of the marginals as children without a suffix reference (cached per depth)."""
        row = self._rows.get(d)
        if row is None:
            row = self._rows[d] = ([(lp, t, None) for t, lp in zip(self._ids[d], self._lps[d])]
                                   if d < len(self._ids) else [])
        return row

    def _score(self, lp_s: float, lp_d: float | None) -> float:
        """The merged conditional log q of a token with suffix score lp_s and DFlash score lp_d."""
        if self.use_max:
            return lp_s if lp_d is None or lp_s >= lp_d else lp_d
        a = self.log_w + lp_s
        if lp_d is None:
            return a
        b = self.log_1w + lp_d
        return (a + math.log1p(math.exp(b - a))) if a >= b else (b + math.log1p(math.exp(a - b)))

    def children(self, ref, depth: int, limit: int) -> list[Child]:
        if ref is None:
            return self._row(depth)
        # All of the node's suffix children (not just `limit`): rescoring with the DFlash row
        # can reorder them, and a suffix node rarely has more than a few.
        kids = self.suffix.children(ref, depth, SUFFIX_CHILDREN)
        if not kids:
            return self._row(depth)
        if depth >= len(self._ids):
            return kids
        qd = self._dicts.get(depth)
        if qd is None:
            qd = self._dicts[depth] = dict(zip(self._ids[depth], self._lps[depth]))
        merged = [(self._score(lp_s, qd.get(t)), t, r) for lp_s, t, r in kids]
        taken = {t for _, t, _ in kids}
        off = 0.0 if self.use_max else self.log_1w
        merged.extend((off + lp, t, None) for lp, t, _ in self._row(depth) if t not in taken)
        merged.sort(key=lambda c: -c[0])  # stable: on equal scores suffix children come first
        return merged[:max(limit, 1)]
