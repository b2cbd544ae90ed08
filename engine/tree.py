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


def build_tree(root: int, proposal: Proposal | None, policy: StoppingPolicy, max_depth: int) -> Tree:
    """Grow the tree best-first by path score rho (docs/method.md, section 3).

    The one best-first loop of the project: every proposal form is read through its
    ChildSource view (`proposal.source(policy.top_k)`), and the policy alone decides when
    to stop (its `max_nodes` is the only cap). A max-heap holds the frontier, keyed by path
    log-score. Adding a node pushes its next sibling and its first child; for a source
    whose children cost work to list (`source.deferred`), a deferred expansion of the node
    instead, scored by its own path score (an upper bound on its children's, as every
    conditional is <= 1): its children are listed only when that entry reaches the top, so
    leaves cost nothing. Nodes come out in non-increasing rho, parents first, so for every size n the
    result maximises A_hat over prefix-closed trees of n nodes.

    root: root token id. proposal: Marginals, CandidateTree or ChildSource (None: root only).
    policy: StoppingPolicy (top_k children per node, max_nodes, should_add, finalize).
    max_depth: deepest depth allowed this step (0: root only).
    Returns a Tree of size policy.finalize(n) <= policy.max_nodes.
    """
    tokens, parents, depths, logs = [root], [-1], [0], [0.0]
    a_hat = 1.0
    if proposal is not None and max_depth > 0 and policy.max_nodes > 1:
        source = proposal.source(policy.top_k)
        width = policy.top_k if policy.top_k is not None else policy.max_nodes
        max_nodes = policy.max_nodes
        should_add = policy.should_add
        refs: list = [source.root_ref]
        kids: list = [None]
        # (-path log-score, tie, node, rank): rank >= 0 is that child of `node`, -1 expands `node`.
        heap: list[tuple[float, int, int, int]] = [(-0.0, 0, 0, -1)]
        tie = 1
        push, pop = heapq.heappush, heapq.heappop
        deferred = source.deferred
        while heap and len(tokens) < max_nodes:
            neg, _, node, rank = heap[0]
            if rank < 0:  # list the node's children now that they could be the best candidates
                pop(heap)
                ch = source.children(refs[node], depths[node], min(width, max_nodes - len(tokens)))
                if ch:
                    kids[node] = ch
                    push(heap, (neg - ch[0][0], tie, node, 0))
                    tie += 1
                continue
            p = math.exp(-neg)
            if not should_add(len(tokens), a_hat, p):
                break
            pop(heap)
            siblings = kids[node]
            _, token, ref = siblings[rank]
            tokens.append(token)
            parents.append(node)
            depth = depths[node] + 1
            depths.append(depth)
            refs.append(ref)
            kids.append(None)
            logs.append(-neg)
            a_hat += p
            if rank + 1 < min(len(siblings), width):
                push(heap, (-(logs[node] + siblings[rank + 1][0]), tie, node, rank + 1))
                tie += 1
            if depth < max_depth:
                if deferred:
                    push(heap, (neg, tie, len(tokens) - 1, -1))
                else:  # children are a lookup: push the first one directly
                    ch = source.children(ref, depth, width)
                    if ch:
                        kids[-1] = ch
                        push(heap, (neg - ch[0][0], tie, len(tokens) - 1, 0))
                tie += 1
    n = policy.finalize(len(tokens))
    if n < len(tokens):
        # Insertion order is prefix-closed, so truncation keeps a valid tree.
        a_hat = float(sum(math.exp(x) for x in logs[:n]))
    return Tree(
        tokens=torch.tensor(tokens[:n], dtype=torch.long),
        parents=torch.tensor(parents[:n], dtype=torch.long),
        depths=torch.tensor(depths[:n], dtype=torch.long),
        a_hat=a_hat,
        log_scores=torch.tensor(logs[:n], dtype=torch.float32),
    )
