"""Step accounting: the one place that turns verification steps into the figures users read.

`StepStats` is what one engine step reports. `StepAccounting` (one per engine) folds every
step into running totals: steps by kind, drafted / accepted token counts (also per depth),
the tree-size and accepted-length histograms, and the estimated speedup over plain
decoding; and each target forward (`record_forward`) into the batch-size, nodes-per-forward
and speculative-tokens-per-forward histograms. `summarize(steps)` gives one request's figures (tau, mean tree size, token
counts). The server exports the totals as Prometheus metrics and the per-request summary
in each response; the adaptive controller keeps only its control state.

Definitions (docs/method.md, section 1):
- a step is one target forward over a tree (a plain step is a root-only tree, tau = 1);
- draft tokens: tree nodes verified, root excluded;
- accepted tokens: drafted (non-root, non-bonus) tokens that were committed;
- estimated speedup over AR: (AR step seconds) x (tokens committed / step seconds) over every
  step, drafted or not, with recent steps weighing most (each step's weight decays by
  SPEEDUP_DECAY per later step, about the last 200 steps count); the AR step time is the
  same-weighted mean of whole root-only steps (draft + verify + other seconds), or a one-token
  forward timed at start-up (`ar_probe_s`) before any such step was seen. Plain decoding alone
  reads exactly 1.
"""
from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Iterable

#: Upper bounds of the tree-size histogram (nodes, root included).
SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096, 8192)
#: Upper bounds of the accepted-length histogram (tokens per step, bonus included).
ACCEPT_BUCKETS = tuple(range(1, 17)) + (24, 32)
#: Upper bounds of the batch-size histogram (sequences per target forward).
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: Deepest depth counted in the per-depth acceptance totals (published drafters reach 15).
MAX_DEPTH_LABEL = 32
STEP_KINDS = ("draft", "cheap", "plain")
#: Per-step decay of the speedup estimate's sums (about the last 200 steps dominate).
SPEEDUP_DECAY = 0.995


@dataclass
class StepStats:
    """One verification step. Times in seconds; sizes in tokens.

    tree_size: nodes verified (root included); accepted: tokens committed this step
    (bonus included, after stop truncation); context_len: cached tokens before the step;
    a_hat: the tree's acceptance surrogate; drafted: whether the full drafter ran.
    accepted_depth: depth of the deepest accepted tree node (0 when only the bonus was committed);
    accepted_node: its index in the tree (0: the root).
    cheap: the tree came from the drafter's nearly free part (`Drafter.propose_cheap`)
    on a step where the controller had turned the full drafter off. prompt_tokens: other
    requests' prompt tokens prefilled in the same forward (`Engine.step_mixed`); the times
    include their compute.
    """

    tree_size: int
    accepted: int
    accepted_depth: int
    context_len: int
    a_hat: float
    drafted: bool
    draft_s: float
    verify_s: float
    other_s: float
    cheap: bool = False
    prompt_tokens: int = 0
    accepted_node: int = 0

    @property
    def kind(self) -> str:
        """'draft' (the full drafter ran), 'cheap' (only its free part) or 'plain'."""
        return "draft" if self.drafted else "cheap" if self.cheap else "plain"

    @property
    def accepted_drafted(self) -> int:
        """Drafted tokens committed this step (the bonus token excluded)."""
        return min(self.accepted_depth, self.accepted)


@dataclass(frozen=True)
class StepSummary:
    """One request's speculative figures over its steps (see `summarize`)."""

    steps: int
    tau: float
    mean_tree_size: float
    draft_tokens: int
    accepted_tokens: int


def summarize(steps: Iterable[StepStats]) -> StepSummary:
    """Steps, tau (committed tokens per step, bonus included), mean tree size, draft tokens
    (nodes verified, root excluded) and accepted drafted tokens over `steps`; zeros when empty."""
    n = committed = nodes = accepted = 0
    for s in steps:
        n += 1
        committed += s.accepted
        nodes += s.tree_size
        accepted += s.accepted_drafted
    return StepSummary(steps=n, tau=committed / n if n else 0.0, mean_tree_size=nodes / n if n else 0.0,
                       draft_tokens=nodes - n, accepted_tokens=accepted)


@dataclass
class Histogram:
    """Counts per upper bound (`bounds`, non-cumulative; the last slot is +Inf), with sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, x: float) -> None:
        self.counts[bisect_left(self.bounds, x)] += 1
        self.total += x
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """[(upper bound as text, cumulative count)] ending with '+Inf' (the Prometheus form)."""
        out, acc = [], 0
        for b, c in zip(list(self.bounds) + [float("inf")], self.counts):
            acc += c
            out.append(("+Inf" if b == float("inf") else str(float(b)), acc))
        return out

    def copy(self) -> "Histogram":
        return Histogram(self.bounds, list(self.counts), self.total, self.n)


class StepAccounting:
    """Running totals over every step an engine ran (thread-safe: the engine's worker records,
    a metrics scrape reads `snapshot()` from another thread).

    ar_probe_s: seconds of a one-token forward timed at start-up, the AR step time used by
    `speedup()` until a root-only step is seen (None: unknown).
    """

    def __init__(self, ar_probe_s: float | None = None):
        self.ar_probe_s = ar_probe_s
        self._lock = threading.Lock()
        self.steps_by_kind = dict.fromkeys(STEP_KINDS, 0)
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_depth = [0] * MAX_DEPTH_LABEL
        self.tree_size = Histogram(SIZE_BUCKETS)
        self.accepted_length = Histogram(ACCEPT_BUCKETS)
        # Per target forward (one step of a batch): sequences, tree tokens in all, drafted ones.
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.step_nodes = Histogram(SIZE_BUCKETS)
        self.step_speculative = Histogram(SIZE_BUCKETS)
        # Decayed sums: root-only steps (weight, seconds) and all steps (tokens, seconds).
        self._ar_w = 0.0
        self._ar_s = 0.0
        self._tokens = 0.0
        self._seconds = 0.0

    @property
    def steps(self) -> int:
        return sum(self.steps_by_kind.values())

    def record(self, st: StepStats) -> None:
        """Fold one step into the totals (its time into the speedup estimate only when no prompt
        tokens rode in its forward)."""
        accepted = st.accepted_drafted
        with self._lock:
            self.steps_by_kind[st.kind] += 1
            self.draft_tokens += st.tree_size - 1
            self.accepted_tokens += accepted
            for d in range(min(accepted, MAX_DEPTH_LABEL)):
                self.accepted_per_depth[d] += 1
            self.tree_size.observe(st.tree_size)
            self.accepted_length.observe(st.accepted)
            if st.prompt_tokens:  # its time is partly another request's prefill: not a decoding step's
                return
            seconds = st.draft_s + st.verify_s + st.other_s
            d = SPEEDUP_DECAY
            self._ar_w, self._ar_s = d * self._ar_w, d * self._ar_s
            if st.tree_size <= 1:
                self._ar_w += 1.0
                self._ar_s += seconds
            self._tokens = d * self._tokens + st.accepted
            self._seconds = d * self._seconds + seconds

    def record_forward(self, sizes: list[int]) -> None:
        """Fold one target forward of a (batched) step: sizes = each sequence's tree size."""
        with self._lock:
            self.batch_size.observe(len(sizes))
            self.step_nodes.observe(sum(sizes))
            self.step_speculative.observe(sum(sizes) - len(sizes))

    def _ar_sums(self) -> tuple[float, float] | None:
        """(seconds, weight) whose ratio is the AR step time: the decayed root-only sums while any
        are recorded, else (the start-up probe, 1), else None."""
        if self._ar_w > 1e-9:
            return self._ar_s, self._ar_w
        return None if self.ar_probe_s is None else (self.ar_probe_s, 1.0)

    @property
    def ar_step_s(self) -> float | None:
        """Recent mean seconds of a whole root-only step, else the start-up probe, else None."""
        sums = self._ar_sums()
        return None if sums is None else sums[0] / sums[1]

    def speedup(self) -> float:
        """AR step seconds x recent tokens per second over every step; 1.0 when undefined.

        Computed as (ar_s x tokens) / (ar_w x seconds), one division, so a run of plain steps
        only (ar_s == seconds, ar_w == tokens) reads exactly 1.0.
        """
        sums = self._ar_sums()
        if sums is None or self._seconds <= 0:
            return 1.0
        return (sums[0] * self._tokens) / (sums[1] * self._seconds)

    def snapshot(self) -> "StepAccounting":
        """A consistent copy of the totals, taken under the lock (for exporters)."""
        out = StepAccounting(self.ar_probe_s)
        with self._lock:
            out.steps_by_kind = dict(self.steps_by_kind)
            out.draft_tokens, out.accepted_tokens = self.draft_tokens, self.accepted_tokens
            out.accepted_per_depth = list(self.accepted_per_depth)
            out.tree_size, out.accepted_length = self.tree_size.copy(), self.accepted_length.copy()
            out.batch_size, out.step_nodes = self.batch_size.copy(), self.step_nodes.copy()
            out.step_speculative = self.step_speculative.copy()
            out._ar_w, out._ar_s = self._ar_w, self._ar_s
            out._tokens, out._seconds = self._tokens, self._seconds
        return out
