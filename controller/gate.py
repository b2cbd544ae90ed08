"""Never slower than AR: decide per step whether drafting pays for itself.

A speculative step's gain is its realised throughput over plain decoding's:
    gain = accepted * T_ar / (T_draft + T_verify + T_other)
(accepted = tokens committed, bonus included; T_ar = seconds of one plain decoding step at
the same context). The gate keeps an exponential average of gain over recent speculative
steps. Below 1 it turns drafting off for `backoff` plain steps, then probes; each failed probe
doubles the backoff (up to a cap), a successful one resets it.

A probe that loses costs about (T_draft + C(n) - C(1)) - (accepted - 1) * T_ar, so probing is
kept short: `probe_steps` steps decide at start, a single step after each pause (the running
average then keeps judging every later step). Measured on the 2-core CPU with the shipped
drafter on MT-Bench, three-step probes from a 4-step backoff cost about 12-17 % against AR over
128 tokens; see docs/controller.md.
"""
from __future__ import annotations


class SpeculationGate:
    """Per-step on/off switch for drafting, with probing and exponential backoff.

    alpha: weight of the newest gain in the running average. threshold: the gain
    speculation must keep (1.0 = break-even with AR). probe_steps: speculative steps
    measured before the first decision. reprobe_steps: the same after each pause.
    base_backoff / max_backoff: plain steps between probes, doubling while speculation
    keeps losing. Raises ValueError for non-positive step counts.
    """

    def __init__(self, alpha: float = 0.3, threshold: float = 1.0, probe_steps: int = 2,
                 reprobe_steps: int = 1, base_backoff: int = 8, max_backoff: int = 256):
        if min(probe_steps, reprobe_steps, base_backoff, max_backoff) < 1:
            raise ValueError("probe lengths and backoffs must be >= 1")
        self.alpha = alpha
        self.threshold = threshold
        self.probe_steps = probe_steps
        self.reprobe_steps = reprobe_steps
        self._probe = probe_steps  # steps the current probe lasts
        self.base_backoff = base_backoff
        self.max_backoff = max_backoff
        self.backoff = base_backoff
        self.wait = 0  # plain steps left before the next probe
        self.committed = False  # past the probe: speculating until the average drops
        self.gain: float | None = None  # running average since the last switch
        self._since = 0
        self.switches_off = 0

    def should_draft(self) -> bool:
        """True when the next step should draft (speculating, or probing)."""
        return self.wait == 0

    def record(self, drafted: bool, gain: float | None = None) -> None:
        """One finished step. drafted: it used the drafter; gain: its realised gain (needed when drafted)."""
        if not drafted:
            if self.wait > 0:
                self.wait -= 1
            return
        if gain is None:
            raise ValueError("a speculative step needs its gain")
        self.gain = gain if self.gain is None else self.gain + self.alpha * (gain - self.gain)
        self._since += 1
        if self._since < self._probe:
            return
        if self.gain >= self.threshold:
            if not self.committed:
                self.committed = True
                self.backoff = self.base_backoff
        else:
            self._turn_off()

    def pause(self) -> None:
        """Turn drafting off now, for the current backoff (as after a losing probe)."""
        self._turn_off()

    def _turn_off(self) -> None:
        self.wait = self.backoff
        self.backoff = min(2 * self.backoff, self.max_backoff)
        self.committed = False
        self.gain = None
        self._since = 0
        self._probe = self.reprobe_steps
        self.switches_off += 1
