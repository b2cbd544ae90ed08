"""The drafter interface the engine drives (proposal types: drafting.proposal)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from drafting.proposal import Proposal


class Drafter(ABC):
    """Proposes the continuation of a request, one proposal per decoding step.

    The engine drives it in this order per request:
    `state = new_state()`; `extend(state, prompt_ids, prompt_features)`; then per step
    `propose(state, root, max_depth)` and, after verification,
    `extend(state, committed_ids, committed_features)` with the tokens that entered the
    target's KV cache (the root and the accepted nodes).
    """

    #: hidden_states indices (Hugging Face convention, 0 = embeddings) the drafter reads
    #: as features; empty when it needs no target features.
    feature_layers: tuple[int, ...] = ()
    #: maximum proposal depth (block size - 1 for DFlash).
    max_depth: int = 15

    @property
    def needs_features(self) -> bool:
        return bool(self.feature_layers)

    @abstractmethod
    def new_state(self) -> Any:
        """Fresh per-request state; owns every cache, so requests never share state."""

    @abstractmethod
    def extend(self, state: Any, token_ids: list[int], features: torch.Tensor | None) -> None:
        """Record committed context tokens.

        token_ids: committed tokens now in the target's KV cache, in order.
        features: [n, len(feature_layers) * H] target hidden states of those tokens
                  (concatenated in feature_layers order), or None when not needed.
        """

    def finish(self, state: Any, final_tokens: list[int] | tuple[int, ...] = ()) -> Any:
        """The request ended; final_tokens were committed but never entered the target cache.

        Default: nothing to do. Drafters that learn across requests (a global suffix index)
        record the output here.
        """
        return None

    def linear_layers(self) -> list[torch.nn.Module]:
        """The drafter's own torch.nn.Linear layers, whose row counts vary from pass to pass
        (for `engine.linear.warm_up`; default: none)."""
        return []

    def propose_cheap(self, state: Any, root: int, max_depth: int) -> Proposal | None:
        """A proposal that costs next to nothing, for steps where the controller has turned
        the full drafter off because it does not pay (default: None, nothing to offer).

        A drafter made of a costly and a nearly free part (e.g. DFlash + a suffix index)
        returns the free part's proposal here, or None when it has nothing. It must leave
        the state consistent for the next `propose`.
        """
        return None

    @abstractmethod
    def propose(self, state: Any, root: int, max_depth: int) -> Proposal:
        """Propose continuations of `root` (committed, not yet in the target cache).

        max_depth: deepest depth the engine can use this step (<= self.max_depth).
        Returns a Proposal (drafting.proposal): Marginals with D <= max_depth rows, or a
        ChildSource / CandidateTree whose nodes lie at depth <= max_depth.
        """

    def propose_batch(self, states: list[Any], roots: list[int], max_depths: list[int]
                      ) -> list[Proposal | Exception]:
        """`propose` for several requests of one batched step, in order: each entry is that
        request's Proposal or the exception its own proposal raised (default: one by one).

        A drafter whose pass batches (DFlash: one forward over every block) overrides it; if its
        shared pass raises, it must leave the states as they were, so the caller can retry the
        requests one by one with `propose` and find the one at fault.
        """
        out: list[Proposal | Exception] = []
        for st, root, d in zip(states, roots, max_depths):
            try:
                out.append(self.propose(st, root, d))
            except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
                out.append(e)
        return out
