"""Best-first, budget-aware prefix-tree construction (SPEC section 3) and tree masks (section 4)."""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from drafting.base import CandidateTree, Marginals, Proposal


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

    def children(self) -> list[dict[int, int]]:
        """Per node, a map token -> child index (used by acceptance)."""
        out: list[dict[int, int]] = [dict() for _ in range(self.size)]
        for i, (p, t) in enumerate(zip(self.parents.tolist(), self.tokens.tolist())):
            if p >= 0:
                out[p].setdefault(t, i)
        return out


def _children_source(proposal: Proposal, top_k: int | None):
    """Return (children(ref) -> (tokens, logprobs) lists, ref_of_child(ref, rank) -> ref)."""
    if isinstance(proposal, Marginals):
        k = proposal.token_ids.shape[1] if top_k is None else min(top_k, proposal.token_ids.shape[1])
        # Device marginals reach the host here, in one transfer of the kept columns only.
        kept = Marginals(proposal.token_ids[:, :k], proposal.logprobs[:, :k]).to_host()
        toks = kept.token_ids.tolist()
        lps = kept.logprobs.float().tolist()
        depth = len(toks)
        empty: tuple[list, list] = ([], [])

        # ref = depth of the node; its children live in row `ref`.
        def children(ref: int):
            return (toks[ref], lps[ref]) if ref < depth else empty

        def child_ref(ref: int, rank: int) -> int:
            return ref + 1

        return children, child_ref, 0
    if isinstance(proposal, CandidateTree):
        kids: dict[int, list[tuple[float, int, int]]] = {}
        for i, (t, p, lp) in enumerate(zip(proposal.tokens.tolist(), proposal.parents.tolist(),
                                           proposal.logprobs.float().tolist())):
            kids.setdefault(p, []).append((lp, t, i))
        lists = {}
        for p, lst in kids.items():
            lst.sort(key=lambda x: -x[0])
            if top_k is not None:
                lst = lst[:top_k]
            lists[p] = ([t for _, t, _ in lst], [lp for lp, _, _ in lst], [i for _, _, i in lst])
        empty3: tuple[list, list, list] = ([], [], [])

        # ref = candidate index of the node (-1 for the root).
        def children(ref: int):
            t, lp, _ = lists.get(ref, empty3)
            return t, lp

        def child_ref(ref: int, rank: int) -> int:
            return lists[ref][2][rank]

        return children, child_ref, -1
    raise TypeError(f"unknown proposal type {type(proposal).__name__}")


def build_tree(root: int, proposal: Proposal | None, policy: StoppingPolicy, max_depth: int) -> Tree:
    """Grow the tree best-first by path score rho (SPEC section 3, BASTION paper section 3.2).

    A max-heap holds the frontier: after adding a node we push its first child and its
    next sibling, so nodes come out in non-increasing rho and every parent precedes its
    children. For each size n the result maximises A_hat over prefix-closed trees.

    root: root token id. proposal: Marginals or CandidateTree (None: root only).
    max_depth: deepest depth allowed this step (0: root only).
    Returns a Tree of size policy.finalize(n) <= policy.max_nodes.
    """
    tokens, parents, depths, refs, logs = [root], [-1], [0], [None], [0.0]
    a_hat = 1.0
    if proposal is not None and max_depth > 0 and policy.max_nodes > 1:
        children, child_ref, root_ref = _children_source(proposal, policy.top_k)
        refs[0] = root_ref
        heap: list[tuple[float, int, int]] = []

        def push(node: int, rank: int) -> None:
            toks, lps = children(refs[node])
            if rank < len(toks):
                heapq.heappush(heap, (-(logs[node] + lps[rank]), node, rank))

        push(0, 0)
        max_nodes = policy.max_nodes
        while heap and len(tokens) < max_nodes:
            neg, parent, rank = heap[0]
            p = math.exp(-neg)
            if not policy.should_add(len(tokens), a_hat, p):
                break
            heapq.heappop(heap)
            node = len(tokens)
            ptoks, _ = children(refs[parent])
            tokens.append(ptoks[rank])
            parents.append(parent)
            depths.append(depths[parent] + 1)
            refs.append(child_ref(refs[parent], rank))
            logs.append(-neg)
            a_hat += p
            if depths[node] < max_depth:
                push(node, 0)
            push(parent, rank + 1)
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


def ancestor_matrix(parents: torch.Tensor) -> np.ndarray:
    """[n, n] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
    par = parents.tolist()
    n = len(par)
    anc = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(par):
        if p >= 0:
            anc[i, : i] = anc[p, : i]
        anc[i, i] = True
    return anc


def tree_attention_mask(tree: Tree, prefix_len: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive mask [1, 1, n, prefix_len + n] for verifying `tree` over a cached prefix.

    Row i sees the whole prefix, node i itself and its ancestors (SPEC section 4);
    0 where visible, the dtype's most negative value elsewhere.
    """
    n = tree.size
    visible = np.ones((n, prefix_len + n), dtype=bool)
    visible[:, prefix_len:] = ancestor_matrix(tree.parents)
    mask = torch.zeros((1, 1, n, prefix_len + n), dtype=dtype, device=device)
    mask.masked_fill_(~torch.from_numpy(visible).to(device)[None, None], torch.finfo(dtype).min)
    return mask
