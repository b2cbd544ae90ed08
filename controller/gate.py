"""Never slower than AR: decide per step whether drafting pays, from measured throughput.

Two choices ("arms") compete: `draft` (run the full drafter and verify the adaptive tree) and
`off` (verify only the drafter's nearly free part, or the root alone). For each the gate keeps
an exponential average of the realised throughput of its recent steps,

    tokens per second = tokens committed (bonus included) / step seconds (draft + verify + other),

measured on the steps themselves: the plain-decoding baseline is never taken from the latency
model, so a calibration spoiled by a busy machine cannot make speculation look like a loss.
The next step takes the arm with the higher estimate. The other arm is still tried once every
`explore_every` steps of its rival (a bounded exploration rate), so one unlucky measurement
cannot lock an arm out for the rest of a request, or of the server's life. State lives in the
controller, so it carries across requests; `alpha` makes a request whose prompt is hard for the
drafter turn drafting down within a few steps, and an easy one turn it back up as fast.
"""
from __future__ import annotations

ARMS = ("draft", "off")


class SpeculationGate:
    """Per-step choice between drafting and not, from each choice's measured tokens per second.

    alpha: weight of the newest measurement in each arm's average. margin: `off` wins only when
    it is faster than `draft` by this fraction (a little hysteresis keeps a tie drafting).
    probe_steps: drafted steps measured before the first decision. explore_every: steps on
    'off' between single tries of drafting; while drafting leads, 'off' (whose throughput drifts
    only slowly, with the context) is re-measured every `off_every` steps (default 4 x
    explore_every). enabled=False: always draft (measuring
    every step's acceptance, e.g. for the surrogate check). Raises ValueError for bad values.
    """

    def __init__(self, alpha: float = 0.3, margin: float = 0.0, probe_steps: int = 2, explore_every: int = 16,
                 off_every: int | None = None, enabled: bool = True):
        off_every = 4 * explore_every if off_every is None else off_every
        if probe_steps < 1 or explore_every < 1 or off_every < 1 or not 0.0 < alpha <= 1.0:
            raise ValueError("probe_steps, explore_every and off_every must be >= 1 and alpha in (0, 1]")
        self.off_every = off_every
        self.enabled = enabled
        self.alpha = alpha
        self.margin = margin
        self.probe_steps = probe_steps
        self.explore_every = explore_every
        self.rate: dict[str, float | None] = dict.fromkeys(ARMS)  # tokens per second
        self.samples = dict.fromkeys(ARMS, 0)
        self._since_other = 0  # steps on the leading arm since the other was tried
        self.switches_off = 0  # times the leading arm became 'off'

    @property
    def leader(self) -> str:
        """The arm with the higher estimate (draft until both have been measured)."""
        draft, off = self.rate["draft"], self.rate["off"]
        if self.samples["draft"] < self.probe_steps or draft is None:
            return "draft"
        if off is None:
            return "off"  # drafting was measured and no baseline is known: measure it once
        return "off" if off > draft * (1.0 + self.margin) else "draft"

    def choice(self) -> str:
        """The arm the next step should use."""
        lead = self.leader
        if self._since_other >= (self.off_every if lead == "draft" else self.explore_every):
            return "off" if lead == "draft" else "draft"
        return lead

    def should_draft(self) -> bool:
        """True when the next step should run the full drafter."""
        return not self.enabled or self.choice() == "draft"

    def record(self, drafted: bool, tokens: int, seconds: float) -> None:
        """One finished step: which arm it used, tokens it committed, its seconds (all of it)."""
        arm = "draft" if drafted else "off"
        before = self.leader
        if seconds > 0:
            rate = tokens / seconds
            old = self.rate[arm] if self.samples[arm] else None  # a measurement replaces a prior
            self.rate[arm] = rate if old is None else old + self.alpha * (rate - old)
            self.samples[arm] += 1
        after = self.leader
        if arm == after and before == after:
            self._since_other += 1
        else:
            self._since_other = 0  # the other arm was just tried, or the lead changed
        if before == "draft" and after == "off":
            self.switches_off += 1

    def prior(self, arm: str, rate: float) -> None:
        """An estimate (tokens per second) for an arm not measured yet, e.g. the latency model's
        plain-step rate; the arm's first measurement replaces it."""
        if self.samples[arm] == 0 and rate > 0:
            self.rate[arm] = rate

    @property
    def gain(self) -> float | None:
        """Estimated speedup of drafting over not drafting (None until both were measured)."""
        draft, off = self.rate["draft"], self.rate["off"]
        return None if draft is None or off is None or off <= 0 else draft / off
