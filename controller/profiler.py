"""Online profiler: per-step timings, running T_draft / T_other, inline refit on drift.

Every step's verify time is compared with the model's prediction made before the step.
When the mean absolute percentage error over the last `window` steps exceeds `threshold`
and the model is biased (the median of measured / predicted is off 1 by more than
`bias_threshold`), the four roofline parameters are refitted from the recent steps plus the
calibration grid's points at the sizes the steps have not measured yet (`anchor_points`),
starting from the current ones, and the new model replaces the old one.

The refit runs inline, between two steps (~15 ms), not in a background thread: a thread fitting
in scipy held the interpreter lock while the step's forward, which dispatches hundreds of ops
from Python, waited for it, and on a 2-core machine the two also fought for the cores: plain
steps took 100-680 ms instead of 18 while a refit ran, and the verifications of a whole run
were 1.2-1.8 ms (7-10 %) slower than with refits off. Why the bias condition: a fit cannot
remove noise; on a noisy VM the error of an unbiased model crossed 15 % in bursts and started
a refit every 100-200 plain steps. For the same reason a refit that does not cut the error by
a fifth doubles the wait before the next check (up to MAX_WAIT windows). Drift checks run
every CHECK_EVERY steps, not every step (each costs ~0.2 ms).

Drift checks judge the current model (predictions made at the check, not the stored ones) and
also refit when plain steps and trees are off by different factors (a wrong shape, even with
an overall median near 1).

Between refits the model's level follows the machine: at each check that does not refit, the
median ratio measured / predicted over the last LEVEL_WINDOW steps (plain steps and trees
each, their geometric mean), when it is off 1 by more than `bias_threshold`, rescales the
whole curve (`LatencyModel.scaled`; no fit), unless the two kinds disagree (then the shape is
wrong and the refit is left to repair it). A shared VM's speed moves by 20-40 % within minutes
(plain steps 36 -> 56 ms with nothing else of ours running, docs/controller.md "Level
tracking"); a fit is not needed for that, and waiting for the next refit left the online error
at 22-30 % for the rest of a run. The cost figures above were measured in bfloat16 on a 2-core
EPYC (docs/controller.md, "The cost of the controller itself").
"""
from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from controller.latency_model import LatencyModel, fit_model, mape, nearest_knot

log = logging.getLogger(__name__)

#: Fit rounds of an online refit (controller.latency_model.fit_model), which starts from the
#: current parameters and the joint line fit: 2 rounds from these 2 starts cost 15-50 ms
#: against ~70 ms for the calibration's 3 rounds from 4 starts (2-core EPYC).
REFIT_ROUNDS = 2

#: Model evaluations per start of an online refit's fit (controller.latency_model.fit_params): the
#: start is the current model, so a fit that needs more meets data it cannot fit (a busy
#: calibration's points against quiet steps). Uncapped (2000), such refits took up to 300 ms
#: inline, between two steps of 25 ms (bfloat16, avx512_bf16 EPYC); capped at 200, one took 94 ms.
REFIT_MAX_NFEV = 300

#: After refits that did not cut the error (noise, not drift), drift checks wait up to this
#: many windows.
MAX_WAIT = 8

#: Steps between two drift checks (a refit once `window` steps have run since the last one,
#: else a rescale of the model's level).
CHECK_EVERY = 8

#: Recent steps whose median measured / predicted ratio sets the model's level between refits:
#: 32 steps' median moves ~2 % with the ~10 % per-step jitter of a VM, under the 5 % bias
#: threshold, and follows a change of the machine's speed within 32-40 steps.
LEVEL_WINDOW = 32

#: Steps of a kind (plain, s = 1; trees, s > 1) before its own median ratio counts.
PLAIN_MIN = 4

#: Recent steps nearest a residual knot that supersede the calibration's points there in a refit
#: (`OnlineProfiler.anchor_points`): 8 steps' median is within ~5 % of the size's time at the
#: ~10 % per-step jitter of a VM, closer than a calibration point timed beside other work.
MEASURED_KNOT = 8


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
    calibration, re-used (at half weight) in every refit to anchor the shape of the curve at the
    sizes the steps have not measured (`anchor_points`); their level is re-anchored first:
    scaled by the median ratio of the recent steps' times to the calibrated model's
    predictions, since the steps, not the calibration, show the machine's speed now.
    history: step records kept for refits. window: steps the drift error is measured over
    (and the minimum number of new steps between refits). threshold: drift MAPE (fraction)
    that triggers a refit, when the model is also biased by more than bias_threshold (a
    fraction; default threshold / 3): |median(measured / predicted) - 1|. alpha: weight of the newest sample in T_draft / T_other.
    on_refit(model, mape_before, mape_after): called after a refit's swap.
    on_rescale(model, factor): called after the level was rescaled by factor.
    level_window: steps whose median ratio sets the level between refits (0: no rescales).
    measured_knot: recent steps at a residual knot that supersede the calibration's points there
    (`anchor_points`; math.inf keeps them all).
    """

    def __init__(self, model: LatencyModel, calibration_points: Sequence[tuple[int, int, float]] = (),
                 history: int = 512, window: int = 64, threshold: float = 0.15, alpha: float = 0.1,
                 on_refit: Callable[[LatencyModel, float, float], None] | None = None,
                 bias_threshold: float | None = None,
                 on_rescale: Callable[[LatencyModel, float], None] | None = None,
                 level_window: int = LEVEL_WINDOW, measured_knot: float = MEASURED_KNOT):
        self.model = model
        self.calibrated = model
        self.calibration_points = list(calibration_points)
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=history)
        self.window = window
        self.threshold = threshold
        self.bias_threshold = threshold / 3 if bias_threshold is None else bias_threshold
        self.t_draft = RunningMean(alpha)
        self.t_other = RunningMean(alpha)
        self.t_other_ar = RunningMean(alpha)
        self.on_refit = on_refit
        self.on_rescale = on_rescale
        self.refits = 0
        self.rescales = 0
        self.level_window = level_window
        self.measured_knot = measured_knot
        self._steps = 0
        self.refit_failures = 0
        self._since_refit = 0
        self._wait = window  # steps before the next drift check: doubled after a refit that did not help

    def record(self, s: int, c: int, verify_s: float, predicted_s: float, draft_s: float, other_s: float,
               drafted: bool) -> None:
        """Record one step (seconds); may refit the model (inline, ~15 ms; see the module docstring)."""
        if verify_s > 0:
            self.records.append(StepRecord(s, c, verify_s, predicted_s))
            self._since_refit += 1
        if drafted:
            self.t_draft.add(draft_s)
            self.t_other.add(other_s)
        else:
            self.t_other_ar.add(other_s)
        self._steps += 1
        if self._steps % CHECK_EVERY:
            return
        if self._since_refit >= self._wait:
            recent = list(self.records)[-self.window:]
            err, bias, split = self._current_error(recent)
            if err > self.threshold and (abs(bias) > self.bias_threshold or split > self.bias_threshold):
                self._since_refit = 0
                self._refit(list(self.records), err)
                return
        self._relevel()

    def _current_error(self, recent: list[StepRecord]) -> tuple[float, float, float]:
        """(MAPE, bias, split) of the current model on `recent` (fractions): predictions made now,
        not the stored ones, which after a rescale or refit come from earlier models. bias =
        median(measured / predicted) - 1; split = |ratio_plain / ratio_tree - 1| of the two
        kinds' median ratios (s = 1 and s > 1; 0 unless each has PLAIN_MIN steps): a curve
        whose shape is wrong is off by different factors at the two."""
        if not recent:
            return float("nan"), float("nan"), 0.0
        s = np.array([r.s for r in recent])
        meas = np.array([r.verify_s for r in recent])
        ratio = meas / self.model.predict(s, np.array([r.c for r in recent]))
        plain, tree = ratio[s == 1], ratio[s > 1]
        split = 0.0
        if len(plain) >= PLAIN_MIN and len(tree) >= PLAIN_MIN:
            a, b = float(np.median(plain)), float(np.median(tree))
            split = abs(a / b - 1.0) if b > 0 and math.isfinite(a / b) else math.inf
        return float(np.mean(np.abs(ratio - 1.0) / ratio)), float(np.median(ratio)) - 1.0, split

    def _relevel(self) -> None:
        """Rescale the model to the last `level_window` steps (fewer at the start, at least
        CHECK_EVERY), predicted by the current model: by the median measured / predicted ratio
        of plain steps (s = 1) and of trees (s > 1), their geometric mean when both kinds have
        PLAIN_MIN steps, when it is off 1 by more than bias_threshold. Not when the two kinds
        disagree by more than bias_threshold: that is a wrong shape, which a refit repairs and a
        rescale would hide (it would move the bias the refit waits for back to 0)."""
        if self.level_window <= 0:
            return
        recent = list(self.records)[-self.level_window:]
        if len(recent) < CHECK_EVERY:
            return
        s = np.array([r.s for r in recent])
        ratio = np.array([r.verify_s for r in recent]) / self.model.predict(s, np.array([r.c for r in recent]))
        kinds = [float(np.median(ratio[m])) for m in (s == 1, s > 1) if m.sum() >= PLAIN_MIN]
        if not all(math.isfinite(k) and k > 0 for k in kinds):  # a zero or broken prediction: leave it to a refit
            return
        if len(kinds) == 2 and abs(kinds[0] / kinds[1] - 1.0) > self.bias_threshold:
            return
        factor = float(np.exp(np.mean(np.log(kinds)))) if kinds else float(np.median(ratio))
        if not (math.isfinite(factor) and factor > 0 and abs(factor - 1.0) > self.bias_threshold):
            return
        self.model = self.model.scaled(factor)
        self.rescales += 1
        log.debug("latency model level x%.3f (the last %d steps)", factor, len(recent))
        if self.on_rescale is not None:
            self.on_rescale(self.model, factor)

    def recent_error(self, n: int | None = None) -> tuple[float, float]:
        """(MAPE, bias) of the predictions made for the last n (default `window`) steps, fractions:
        bias = median(measured / predicted) - 1. (nan, nan) before any step."""
        n = n or self.window
        recent = list(self.records)[-n:]
        if not recent:
            return float("nan"), float("nan")
        measured = np.array([r.verify_s for r in recent])
        predicted = np.array([r.predicted_s for r in recent])
        return mape(measured, predicted), float(np.median(measured / predicted)) - 1.0

    def recent_mape(self, n: int | None = None) -> float:
        """MAPE (fraction) of the predictions made for the last n (default `window`) steps."""
        return self.recent_error(n)[0]

    def anchor_points(self, recent: Sequence[StepRecord]) -> list[tuple[int, int, float]]:
        """The calibration points a refit on `recent` keeps: [(s, c, seconds)], re-anchored to the
        recent steps' level (their median measured / calibrated-model ratio), without those nearest
        a residual knot (`nearest_knot`) that `measured_knot` or more recent steps already measure.

        Where steps measure a size, the calibration's timing of it is superseded: a calibration
        taken beside another process has the wrong shape, not only the wrong level, at small s
        (C(2) = 2.5 C(1) where quiet steps measure 1.05). Kept, its points held the refitted
        shape there, every tree looked dear: in a replay, trees stayed at 2-6 nodes and HumanEval ran
        at 0.86 of tree-8 (docs/controller.md, "Steps supersede the calibration")."""
        if not recent:
            return list(self.calibration_points)
        base = self.calibrated.predict(np.array([r.s for r in recent]), np.array([r.c for r in recent]))
        level = float(np.median(np.array([r.verify_s for r in recent]) / base))
        points = [(s, c, t * level) for s, c, t in self.calibration_points]
        knots = self.model.knots
        if not knots or not points:
            return points
        measured = np.bincount(nearest_knot([r.s for r in recent], knots), minlength=len(knots))
        near = nearest_knot([p[0] for p in points], knots)
        return [p for p, j in zip(points, near) if measured[j] < self.measured_knot]

    def _refit(self, recent: list[StepRecord], err_before: float) -> None:
        old = self.model
        pts = [(r.s, r.c, r.verify_s, 1.0) for r in recent]
        pts += [(s, c, t, 2.0) for s, c, t in self.anchor_points(recent)]
        arr = np.asarray(pts, dtype=np.float64)
        try:
            new = fit_model(old.shape, old.ceilings, arr[:, 0], arr[:, 1], arr[:, 2], sigma_scale=arr[:, 3],
                            knots=old.knots, rounds=REFIT_ROUNDS, start=old.params, max_nfev=REFIT_MAX_NFEV)
        except ValueError as e:
            self.refit_failures += 1
            log.warning("online refit failed: %s", e)
            return
        params = new.params
        window = recent[-self.window:]
        err_after = mape([r.verify_s for r in window], new.predict([r.s for r in window], [r.c for r in window]))
        # A refit that did not cut the error by a fifth met noise, not drift: wait longer for the next.
        self._wait = self.window if err_after < 0.8 * err_before else min(2 * self._wait, MAX_WAIT * self.window)
        self.model = new
        self.refits += 1
        log.info("latency model refitted: recent MAPE %.1f %% -> %.1f %% (%s)", 100 * err_before, 100 * err_after,
                 params)
        if self.on_refit is not None:
            self.on_refit(new, err_before, err_after)
