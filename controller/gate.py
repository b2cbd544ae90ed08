"""Never slower than AR: choose per step between plain decoding, the drafter's free tree and a full draft.

Each choice ("arm") is judged by its realised gain, its throughput over plain decoding's:
    gain = accepted * T_plain / (T_draft + T_verify + T_other)
(accepted = tokens committed, bonus included; T_plain = seconds of one plain decoding step at the
same context, measured where plain steps have run). Plain decoding's gain is 1 by definition.
The gate keeps an exponential average of each arm's gain and of its step length (seconds in
units of a plain step, 1 for plain) and picks the best. It never locks an arm out: an arm that
is not the best is sampled again after
    period = min(E r, max(MIN_PERIOD, 1 + 2 E r gap)),   gap = 1 - g_arm / g_best,  E = explore_every,
    r = clamp(length_arm / length_best, 1, R_MAX)   (1 while a length is unknown)
steps without a sample (MIN_PERIOD for the first own sample of an average inherited from another
gate, see `inherit`), and at once if its last sample beat the best arm's average. Near-ties
(where one step's noise decides) are thus re-checked every MIN_PERIOD steps (so the best arm
keeps most steps and its own average stays fresh), a clear loser only every E r steps. What it
costs and buys:
- a sample of an arm behind by `gap` whose step is r times the best arm's loses r gap of a
  best-arm step's output, once per period: a losing arm costs r gap / (1 + 2 E r gap) < 1 / (2 E)
  of the throughput while r gap < 1/2 (under 0.8 % at the default E = 64) and about gap / E
  beyond (the period is capped at E r), plus the rare immediate re-samples of a noisy loser.
  Scaling by r matters where losing steps are long: in bfloat16 without AMX an 8-node tree
  took 4.9 plain steps' time for 1.37 tokens (gap 0.72), so a sample lost 3.5 plain steps:
  5.5 % of the time at a period of E = 64, 1.4 % at E r = 256 (docs/results/controller_bench.md);
  steps longer than R_MAX times the best arm's cost up to (r / R_MAX) gap / E;
- every arm is sampled at least once per E R_MAX steps (once per E steps while its steps are
  no longer than the best arm's), so a drafter that starts paying is back within that many
  steps plus the few samples its average needs to cross the best (consecutive, since each
  winning sample is followed at once).
While an arm has fewer than CONFIDENT_SAMPLES samples in its average, its period is scaled by
n / CONFIDENT_SAMPLES (never below MIN_PERIOD): one unlucky first sample (a cold start, a hard
first prompt) then costs a quarter of the full wait, not E r steps. Measured: a single first
draft sample at gain 0.35 and length 2.8 kept the drafter off for 181 steps, longer than a
whole benchmark cell at two clients (docs/results/concurrency_bench.md).
An arm's averages weigh its newest gain by max(alpha, 1 / n) (fast) and max(slow_alpha, 1 / n)
(slow) over its n samples (a mean of the first few, then exponential). The averages are state
of the machine and the drafter, so they carry from request to request; a prompt where the
drafter stops paying (gain 1.5 -> 0.6, samples spread by 0.3) turns speculation down within
eight steps (the slow average follows the fast one on the shift). The rule is
described in docs/method.md (section 8) and measured in docs/controller.md ("Robust choices").
Two averages per arm, and a margin for plain decoding (docs/method.md, section 8, "Near-ties"):
accepted lengths are geometric, so most samples of a drafter worth 1.2x plain decoding fall below 1
(at 1.65 tokens a step, three samples in five commit one token: gain 0.74), and a fast average dips under plain decoding
often; while it is under, the arm is sampled only every period, so each dip lasted many steps. In a
simulation of that machine (tests/test_controller_gate.py) a single average at alpha 0.15 kept a
1.22x drafter at 0.89 of its throughput. The gate therefore decides on a slow average (weight
`slow_alpha`) that jumps to the fast one (weight `alpha`) when the two part by more than
`shift_sigmas` standard errors of the fast one (a prompt where the drafter stops paying), and it
counts plain decoding as 1 - `plain_margin` when it compares: a speculative arm within the margin
of plain decoding keeps running (its samples are what tells whether it pays; plain decoding's
tell nothing). The margin bounds what that costs where drafting loses slightly; the simulation's
worst loss over gains 0.8-1.6 was 2 % (11 % before).
"""
from __future__ import annotations

import math

ARMS = ("draft", "cheap", "plain")
#: Weight of the newest gain in an arm's decision average (the slow one).
SLOW_ALPHA = 0.06
#: The decision average jumps to the fast one when they part by this many of the fast one's standard errors.
SHIFT_SIGMAS = 2.5
#: Plain decoding counts as 1 - PLAIN_MARGIN when arms are compared (the module docstring).
PLAIN_MARGIN = 0.1
#: The shortest wait between samples of an arm that is not the best (near-ties).
MIN_PERIOD = 8
#: The most the exploration period stretches for an arm whose steps are longer than the best's.
R_MAX = 4.0
#: Samples after which an arm's average is trusted for the full exploration period.
CONFIDENT_SAMPLES = 4
#: Samples an inherited average counts as (`inherit`): a request's own gate then needs about
#: four of its own samples to overturn what every earlier request measured. At one sample, the
#: first unlucky draft of a request (accepted lengths are geometric) halved the prior: 58-62 %
#: of the benchmark's steps stayed plain, and on HumanEval, where fixed 4-16-node trees ran
#: 1.15-1.47x faster than plain decoding, bastion committed 1.13 tokens a step in float32
#: (docs/controller.md, "The cost of the controller itself").
INHERIT_SAMPLES = 4


class SpeculationGate:
    """Per-step choice among `arms` by exponential averages of realised gain, with a floor on exploration.

    arms: the choices allowed, a subset of ARMS ("draft": the full drafter; "cheap": only the
    drafter's free proposal, `Drafter.propose_cheap`; "plain": one token, gain 1 by definition).
    alpha: weight of the newest gain in an arm's fast average. slow_alpha: the same for its
    decision average (`gain`), which jumps to the fast one when they part by more than
    shift_sigmas standard errors of the fast one. plain_margin: plain decoding counts as
    1 - plain_margin when arms are compared (its `gain` stays 1; a negative margin makes a
    speculative arm beat plain decoding by that much, as in batches of three or more,
    controller/budget.py).
    explore_every: the longest an arm that is not the best waits for its next sample (shorter the
    closer it is to the best; see the module docstring). Arms never sampled come first (draft, then cheap).
    Raises ValueError for an unknown arm, no arm, alpha or slow_alpha outside (0, 1],
    shift_sigmas <= 0, plain_margin outside (-1, 1) or explore_every < 1.
    """

    def __init__(self, alpha: float = 0.15, explore_every: int = 64, arms: tuple[str, ...] = ARMS,
                 slow_alpha: float = SLOW_ALPHA, shift_sigmas: float = SHIFT_SIGMAS,
                 plain_margin: float = PLAIN_MARGIN):
        if not arms or any(a not in ARMS for a in arms):
            raise ValueError(f"arms must be a non-empty subset of {ARMS}, got {arms!r}")
        if not (0.0 < alpha <= 1.0 and 0.0 < slow_alpha <= 1.0) or explore_every < 1:
            raise ValueError("alpha and slow_alpha must be in (0, 1] and explore_every >= 1")
        if not shift_sigmas > 0 or not -1.0 < plain_margin < 1.0:
            raise ValueError("shift_sigmas must be > 0 and plain_margin in (-1, 1)")
        self.arms = tuple(a for a in ARMS if a in arms)  # fixed order: untried arms are tried in it
        self.alpha = alpha
        self.slow_alpha = slow_alpha
        self.shift_sigmas = shift_sigmas
        self.plain_margin = plain_margin
        self.explore_every = explore_every
        self.gain: dict[str, float | None] = {a: (1.0 if a == "plain" else None) for a in self.arms}
        self.fast: dict[str, float | None] = {a: None for a in self.arms}  # fast average of gain
        self.spread: dict[str, float] = {a: 0.0 for a in self.arms}  # exponential variance around `fast`
        self.shifts = 0  # times a decision average jumped to its fast one
        self.length: dict[str, float | None] = {a: (1.0 if a == "plain" else None) for a in self.arms}
        self.samples = {a: 0 for a in self.arms}
        self._n = {a: 0 for a in self.arms}  # samples in the average, an inherited one included
        self.last = {a: 0 for a in self.arms}  # step count at the arm's latest sample
        self.last_gain: dict[str, float | None] = {a: None for a in self.arms}
        self.t = 0
        self.switches_off = 0  # times the best arm changed away from "draft"
        self.forced: str | None = None  # `force`: the arm every choice returns while set
        self.once: str | None = None  # `sample`: the arm the next choice returns

    def value(self, arm: str) -> float | None:
        """What `arm` counts as when arms are compared: its decision average, 1 - plain_margin for plain."""
        return 1.0 - self.plain_margin if arm == "plain" else self.gain[arm]

    def best(self, without: str | None = None) -> str:
        """The arm of the highest `value` (untried arms do not count; ties go to plain, then draft);
        without: an arm left out of the comparison."""
        arms = [a for a in self.arms if a != without]
        known = sorted((a for a in arms if self.gain[a] is not None), key=lambda a: a != "plain")
        if not known:
            return arms[0]
        return max(known, key=self.value)

    def choice(self) -> str:
        """The arm the next step should use. Pure: it changes only when `record`, `tick`, `force` or
        `sample` is called."""
        if self.forced is not None:
            return self.forced
        if self.once is not None:
            return self.once
        for a in self.arms:
            if self.gain[a] is None:
                return a
        best = self.best()
        g_best = self.value(best)
        for a in self.arms:  # an arm whose last sample beat the best deserves another look now
            last = self.value(a) if a == "plain" else self.last_gain[a]
            if a != best and self.last_gain[a] is not None and last > g_best:
                return a
        stale = [a for a in self.arms if a != best and self.t - self.last[a] >= self.period(a)]
        if stale:
            return min(stale, key=lambda a: self.last[a])
        return best

    def period(self, arm: str) -> int:
        """Steps `arm` may go unsampled while it is not the best: min(E r, max(MIN_PERIOD, 1 + 2 E r gap)),
        scaled by n / CONFIDENT_SAMPLES while the arm has n < CONFIDENT_SAMPLES samples (the module docstring)."""
        best = self.best()
        g, g_best = self.value(arm), self.value(best)
        if g is None or g_best <= 0:
            return 1
        if arm != "plain" and self.samples[arm] == 0:
            # Only an inherited average (`inherit`): it says what paid for other requests (or
            # another batch size); this gate's first own sample comes soon, so a request whose
            # content suits an arm that the earlier ones did not is not decided by them alone.
            return MIN_PERIOD
        gap = max(1.0 - g / g_best, 0.0)
        la, lb = self.length[arm], self.length[best]
        r = 1.0 if la is None or not lb else min(max(la / lb, 1.0), R_MAX)
        every = self.explore_every * r
        period = min(every, max(MIN_PERIOD, 1 + 2 * every * gap))
        # Plain decoding's gain is 1 by definition: nothing to be unsure of.
        confidence = 1.0 if arm == "plain" else min(1.0, self._n[arm] / CONFIDENT_SAMPLES)
        return int(max(min(period, MIN_PERIOD), period * confidence))

    def force(self, arm: str | None) -> None:
        """Make every choice `arm` until force(None) (a start-up run that samples each arm in
        turn, bastion.factory.prime_gate); samples are recorded as usual.
        Raises ValueError for an arm this gate does not have."""
        if arm is not None and arm not in self.arms:
            raise ValueError(f"unknown arm {arm!r}; this gate has {self.arms}")
        self.forced = arm

    def sample(self, arm: str) -> None:
        """Make the next choice `arm`, once: cleared by the next `record` or `tick` (a plain step
        that refreshes the measured baseline, controller/budget.py). Raises ValueError for an
        arm this gate does not have."""
        if arm not in self.arms:
            raise ValueError(f"unknown arm {arm!r}; this gate has {self.arms}")
        self.once = arm

    def should_draft(self) -> bool:
        """True when the next step should run the full drafter."""
        return self.choice() == "draft"

    def record(self, arm: str, gain: float = 1.0, length: float | None = None, alpha: float | None = None) -> None:
        """One finished step that used `arm`, with its realised gain (ignored for "plain": 1) and
        its length: the step's seconds over a plain step's at the same context (None: unknown;
        ignored for "plain": 1). alpha: this sample's weight instead of the gate's own (a
        shared gate fed by requests' steps learns slower than the requests' own gates).

        Raises ValueError for an arm this gate does not have, a negative gain or a length <= 0.
        """
        if arm not in self.gain:
            raise ValueError(f"unknown arm {arm!r}; this gate has {self.arms}")
        if not 0 <= gain < float("inf"):
            raise ValueError(f"gain must be a finite non-negative number, got {gain}")
        if length is not None and not 0 < length < float("inf"):
            raise ValueError(f"length must be a finite positive number, got {length}")
        was = self.best()
        self.once = None
        self.t += 1
        self.samples[arm] += 1
        self._n[arm] += 1
        self.last[arm] = self.t
        if arm == "plain":
            gain = 1.0
        else:
            n = self._n[arm]
            w = max(self.alpha if alpha is None else alpha, 1.0 / n)
            w_slow = max(self.slow_alpha if alpha is None else min(alpha, self.slow_alpha), 1.0 / n)
            self._average(arm, gain, w, w_slow, n)
            if length is not None:
                old_len = self.length[arm]
                self.length[arm] = length if old_len is None else old_len + w * (length - old_len)
        self.last_gain[arm] = gain
        if was == "draft" and self.best() != "draft":
            self.switches_off += 1

    def _average(self, arm: str, gain: float, w: float, w_slow: float, n: int) -> None:
        """Fold one gain into `arm`'s fast average (weight w), its noise and its decision average
        (weight w_slow), which jumps to the fast one on a shift (the module docstring)."""
        fast = self.fast[arm]
        if fast is None:
            self.fast[arm] = self.gain[arm] = gain
            return
        d = gain - fast
        # the fast average's standard error from the noise seen before this sample (an exponential
        # average of weight w over i.i.d. gains)
        sd = math.sqrt(self.spread[arm] * w / (2.0 - w))
        # the noise is learnt four times slower than the slow average, so a shift does not hide itself
        w_noise = max(w_slow / 4, 1.0 / n)
        self.spread[arm] = (1.0 - w_noise) * (self.spread[arm] + w_noise * d * d)
        self.fast[arm] = fast = fast + w * d
        slow = self.gain[arm] + w_slow * (gain - self.gain[arm])
        if n > CONFIDENT_SAMPLES and abs(fast - slow) > self.shift_sigmas * sd:
            slow = fast  # the arm's gain moved (a new prompt, a busy machine): follow at once
            self.shifts += 1
        self.gain[arm] = slow

    def tick(self) -> None:
        """A step that used no arm of this gate (for example, nothing left to draft): time passes."""
        self.once = None
        self.t += 1

    def inherit(self, other: "SpeculationGate") -> None:
        """Start from another gate's averages (a request's own gate from the shared one, a new
        batch-size class from its neighbour's), each counted as INHERIT_SAMPLES samples, so this
        gate's own first sample weighs 1 / (INHERIT_SAMPLES + 1). An inherited arm that is not the
        best gets its first own sample MIN_PERIOD steps in (`period`), whatever its gap: on the
        benchmark's MT-Bench -> HumanEval -> math order, the draft arm's average from MT-Bench
        (0.8) kept it unsampled through whole math requests, where 8-node drafts paid 1.3x
        (docs/controller.md, "An avx2-only machine")."""
        for a in self.arms:
            if a != "plain" and other.gain.get(a) is not None:
                self.gain[a] = other.gain[a]
                self.fast[a] = other.fast.get(a, other.gain[a])
                self.spread[a] = other.spread.get(a, 0.0)
                self.length[a] = other.length.get(a)
                self.last_gain[a] = other.gain[a]
                self._n[a] = INHERIT_SAMPLES

    def snapshot(self) -> dict:
        """JSON-ready: average gain and samples per arm, the current choice, switches away from drafting."""
        return {"gain": dict(self.gain), "length": dict(self.length), "samples": dict(self.samples),
                "choice": self.choice(), "fast": dict(self.fast), "shifts": self.shifts,
                "switches_off": self.switches_off}
