"""The drafter interface and the two proposal forms the tree builder accepts."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Marginals:
    """Position-wise marginals q_1..q_D reduced to their top K tokens (SPEC section 1).

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


@dataclass
class CandidateTree:
    """An explicit candidate tree with conditional scores (e.g. from a suffix index).

    tokens:   [M] int64 target token ids of the candidate nodes (the root is implicit).
    parents:  [M] int64 index of the parent candidate, -1 for a child of the root;
              a parent always precedes its children.
    logprobs: [M] float32 log q(token | path to parent).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    logprobs: torch.Tensor


Proposal = Marginals | CandidateTree


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
        Returns Marginals with D <= max_depth rows, or a CandidateTree.
        """
