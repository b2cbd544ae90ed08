"""Tree sizes chosen by the tokens trees of each size really commit, measured on every step.

The adaptive policy (controller/policy.py) grows a tree while the drafter's scores, corrected
per depth, say one more node pays. Where those scores are over-confident in a way a per-depth
factor cannot fix (the low-ranked siblings of a depth), it grows trees that cost more than they
commit: on a 2-core EPYC in bfloat16, drafted steps verified 12-18 nodes for about 2 tokens where
a fixed 4-node tree committed 1.7 for two thirds of the time (docs/controller.md).

Every verified tree says what its smaller versions would have committed, at no cost: trees are
built best-first, so the tree a cap of n nodes would have built is the first n nodes of this one
(engine.tree.Tree keeps insertion order), and along the accepted path node indices grow from
the root, so that tree commits 1 + (accepted path nodes with index < n) tokens (the bonus
included; never more than the step committed). Sizes above the step's cap are left unobserved,
whether or not the tree reached it (`RealisedSizes.record` says why). `RealisedSizes` keeps a
decayed mean of those counterfactual tokens at a grid of sizes and caps the next tree at the size of the best measured throughput,
    n* = argmax_n  tokens(n) / (T_fixed + C(n)),
with C from the latency model. Sizes above a binding cap are seen only by probes: every
PROBE_EVERY-th step's cap is the next grid size above n*, so a drafter that improves moves n*
up one size at a time. The method is described in docs/method.md, section 8.
"""
from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

#: Tree sizes (nodes, root included) the measurements are kept at; caps are chosen among them.
SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
#: Every this many capped steps, a probe: the cap is the next size above the best.
PROBE_EVERY = 8
#: Decayed observations a size needs before its mean is trusted.
MIN_WEIGHT = 4.0


class RealisedSizes:
    """Decayed means of the tokens a best-first tree cut at each of `sizes` commits.

    sizes: increasing node counts (root included). decay: per-step forgetting (0.99: about the
    last 100 steps dominate; the machine and drafter change slowly, prompts quickly).
    probe_every: see PROBE_EVERY. min_weight: see MIN_WEIGHT. Raises ValueError for empty or
    unsorted sizes, sizes below 2, or decay outside (0, 1].
    """

    def __init__(self, sizes: Sequence[int] = SIZES, decay: float = 0.99, probe_every: int = PROBE_EVERY,
                 min_weight: float = MIN_WEIGHT):
        sizes = [int(n) for n in sizes]
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 2:
            raise ValueError(f"sizes must be increasing node counts >= 2, got {sizes}")
        if not 0.0 < decay <= 1.0 or probe_every < 1:
            raise ValueError("decay must be in (0, 1] and probe_every >= 1")
        self.sizes = sizes
        self.decay = decay
        self.probe_every = probe_every
        self.min_weight = min_weight
        self.tokens = np.zeros(len(sizes))  # decayed sums of counterfactual tokens per size
        self.weight = np.zeros(len(sizes))  # decayed observation counts per size
        self.steps = 0
        self._decisions = 0
        self.last_best: int | None = None

    def record(self, tree_size: int, cap: int | None, path: Sequence[int], accepted: int) -> None:
        """One verified tree: tree_size nodes (root included), built under `cap` nodes (None: no
        cap of this sizer); path: the accepted non-root node indices, increasing; accepted:
        tokens the step committed (bonus included). Sizes above the cap are not observed, even
        when the policy stopped the tree below it: which steps reach their cap depends on the
        drafter's confidence, so counting only the others at larger sizes would rate those sizes
        by the hard steps alone (the confident steps, where larger trees pay, are exactly the
        ones a binding cap hides), and the cap would ratchet down. Whether a size is observed
        then depends on the cap alone, fixed before the tree was built."""
        self.steps += 1
        self.tokens *= self.decay
        self.weight *= self.decay
        path = sorted(int(i) for i in path)
        for j, n in enumerate(self.sizes):
            if cap is not None and n > cap:
                break
            tok = min(accepted, 1 + bisect.bisect_left(path, n))  # path indices are all < tree_size
            self.tokens[j] += tok
            self.weight[j] += 1.0

    def mean_tokens(self) -> np.ndarray:
        """[len(sizes)] measured tokens per step at each size; nan where fewer than min_weight."""
        with np.errstate(invalid="ignore", divide="ignore"):
            out = self.tokens / self.weight
        out[self.weight < self.min_weight] = np.nan
        return out

    def best(self, costs: Sequence[float], fixed_s: float, max_nodes: int) -> int | None:
        """The measured size of best throughput tokens(n) / (fixed_s + costs[n]) among sizes
        <= max_nodes (costs: C(n) seconds, `BudgetController.verify_costs`), or None while no
        size has enough observations."""
        mean = self.mean_tokens()
        best, best_rate = None, -1.0
        for j, n in enumerate(self.sizes):
            if n > max_nodes or n >= len(costs) or mean[j] != mean[j]:
                continue
            rate = mean[j] / (fixed_s + costs[n])
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def cap(self, costs: Sequence[float], fixed_s: float, max_nodes: int) -> int:
        """The node cap of the next tree: the best measured size, or on every probe_every-th
        call the next size above it; max_nodes while nothing is measured or when the best is
        the largest size below max_nodes. Never above max_nodes."""
        best = self.best(costs, fixed_s, max_nodes)
        self.last_best = best
        if best is None:
            return max_nodes
        self._decisions += 1
        if self._decisions % self.probe_every == 0:
            j = self.sizes.index(best)
            return min(self.sizes[j + 1], max_nodes) if j + 1 < len(self.sizes) else max_nodes
        return best

    def snapshot(self) -> dict:
        """JSON-ready: the measured tokens per size (None where unknown), the last best size, steps."""
        return {"sizes": list(self.sizes), "tokens": [None if x != x else round(float(x), 4) for x in self.mean_tokens()],
                "best": self.last_best, "steps": self.steps}
