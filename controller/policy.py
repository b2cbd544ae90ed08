"""The adaptive stopping policy: grow the tree while one more node raises throughput (docs/method.md, section 4).

Theta(n) = A_hat(T_n) / (T_draft + T_other + C(n)). Adding the next best-first candidate,
of path score p, raises Theta iff

    p * (T_draft + T_other + C(n)) > A_hat(T_n) * (C(n + 1) - C(n)).

Candidates come out in non-increasing p and C is convex in n (a max of lines in FLOPs and
bytes, FLOPs quadratic in s through attention), so Theta is unimodal in n and the first
candidate that fails marks its peak.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class PolicySettings:
    """Per-device knobs of the adaptive policy (tree sizes count the root).

    min_nodes: always grow to this size (when candidates exist).
    max_nodes: hard cap; C(n) is precomputed up to it every step.
    bucket: final size rounded down to a multiple of it (GPU kernel granularity; 1 on CPU).
    top_k: tokens per depth the tree builder reads from the marginals.
    """

    min_nodes: int = 1
    max_nodes: int = 256
    bucket: int = 1
    top_k: int | None = 64

    def __post_init__(self):
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {self.min_nodes}, {self.max_nodes}")
        if self.bucket < 1:
            raise ValueError(f"bucket must be >= 1, got {self.bucket}")


#: CPU: no kernel granularity to round to (bucket 1), no forced minimum (the rule decides from
#: the calibrated curve), a cap well above where a CPU's verify cost stops being flat, and
#: top-64 per depth (a tree of <= 256 nodes over <= 15 depths never reaches deeper ranks).
CPU_SETTINGS = PolicySettings(min_nodes=1, max_nodes=256, bucket=1, top_k=64)
#: GPU: the reference constants (BASTION code): min 32, max 8192, bucket 32, K = 128.
GPU_SETTINGS = PolicySettings(min_nodes=32, max_nodes=8192, bucket=32, top_k=128)


def default_settings(device: torch.device | str) -> PolicySettings:
    """CPU_SETTINGS on a CPU, GPU_SETTINGS otherwise."""
    return CPU_SETTINGS if torch.device(device).type == "cpu" else GPU_SETTINGS


class AdaptivePolicy:
    """One step's stopping policy for engine.tree.build_tree (the StoppingPolicy protocol).

    costs: Python list, costs[n] = C(n) predicted verify seconds of n tree tokens at this
    step's context, for n = 1..max_nodes (costs[0] unused). fixed_s: T_draft + T_other
    seconds. should_add is a handful of list lookups and float ops per node.
    """

    __slots__ = ("top_k", "max_nodes", "min_nodes", "bucket", "_costs", "_fixed")

    def __init__(self, costs: Sequence[float], fixed_s: float, min_nodes: int = 1, max_nodes: int | None = None,
                 bucket: int = 1, top_k: int | None = 64):
        max_nodes = len(costs) - 1 if max_nodes is None else max_nodes
        if max_nodes > len(costs) - 1:
            raise ValueError(f"costs cover n <= {len(costs) - 1}, max_nodes is {max_nodes}")
        self._costs = list(costs)
        self._fixed = float(fixed_s)
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.bucket = bucket
        self.top_k = top_k

    @classmethod
    def from_model(cls, model, context_len: int, t_draft: float, t_other: float,
                   settings: PolicySettings = CPU_SETTINGS) -> "AdaptivePolicy":
        """Policy for one step: C(n) from `model` (a LatencyModel) at context_len cached tokens."""
        costs = model.verify_costs(settings.max_nodes, context_len)
        return cls(costs, t_draft + t_other, settings.min_nodes, settings.max_nodes, settings.bucket, settings.top_k)

    def cost(self, n: int) -> float:
        """C(n), predicted verify seconds of an n-node tree."""
        return self._costs[n]

    def theta(self, n: int, a_hat: float) -> float:
        """Throughput surrogate A_hat / (T_draft + T_other + C(n)), tokens per second."""
        return a_hat / (self._fixed + self._costs[n])

    def should_add(self, n: int, a_hat: float, p: float) -> bool:
        """Add the candidate of path score p to a tree of n nodes whose surrogate is a_hat?"""
        if n < self.min_nodes:
            return True
        if n >= self.max_nodes:
            return False
        c = self._costs
        return p * (self._fixed + c[n]) > a_hat * (c[n + 1] - c[n])

    def finalize(self, n: int) -> int:
        """n rounded down to a multiple of `bucket`, but not below min(min_nodes, n), nor below 1."""
        if self.bucket <= 1:
            return n
        return max((n // self.bucket) * self.bucket, min(self.min_nodes, n), 1)


class BatchAdaptivePolicy:
    """One batched step's global stopping policy for engine.tree.build_trees (docs/method.md, section 9).

    costs: Python list, costs[N] = C_b(N) predicted verify seconds of N tree tokens in all
    for this batch (N = b..max_nodes; LatencyModel.batch_costs). fixed_s: T_draft(b) +
    T_other(b) seconds. The globally best candidate, of path score p, joins a batch of N
    nodes whose trees' surrogates sum to a_hat while
    p * (fixed_s + C_b(N)) > a_hat * (C_b(N + 1) - C_b(N)).
    max_nodes: cap on the batch's nodes, roots included; max_nodes_per_tree: cap per tree.
    """

    __slots__ = ("top_k", "max_nodes", "max_nodes_per_tree", "_costs", "_fixed")

    def __init__(self, costs: Sequence[float], fixed_s: float, max_nodes: int | None = None,
                 max_nodes_per_tree: int | None = None, top_k: int | None = 64):
        max_nodes = len(costs) - 1 if max_nodes is None else max_nodes
        if max_nodes > len(costs) - 1:
            raise ValueError(f"costs cover N <= {len(costs) - 1}, max_nodes is {max_nodes}")
        self._costs = list(costs)
        self._fixed = float(fixed_s)
        self.max_nodes = max_nodes
        self.max_nodes_per_tree = max_nodes if max_nodes_per_tree is None else max_nodes_per_tree
        self.top_k = top_k

    def cost(self, n: int) -> float:
        """C_b(N), predicted verify seconds of N tree tokens in all."""
        return self._costs[n]

    def theta(self, n: int, a_hat: float) -> float:
        """Batch throughput surrogate sum(A_hat_r) / (T_draft + T_other + C_b(N)), tokens per second."""
        return a_hat / (self._fixed + self._costs[n])

    def should_add(self, n: int, a_hat: float, p: float) -> bool:
        if n >= self.max_nodes:
            return False
        c = self._costs
        return p * (self._fixed + c[n]) > a_hat * (c[n + 1] - c[n])
