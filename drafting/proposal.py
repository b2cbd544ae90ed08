"""What a drafter hands the tree builder: a lazily expanded tree of scored children.

Every proposal is read through one protocol, `ChildSource`: given a node (an opaque
reference, its depth and how many children can still be used) it lists that node's
children best first, each with its conditional log-score log q(token | path). The one
best-first loop (`engine.tree.build_tree`) asks only for the children of nodes it is
about to grow, so a source never materialises the part of its tree that is not used
(docs/method.md, section 3).

Three forms exist:
    Marginals      DFlash's position-wise top-K tokens: a product tree in which every
                   node at depth d - 1 has row d's tokens as children.
    CandidateTree  an explicit tree with conditional scores (tests, external drafters).
    ChildSource    any lazy source: the suffix index's trie (`drafting.suffix`), the
                   DFlash + suffix merge (`drafting.hybrid`), a score correction
                   wrapped around another source (`controller.surrogate`).
`Marginals.source(top_k)` and `CandidateTree.source(top_k)` give their ChildSource view.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Sequence

import torch

#: One child: (log q(token | path to its parent), token id, the child's reference).
Child = tuple[float, int, Any]


class ChildSource(ABC):
    """A candidate tree expanded on demand (docs/method.md, section 3).

    `root_ref` is the root's reference. `children(ref, depth, limit)` lists the children
    of the node `ref` at `depth` (root 0): a sequence of `Child` sorted by non-increasing
    log-score, every log-score <= 0 (a child never outscores its parent, which is what
    makes lazy best-first expansion exact). `limit` is how many of them the caller can
    still use (a hint: a source may return more, never fewer than it has up to `limit`).
    The returned sequence must not be modified by the caller; a source may share it
    between nodes. `deferred` tells the builder whether listing children is costly.
    """

    root_ref: Any = None
    #: True when listing a node's children costs real work (the tree builder then defers it
    #: until the node could contribute); False when it is a lookup (expanded at once).
    deferred: bool = True

    @abstractmethod
    def children(self, ref: Any, depth: int, limit: int) -> Sequence[Child]:
        """Children of node `ref` (at `depth`) best first; empty when it has none."""

    def source(self, top_k: int | None = None) -> "ChildSource":
        """The source itself (a lazy source needs no conversion)."""
        return self

    @property
    def empty(self) -> bool:
        """True when the root has no children (nothing to propose)."""
        return not self.children(self.root_ref, 0, 1)


@dataclass
class Marginals:
    """Position-wise marginals q_1..q_D reduced to their top K tokens (docs/method.md, section 1).

    token_ids: [D, K] int64 target token ids; row d-1 holds depth d.
    logprobs:  [D, K] float32 log-probabilities, each row sorted in non-increasing order.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor

    @property
    def depth(self) -> int:
        return int(self.token_ids.shape[0])

    def to_host(self) -> "Marginals":
        """Both tensors on the CPU with one device-to-host transfer; `self` when already there.

        Ids and log-probs travel packed as one float64 [D, 2K] tensor: float64 holds every
        token id (< 2^53) and every float32/bfloat16 log-prob exactly. Returns token_ids
        int64 and logprobs in their original dtype.
        """
        if self.token_ids.device.type == "cpu" and self.logprobs.device.type == "cpu":
            return self
        k = self.token_ids.shape[1]
        packed = torch.cat([self.token_ids.double(), self.logprobs.double()], dim=1).cpu()
        return Marginals(token_ids=packed[:, :k].long(), logprobs=packed[:, k:].to(self.logprobs.dtype))

    def source(self, top_k: int | None = None) -> "MarginalRows":
        """The product tree over the first `top_k` columns (all when None), on the host."""
        return MarginalRows(self, top_k)


class MarginalRows(ChildSource):
    """ChildSource view of Marginals: a node at depth d has row d + 1's tokens as children.

    Device marginals reach the host here, in one transfer of the kept columns only. Every
    node of one depth shares the same children list (refs are None: the product tree
    needs no per-node state). Raises nothing; a depth past the last row has no children.
    """

    deferred = False

    def __init__(self, marginals: Marginals, top_k: int | None = None):
        width = marginals.token_ids.shape[1]
        k = width if top_k is None else min(top_k, width)
        kept = Marginals(marginals.token_ids[:, :k], marginals.logprobs[:, :k]).to_host()
        self.rows: list[list[Child]] = [
            list(zip(lps, toks, repeat(None)))
            for toks, lps in zip(kept.token_ids.tolist(), kept.logprobs.float().tolist())
        ]

    def children(self, ref: Any, depth: int, limit: int) -> Sequence[Child]:
        return self.rows[depth] if depth < len(self.rows) else ()


@dataclass
class CandidateTree:
    """An explicit candidate tree with conditional scores.

    tokens:   [M] int64 target token ids of the candidate nodes (the root is implicit).
    parents:  [M] int64 index of the parent candidate, -1 for a child of the root;
              a parent always precedes its children.
    logprobs: [M] float32 log q(token | path to parent), <= 0.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    logprobs: torch.Tensor

    def source(self, top_k: int | None = None) -> "ExplicitTree":
        """ChildSource view: per node its children sorted best first, at most `top_k` of them."""
        return ExplicitTree(self, top_k)


class ExplicitTree(ChildSource):
    """ChildSource view of a CandidateTree; refs are candidate indices (-1 for the root)."""

    root_ref = -1
    deferred = False

    def __init__(self, tree: CandidateTree, top_k: int | None = None):
        kids: dict[int, list[Child]] = {}
        for i, (t, p, lp) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(),
                                           tree.logprobs.float().tolist())):
            kids.setdefault(p, []).append((lp, t, i))
        for p, lst in kids.items():
            lst.sort(key=lambda c: -c[0])  # stable: equal scores keep candidate order
            if top_k is not None:
                del lst[top_k:]
        self._kids = kids

    def children(self, ref: Any, depth: int, limit: int) -> Sequence[Child]:
        return self._kids.get(ref, ())


#: What `Drafter.propose` returns and `engine.tree.build_tree` accepts.
Proposal = Marginals | CandidateTree | ChildSource
