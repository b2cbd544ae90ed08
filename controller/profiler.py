"""Online profiler: per-step timings, running T_draft / T_other, background refit on drift.

Every step's verify time is compared with the model's prediction made before the step.
When the mean absolute percentage error over the last `window` steps exceeds `threshold`,
the four roofline parameters are refitted in a daemon thread from the recent steps plus the
calibration grid, and the new model replaces the old one with a single reference swap:
`record` never waits for a fit.
"""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from controller.latency_model import LatencyModel, fit_model, mape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """One verification: s tree tokens over c cached tokens; seconds measured and predicted."""

    s: int
    c: int
    verify_s: float
    predicted_s: float


class RunningMean:
    """Exponential moving average; `value` is `default` until the first sample."""

    __slots__ = ("alpha", "value", "count")

    def __init__(self, alpha: float, default: float = 0.0):
        self.alpha = alpha
        self.value = default
        self.count = 0

    def add(self, x: float) -> None:
        self.value = x if self.count == 0 else self.value + self.alpha * (x - self.value)
        self.count += 1


class OnlineProfiler:
    """Owns the current LatencyModel and keeps it honest.

    model: the calibrated starting model. calibration_points: [(s, c, seconds)] from
    calibration, re-used (at half weight) in every refit to anchor the shape of the curve;
    their level is re-anchored first: scaled by the median ratio of the recent steps' times to
    the calibrated model's predictions, since a calibration taken beside another process is
    uniformly slow and its shape, not its level, is what the steps cannot show.
    history: step records kept for refits. window: steps the drift error is measured over
    (and the minimum number of new steps between refits). threshold: drift MAPE (fraction)
    that triggers a refit. alpha: weight of the newest sample in T_draft / T_other.
    on_refit(model, mape_before, mape_after): called from the fitting thread after a swap.
    """

    def __init__(self, model: LatencyModel, calibration_points: Sequence[tuple[int, int, float]] = (),
                 history: int = 512, window: int = 64, threshold: float = 0.15, alpha: float = 0.1,
                 on_refit: Callable[[LatencyModel, float, float], None] | None = None):
        self.model = model
        self.calibrated = model
        self.calibration_points = list(calibration_points)
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=history)
        self.window = window
        self.threshold = threshold
        self.t_draft = RunningMean(alpha)
        self.t_other = RunningMean(alpha)
        self.t_other_ar = RunningMean(alpha)
        self.on_refit = on_refit
        self.refits = 0
        self.refit_failures = 0
        self._since_refit = 0
        self._thread: threading.Thread | None = None

    def record(self, s: int, c: int, verify_s: float, predicted_s: float, draft_s: float, other_s: float,
               drafted: bool) -> None:
        """Record one step (seconds); may start a background refit; returns at once."""
        if verify_s > 0:
            self.records.append(StepRecord(s, c, verify_s, predicted_s))
            self._since_refit += 1
        if drafted:
            self.t_draft.add(draft_s)
            self.t_other.add(other_s)
        else:
            self.t_other_ar.add(other_s)
        if self._since_refit >= self.window and not self.refitting:
            err = self.recent_mape()
            if err > self.threshold:
                self._start_refit(err)

    def recent_mape(self, n: int | None = None) -> float:
        """MAPE (fraction) of the predictions made for the last n (default `window`) steps."""
        n = n or self.window
        recent = list(self.records)[-n:]
        return mape([r.verify_s for r in recent], [r.predicted_s for r in recent])

    @property
    def refitting(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_refit(self, timeout: float | None = None) -> bool:
        """Block until the running refit (if any) ends; True when none is running afterwards. For tests and shutdown."""
        t = self._thread
        if t is not None:
            t.join(timeout)
        return not self.refitting

    def _start_refit(self, err: float) -> None:
        recent = list(self.records)
        self._since_refit = 0
        self._thread = threading.Thread(target=self._refit, args=(recent, err), name="bastion-refit", daemon=True)
        self._thread.start()

    def _refit(self, recent: list[StepRecord], err_before: float) -> None:
        old = self.model
        pts = [(r.s, r.c, r.verify_s, 1.0) for r in recent]
        level = 1.0
        if recent:
            base = self.calibrated.predict(np.array([r.s for r in recent]), np.array([r.c for r in recent]))
            level = float(np.median(np.array([r.verify_s for r in recent]) / base))
        pts += [(s, c, t * level, 2.0) for s, c, t in self.calibration_points]
        arr = np.asarray(pts, dtype=np.float64)
        try:
            new = fit_model(old.shape, old.ceilings, arr[:, 0], arr[:, 1], arr[:, 2], sigma_scale=arr[:, 3],
                            knots=old.knots)
        except ValueError as e:
            self.refit_failures += 1
            log.warning("online refit failed: %s", e)
            return
        params = new.params
        window = recent[-self.window:]
        err_after = mape([r.verify_s for r in window], new.predict([r.s for r in window], [r.c for r in window]))
        self.model = new
        self.refits += 1
        log.info("latency model refitted: recent MAPE %.1f %% -> %.1f %% (%s)", 100 * err_before, 100 * err_after,
                 params)
        if self.on_refit is not None:
            self.on_refit(new, err_before, err_after)
