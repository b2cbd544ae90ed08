"""Never slower than AR: choose per step between plain decoding, the drafter's free tree and a full draft.

Each choice ("arm") is judged by its realised gain, its throughput over plain decoding's:
    gain = accepted * T_plain / (T_draft + T_verify + T_other)
(accepted = tokens committed, bonus included; T_plain = seconds of one plain decoding step at the
same context, measured where plain steps have run). Plain decoding's gain is 1 by definition.
The gate keeps an exponential average of each arm's gain and picks the best. It never locks
an arm out: an arm that is not the best is sampled again after
    period = min(E, max(MIN_PERIOD, 1 + 2 E gap)),   gap = 1 - g_arm / g_best,  E = explore_every
steps without a sample, and at once if its last sample beat the best arm's average. Near-ties
(where one step's noise decides) are thus re-checked every MIN_PERIOD steps (so the best arm
keeps most steps and its own average stays fresh), a clear loser only every E steps. What it
costs and buys:
- a sample of an arm behind by `gap` costs `gap` of that step's time, once per period: for
  steps about as long as the best arm's, a losing arm costs gap / (1 + 2 E gap) < 1 / (2 E)
  of the throughput while gap < 1/2 (under 0.8 % at the default E = 64) and about gap / E
  beyond (the period is capped at E), plus the rare immediate re-samples of a noisy loser.
  A losing step that is much longer than the best arm's costs more: in bfloat16 without AMX
  an 8-node tree took 4.9 plain steps' time for 1.37 tokens, so a sample like it loses 3.5
  plain steps, 5.5 % at E = 64 (docs/results/controller_bench.md);
- every arm is sampled at least once per explore_every steps, so a drafter that starts paying
  is back within explore_every steps plus the few samples its average needs to cross the
  best (consecutive, since each winning sample is followed at once).
An arm's average weighs its newest gain by max(alpha, 1 / n) over its n samples (a mean of the
first few, then exponential). The averages are state of the machine and the drafter, so they
carry from request to request;
alpha = 0.15 turns speculation down within six steps of a prompt where the drafter stops paying
(gain 1.5 -> 0.6) and, against the geometric noise of accepted lengths, keeps a drafter worth
1.4x on for about 90 % of steps in the simulated machine of tests/test_controller_robust.py
(0.3 reacted in three steps but dropped that to about 77 %). The rule is
described in docs/method.md (section 8) and measured in docs/controller.md ("Robust choices").
"""
from __future__ import annotations

ARMS = ("draft", "cheap", "plain")
#: The shortest wait between samples of an arm that is not the best (near-ties).
MIN_PERIOD = 8


class SpeculationGate:
    """Per-step choice among `arms` by exponential averages of realised gain, with a floor on exploration.

    arms: the choices allowed, a subset of ARMS ("draft": the full drafter; "cheap": only the
    drafter's free proposal, `Drafter.propose_cheap`; "plain": one token, gain 1 by definition).
    alpha: weight of the newest gain in an arm's average. explore_every: the longest an arm
    that is not the best waits for its next sample (shorter the closer it is to the best; see
    the module docstring). Arms never sampled come first (draft, then cheap).
    Raises ValueError for an unknown arm, no arm, alpha outside (0, 1] or explore_every < 1.
    """

    def __init__(self, alpha: float = 0.15, explore_every: int = 64, arms: tuple[str, ...] = ARMS):
        if not arms or any(a not in ARMS for a in arms):
            raise ValueError(f"arms must be a non-empty subset of {ARMS}, got {arms!r}")
        if not 0.0 < alpha <= 1.0 or explore_every < 1:
            raise ValueError("alpha must be in (0, 1] and explore_every >= 1")
        self.arms = tuple(a for a in ARMS if a in arms)  # fixed order: untried arms are tried in it
        self.alpha = alpha
        self.explore_every = explore_every
        self.gain: dict[str, float | None] = {a: (1.0 if a == "plain" else None) for a in self.arms}
        self.samples = {a: 0 for a in self.arms}
        self._n = {a: 0 for a in self.arms}  # samples in the average, an inherited one included
        self.last = {a: 0 for a in self.arms}  # step count at the arm's latest sample
        self.last_gain: dict[str, float | None] = {a: None for a in self.arms}
        self.t = 0
        self.switches_off = 0  # times the best arm changed away from "draft"

    def best(self) -> str:
        """The arm with the highest average gain (untried arms do not count; ties go to plain, then draft)."""
        known = sorted((a for a in self.arms if self.gain[a] is not None), key=lambda a: a != "plain")
        if not known:
            return self.arms[0]
        return max(known, key=lambda a: self.gain[a])

    def choice(self) -> str:
        """The arm the next step should use. Pure: it changes only when `record` is called."""
        for a in self.arms:
            if self.gain[a] is None:
                return a
        best = self.best()
        g_best = self.gain[best]
        for a in self.arms:  # an arm whose last sample beat the best deserves another look now
            if a != best and self.last_gain[a] is not None and self.last_gain[a] > g_best:
                return a
        stale = [a for a in self.arms if a != best and self.t - self.last[a] >= self.period(a)]
        if stale:
            return min(stale, key=lambda a: self.last[a])
        return best

    def period(self, arm: str) -> int:
        """Steps `arm` may go unsampled while it is not the best: min(E, max(MIN_PERIOD, 1 + 2 E gap))."""
        g, g_best = self.gain[arm], self.gain[self.best()]
        if g is None or g_best <= 0:
            return 1
        gap = max(1.0 - g / g_best, 0.0)
        return int(min(self.explore_every, max(MIN_PERIOD, 1 + 2 * self.explore_every * gap)))

    def should_draft(self) -> bool:
        """True when the next step should run the full drafter."""
        return self.choice() == "draft"

    def record(self, arm: str, gain: float = 1.0) -> None:
        """One finished step that used `arm`, with its realised gain (ignored for "plain": 1).

        Raises ValueError for an arm this gate does not have or a negative gain.
        """
        if arm not in self.gain:
            raise ValueError(f"unknown arm {arm!r}; this gate has {self.arms}")
        if not 0 <= gain < float("inf"):
            raise ValueError(f"gain must be a finite non-negative number, got {gain}")
        was = self.best()
        self.t += 1
        self.samples[arm] += 1
        self._n[arm] += 1
        self.last[arm] = self.t
        if arm == "plain":
            gain = 1.0
        else:
            old = self.gain[arm]
            w = max(self.alpha, 1.0 / self._n[arm])
            self.gain[arm] = gain if old is None else old + w * (gain - old)
        self.last_gain[arm] = gain
        if was == "draft" and self.best() != "draft":
            self.switches_off += 1

    def tick(self) -> None:
        """A step that used no arm of this gate (for example, nothing left to draft): time passes."""
        self.t += 1

    def inherit(self, other: "SpeculationGate") -> None:
        """Start from another gate's averages (a new batch-size class from its neighbour's), each
        counted as one sample, so this class's first own sample weighs half."""
        for a in self.arms:
            if a != "plain" and other.gain.get(a) is not None:
                self.gain[a] = other.gain[a]
                self.last_gain[a] = other.gain[a]
                self._n[a] = 1

    def snapshot(self) -> dict:
        """JSON-ready: average gain and samples per arm, the current choice, switches away from drafting."""
        return {"gain": dict(self.gain), "samples": dict(self.samples), "choice": self.choice(),
                "switches_off": self.switches_off}
