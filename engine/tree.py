"""Best-first, budget-aware prefix-tree construction (docs/method.md, section 3).

The masks that verification needs are built on the device from a Tree (engine/tree_buffers.py).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from drafting.proposal import Proposal


class StoppingPolicy(Protocol):
    """Decides how far best-first expansion goes in one decoding step.

    top_k: tokens kept per depth from marginals (None: all the drafter gave).
    max_nodes: hard cap on tree size, root included.
    """

    top_k: int | None
    max_nodes: int

    def should_add(self, n: int, a_hat: float, p: float) -> bool:
        """Whether to add the next candidate (path score p) to a tree of n nodes with surrogate a_hat."""
        ...

    def finalize(self, n: int) -> int:
        """Final tree size given n grown nodes (e.g. bucket rounding); 1 <= result <= n."""
        ...


@dataclass
class SingleNodePolicy:
    """Root only: plain autoregressive decoding through the tree code path."""

    top_k: int | None = 1
    max_nodes: int = 1

    def should_add(self, n: int, a_hat: float, p: float) -> bool:
        return False

    def finalize(self, n: int) -> int:
        return 1


@dataclass
class ChainPolicy:
    """The drafter's top-1 path (DFlash): K = 1, so best-first yields exactly the chain."""

    max_nodes: int = 16
    top_k: int | None = 1

    def should_add(self, n: int, a_hat: float, p: float) -> bool:
        return True

    def finalize(self, n: int) -> int:
        return n


@dataclass
class FixedBudgetPolicy:
    """Best-first until `budget` nodes, root included (the DDTree-style baseline)."""

    budget: int
    top_k: int | None = 128

    @property
    def max_nodes(self) -> int:
        return self.budget

    def should_add(self, n: int, a_hat: float, p: float) -> bool:
        return True

    def finalize(self, n: int) -> int:
        return n


@dataclass
class Tree:
    """A prefix-closed draft tree in insertion order; node 0 is the root.

    tokens: [n] int64 (tokens[0] = root token); parents: [n] int64 (parents[0] = -1);
    depths: [n] int64 (depths[0] = 0); a_hat: acceptance surrogate sum(rho), root included.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    a_hat: float
    log_scores: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def position_ids(self, start: int) -> torch.Tensor:
        """[1, n] absolute positions: start + depth (start = position of the root)."""
        return (self.depths + start).unsqueeze(0)

    def head(self, k: int) -> "Tree":
        """The first k nodes (insertion order is prefix-closed, so this is a valid tree); a_hat
        is recomputed from their path scores. Returns self when k >= size."""
        if k >= self.size:
            return self
        return Tree(tokens=self.tokens[:k], parents=self.parents[:k], depths=self.depths[:k],
                    a_hat=float(self.log_scores[:k].exp().sum()), log_scores=self.log_scores[:k])

    def children(self) -> list[dict[int, int]]:
        """Per node, a map token -> child index (used by acceptance)."""
        out: list[dict[int, int]] = [dict() for _ in range(self.size)]
        for i, (p, t) in enumerate(zip(self.parents.tolist(), self.tokens.tolist())):
            if p >= 0:
                out[p].setdefault(t, i)
        return out


class _Frontier:
    """One tree's best-first frontier (docs/method.md, section 3): `peek` gives the path
    log-score of the next best candidate, `take` adds it to the tree.

    A max-heap keyed by path log-score holds the frontier. Adding a node pushes its next
    sibling and its first child; for a source whose children cost work to list
    (`source.deferred`), a deferred expansion of the node instead, scored by its own path
    score (an upper bound on its children's, as every conditional is <= 1): its children are
    listed only when that entry reaches the top, so leaves cost nothing. Candidates come out
    in non-increasing score, parents first.
    """

    __slots__ = ("tokens", "parents", "depths", "logs", "a_hat", "_source", "_width", "_max_nodes",
                 "_max_depth", "_refs", "_kids", "_heap", "_tie")

    def __init__(self, root: int, proposal: Proposal | None, top_k: int | None, max_nodes: int, max_depth: int):
        self.tokens, self.parents, self.depths, self.logs = [root], [-1], [0], [0.0]
        self.a_hat = 1.0
        self._max_nodes = max_nodes
        self._max_depth = max_depth
        self._heap: list[tuple[float, int, int, int]] = []
        if proposal is None or max_depth <= 0 or max_nodes <= 1:
            return
        self._source = proposal.source(top_k)
        self._width = top_k if top_k is not None else max_nodes
        self._refs: list = [self._source.root_ref]
        self._kids: list = [None]
        # (-path log-score, tie, node, rank): rank >= 0 is that child of `node`, -1 expands `node`.
        self._heap = [(-0.0, 0, 0, -1)]
        self._tie = 1

    @property
    def size(self) -> int:
        return len(self.tokens)

    def peek(self) -> float | None:
        """Path log-score of the next best candidate, or None when there is none (or the cap is reached)."""
        heap = self._heap
        while heap and len(self.tokens) < self._max_nodes:
            neg, _, node, rank = heap[0]
            if rank >= 0:
                return -neg
            # List the node's children now that they could be the best candidates.
            heapq.heappop(heap)
            ch = self._source.children(self._refs[node], self.depths[node],
                                       min(self._width, self._max_nodes - len(self.tokens)))
            if ch:
                self._kids[node] = ch
                heapq.heappush(heap, (neg - ch[0][0], self._tie, node, 0))
                self._tie += 1
        return None

    def take(self) -> None:
        """Add the candidate `peek` returned (call `peek` first)."""
        heap, width = self._heap, self._width
        neg, _, node, rank = heapq.heappop(heap)
        siblings = self._kids[node]
        _, token, ref = siblings[rank]
        self.tokens.append(token)
        self.parents.append(node)
        depth = self.depths[node] + 1
        self.depths.append(depth)
        self._refs.append(ref)
        self._kids.append(None)
        self.logs.append(-neg)
        self.a_hat += math.exp(-neg)
        if rank + 1 < min(len(siblings), width):
            heapq.heappush(heap, (-(self.logs[node] + siblings[rank + 1][0]), self._tie, node, rank + 1))
            self._tie += 1
        if depth < self._max_depth:
            if self._source.deferred:
                heapq.heappush(heap, (neg, self._tie, len(self.tokens) - 1, -1))
            else:  # children are a lookup: push the first one directly
                ch = self._source.children(ref, depth, width)
                if ch:
                    self._kids[-1] = ch
                    heapq.heappush(heap, (neg - ch[0][0], self._tie, len(self.tokens) - 1, 0))
            self._tie += 1

    def tree(self, n: int | None = None) -> Tree:
        """The first n grown nodes (default all) as a Tree; insertion order is prefix-closed."""
        n = len(self.tokens) if n is None else n
        a_hat = self.a_hat if n == len(self.tokens) else float(sum(math.exp(x) for x in self.logs[:n]))
        return Tree(
            tokens=torch.tensor(self.tokens[:n], dtype=torch.long),
            parents=torch.tensor(self.parents[:n], dtype=torch.long),
            depths=torch.tensor(self.depths[:n], dtype=torch.long),
            a_hat=a_hat,
            log_scores=torch.tensor(self.logs[:n], dtype=torch.float32),
        )


def build_tree(root: int, proposal: Proposal | None, policy: StoppingPolicy, max_depth: int) -> Tree:
    """Grow the tree best-first by path score rho (docs/method.md, section 3).

    Every proposal form is read through its ChildSource view (`proposal.source(policy.top_k)`),
    and the policy alone decides when to stop (its `max_nodes` is the only cap). Nodes come
    out in non-increasing rho, parents first, so for every size n the result maximises A_hat
    over prefix-closed trees of n nodes.

    root: root token id. proposal: Marginals, CandidateTree or ChildSource (None: root only).
    policy: StoppingPolicy (top_k children per node, max_nodes, should_add, finalize).
    max_depth: deepest depth allowed this step (0: root only).
    Returns a Tree of size policy.finalize(n) <= policy.max_nodes.
    """
    front = _Frontier(root, proposal, policy.top_k, policy.max_nodes, max_depth)
    should_add = policy.should_add
    while (lp := front.peek()) is not None and should_add(front.size, front.a_hat, math.exp(lp)):
        front.take()
    return front.tree(policy.finalize(front.size))


class BatchStoppingPolicy(Protocol):
    """Decides how many nodes a batched step verifies in all (docs/method.md, section 9).

    top_k: tokens kept per depth; max_nodes: cap on the batch's total nodes, roots included;
    max_nodes_per_tree: cap on any one sequence's tree.
    """

    top_k: int | None
    max_nodes: int
    max_nodes_per_tree: int

    def should_add(self, n: int, a_hat: float, p: float) -> bool:
        """Add the globally best candidate (path score p) to a batch of n nodes whose trees'
        surrogates sum to a_hat?"""
        ...


def build_trees(roots: list[int], proposals: list[Proposal | None], policy: BatchStoppingPolicy,
                max_depths: list[int]) -> list[Tree]:
    """Trees for every sequence of a batched step under one global budget (docs/method.md, section 9).

    One heap over every sequence's best-first frontier: the globally best candidate is added
    while `policy.should_add(total nodes, sum of A_hat, its path score)` holds. Each
    frontier yields candidates in non-increasing score, so the merged order takes a
    best-first prefix of every tree, and for every total N it maximises the sum of A_hat
    over all ways to split N nodes into prefix-closed trees. Every sequence keeps its root.

    roots: [b] root tokens; proposals: [b] Proposal or None (that sequence verifies its root
    only); max_depths: [b] deepest depth allowed per sequence. Returns [b] Trees.
    Raises ValueError when the three lists differ in length.
    """
    if not len(roots) == len(proposals) == len(max_depths):
        raise ValueError(f"{len(roots)} roots, {len(proposals)} proposals, {len(max_depths)} depths")
    fronts = [_Frontier(r, p, policy.top_k, policy.max_nodes_per_tree, d)
              for r, p, d in zip(roots, proposals, max_depths)]
    heap = []
    for i, f in enumerate(fronts):
        lp = f.peek()
        if lp is not None:
            heap.append((-lp, i))
    heapq.heapify(heap)
    n, a_hat = len(fronts), float(len(fronts))
    should_add = policy.should_add
    while heap and n < policy.max_nodes:
        neg, i = heap[0]
        p = math.exp(-neg)
        if not should_add(n, a_hat, p):
            break
        f = fronts[i]
        f.take()
        n += 1
        a_hat += p
        lp = f.peek()
        if lp is None:
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, (-lp, i))
    return [f.tree() for f in fronts]
