"""How well the drafter's path scores predict real acceptance, and an optional per-depth correction.

With greedy acceptance the events "the accepted path reaches node i" are disjoint across the
nodes of one depth, so the drafter predicts P(accepted depth >= d) = sum of rho(i) over tree
nodes at depth d (its "depth mass"), and A_hat = 1 + sum_d mass_d predicts the accepted
length tau (bonus included). Realised: 1[accepted depth >= d] and tau. Comparing the two per
depth gives a reliability curve; their ratio G_d, turned into per-depth factors
g_d = G_d / G_{d-1} applied to the marginals, is the correction (off by default).
"""
from __future__ import annotations

import numpy as np
import torch

from drafting.proposal import Child, ChildSource, Marginals, Proposal


def depth_mass(depths: torch.Tensor, log_scores: torch.Tensor, max_depth: int) -> np.ndarray:
    """[max_depth] predicted P(accepted depth >= d) for d = 1..max_depth: sum of rho over nodes at depth d.

    depths: [n] int64 node depths (root 0); log_scores: [n] float32 log rho (e.g. a Tree's fields).
    """
    d = depths.numpy()
    rho = np.exp(log_scores.double().numpy())
    keep = (d >= 1) & (d <= max_depth)
    return np.bincount(d[keep] - 1, weights=rho[keep], minlength=max_depth)[:max_depth]


class DepthShifted(ChildSource):
    """A proposal whose children at depth d + 1 have their log-scores shifted by log_g[d].

    source: the proposal's ChildSource. log_g: [max_depth] per-depth log factors (depths past
    the end use the last). Scores are capped at 0 so a child never outscores its parent; one
    shift per depth keeps every node's children sorted. A children list the inner source
    shares between nodes (a marginals row) is shifted once and reused.
    """

    def __init__(self, source: ChildSource, log_g: list[float]):
        self.inner = source
        self.root_ref = source.root_ref
        self.deferred = source.deferred
        self.log_g = log_g
        self._shared: dict[int, tuple[object, list[Child]]] = {}

    def children(self, ref, depth: int, limit: int) -> list[Child]:
        kids = self.inner.children(ref, depth, limit)
        hit = self._shared.get(id(kids))
        if hit is not None and hit[0] is kids:
            return hit[1]
        g = self.log_g[min(depth, len(self.log_g) - 1)]
        out = [(lp + g if lp + g < 0.0 else 0.0, t, r) for lp, t, r in kids]
        self._shared[id(kids)] = (kids, out)  # the reference keeps id(kids) from being reused
        return out


class SurrogateCalibrator:
    """Running comparison of predicted and realised acceptance, with an optional per-depth scale.

    max_depth: depths tracked (the drafter's block size - 1). decay: per-step forgetting of the
    sums (0.995: about the last 200 steps dominate). prior: pseudo-steps of perfect calibration,
    so the correction starts at 1 and moves only with evidence. enabled: apply `correct`.
    """

    def __init__(self, max_depth: int = 15, decay: float = 0.995, prior: float = 2.0, enabled: bool = False,
                 min_factor: float = 0.1, max_factor: float = 10.0):
        self.max_depth = max_depth
        self.decay = decay
        self.prior = prior
        self.enabled = enabled
        self.min_factor, self.max_factor = min_factor, max_factor
        self.pred_depth = np.zeros(max_depth)
        self.real_depth = np.zeros(max_depth)
        self.steps = 0
        self.weight = 0.0  # decayed step count matching the depth sums
        self.sum_pred = 0.0
        self.sum_real = 0.0
        self.sum_abs_err = 0.0
        self._applied = np.ones(max_depth)  # cumulative G_d used by the last `correct`

    def record(self, a_hat: float, accepted: int, mass: np.ndarray | None = None) -> None:
        """One verified step: predicted a_hat, realised accepted length (bonus included),
        and optionally the tree's depth mass (as built, i.e. after any correction)."""
        self.steps += 1
        self.sum_pred += a_hat
        self.sum_real += accepted
        self.sum_abs_err += abs(a_hat - accepted)
        if mass is None:
            return
        mass = np.asarray(mass, dtype=np.float64)[: self.max_depth]
        raw = np.zeros(self.max_depth)
        raw[: mass.size] = mass / self._applied[: mass.size]
        reached = np.zeros(self.max_depth)
        reached[: max(0, min(accepted - 1, self.max_depth))] = 1.0
        self.weight = self.decay * self.weight + 1.0
        self.pred_depth = self.decay * self.pred_depth + raw
        self.real_depth = self.decay * self.real_depth + reached

    def reliability(self) -> np.ndarray:
        """[max_depth] realised / predicted P(depth >= d), shrunk to 1 by the prior (1 = calibrated)."""
        return (self.real_depth + self.prior * self._prior_mass()) / (self.pred_depth + self.prior * self._prior_mass())

    def _prior_mass(self) -> np.ndarray:
        return np.maximum(self.pred_depth / max(self.weight, 1.0), 1e-3)

    def depth_factors(self) -> np.ndarray:
        """[max_depth] per-depth multiplicative factors g_d on q_d, clipped to [min_factor, max_factor]."""
        cum = np.maximum(self.reliability(), 1e-6)
        prev = np.concatenate([[1.0], cum[:-1]])
        return np.clip(cum / prev, self.min_factor, self.max_factor)

    def correct(self, proposal: Proposal) -> Proposal:
        """The proposal with depth-d scores scaled by g_d; the input itself when disabled.

        Marginals: row d's log-probs shifted by log g_d (capped at 0) on their device; a
        per-row shift keeps each row sorted, so best-first order within a depth is unchanged.
        Any other proposal (a suffix trie, a merge, a CandidateTree) is wrapped in a
        DepthShifted source: each child's conditional log-score is shifted by log g of its
        depth, which scales its path score by the cumulative G_d exactly as for marginals.
        """
        if not self.enabled:
            self._applied = np.ones(self.max_depth)
            return proposal
        g = self.depth_factors()
        log_g = torch.from_numpy(np.log(g))
        self._applied = np.cumprod(g)
        if not isinstance(proposal, Marginals):
            return DepthShifted(proposal.source(), log_g.tolist())
        rows = min(proposal.depth, self.max_depth)
        shift = torch.zeros(proposal.depth, 1, dtype=proposal.logprobs.dtype)
        shift[:rows, 0] = log_g[:rows].to(proposal.logprobs.dtype)
        shift = shift.to(proposal.logprobs.device, non_blocking=True)  # marginals may stay on the drafter's device
        return Marginals(proposal.token_ids, torch.clamp(proposal.logprobs + shift, max=0.0))

    @property
    def mean_predicted(self) -> float:
        return self.sum_pred / self.steps if self.steps else float("nan")

    @property
    def mean_realised(self) -> float:
        return self.sum_real / self.steps if self.steps else float("nan")

    def summary(self) -> str:
        """Text for the calibration report: A_hat vs tau and per-depth reliability."""
        if not self.steps:
            return "surrogate: no steps recorded"
        lines = [f"surrogate over {self.steps} steps: mean A_hat {self.mean_predicted:.3f}, mean accepted "
                 f"{self.mean_realised:.3f}, ratio {self.mean_realised / self.mean_predicted:.3f}, "
                 f"MAE {self.sum_abs_err / self.steps:.3f} tokens; correction {'on' if self.enabled else 'off'}"]
        n = max(self.weight, 1.0)
        rel = self.reliability()
        lines.append(f"{'depth':>5} {'pred P(>=d)':>12} {'real P(>=d)':>12} {'reliability':>12}")
        for d in range(self.max_depth):
            if self.pred_depth[d] <= 0 and self.real_depth[d] <= 0:
                continue
            lines.append(f"{d + 1:>5} {self.pred_depth[d] / n:>12.4f} {self.real_depth[d] / n:>12.4f} "
                         f"{rel[d]:>12.3f}")
        return "\n".join(lines)

    def snapshot(self) -> dict:
        """Numbers for metrics/benchmark reports."""
        return {"steps": self.steps, "mean_predicted": self.mean_predicted, "mean_realised": self.mean_realised,
                "reliability": self.reliability().tolist(), "factors": self.depth_factors().tolist()}
