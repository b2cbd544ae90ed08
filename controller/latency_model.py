"""Calibrated roofline latency model C(s, c) and its least-squares fit (docs/method.md, section 7).

C(s, c) = max(alpha_c * FLOPs(s, c) / P + beta_c, alpha_m * Bytes(s, c) / BW + beta_m)

FLOPs and Bytes come from `ModelShape`; P and BW from `Ceilings`; the four alpha/beta are
fitted to measured target forwards with scipy.optimize.least_squares.

Optional per-s residual (our extension, not in the paper): C'(s, c) = C(s, c) * r(s), with
log r interpolated linearly in log2 s between knots (the calibration grid's s values) and
held constant outside them. It absorbs what two lines cannot: on a 2-core Xeon, MKL's fp32
GEMM costs the same for 1 to 3 rows and then jumps (4 rows of a 576x1536 matmul cost 2x one
row), so a forward of s = 1 or 2 tokens is ~35 % below the best max-of-two-lines fit while
s >= 8 follows it (docs/controller.md). The residual is fitted after the four parameters,
as the median log ratio measured / C of the points nearest each knot, kept non-decreasing in s.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import isotonic_regression, least_squares

from controller.ceilings import Ceilings
from controller.cost_model import ModelShape

PARAM_NAMES = ("alpha_c", "beta_c", "alpha_m", "beta_m")
#: The per-s residual factor r(s) stays within [1 / RESIDUAL_BOUND, RESIDUAL_BOUND].
RESIDUAL_BOUND = 4.0
#: A residual knot that many times above (or below) both neighbours is a spike, smoothed away.
RESIDUAL_SPIKE = 1.3


@dataclass(frozen=True)
class LatencyParams:
    """The four fitted numbers. alphas: dimensionless efficiency factors (>= 0);
    betas: fixed overheads in seconds (>= 0)."""

    alpha_c: float
    beta_c: float
    alpha_m: float
    beta_m: float

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.alpha_c, self.beta_c, self.alpha_m, self.beta_m)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LatencyParams":
        """Raises KeyError when a parameter is missing, ValueError when one is not finite."""
        vals = [float(d[k]) for k in PARAM_NAMES]
        if not all(math.isfinite(v) for v in vals):
            raise ValueError(f"non-finite latency parameters {vals}")
        return cls(*vals)


def _roofline(x, alpha_c, beta_c, alpha_m, beta_m):
    """x: [2, N] = (FLOPs/P, Bytes/BW) in seconds -> [N] seconds."""
    return np.maximum(alpha_c * x[0] + beta_c, alpha_m * x[1] + beta_m)


class LatencyModel:
    """Predicted latency (seconds) of one target forward with s new tokens over c cached tokens.

    residual: optional ((s_knot, log r), ...) sorted by s_knot (see the module docstring);
    empty means the plain roofline.
    """

    def __init__(self, shape: ModelShape, ceilings: Ceilings, params: LatencyParams,
                 residual: tuple[tuple[float, float], ...] = ()):
        self.shape = shape
        self.ceilings = ceilings
        self.params = params
        self.residual = tuple((float(k), float(v)) for k, v in residual)
        self._knots = np.log2([k for k, _ in self.residual]) if self.residual else None
        self._logr = np.array([v for _, v in self.residual]) if self.residual else None

    @property
    def knots(self) -> tuple[float, ...]:
        """s values of the residual's knots (empty: plain roofline)."""
        return tuple(k for k, _ in self.residual)

    def scaled(self, k: float) -> "LatencyModel":
        """The same curve times k (> 0): all four parameters scaled, so C'(s, c) = k * C(s, c)
        exactly (both lines of the max scale alike); the residual is kept. Raises ValueError
        for k <= 0 or not finite."""
        if not (math.isfinite(k) and k > 0):
            raise ValueError(f"a latency model is scaled by a positive factor, got {k}")
        p = self.params
        return LatencyModel(self.shape, self.ceilings,
                            LatencyParams(p.alpha_c * k, p.beta_c * k, p.alpha_m * k, p.beta_m * k), self.residual)

    def roofline(self) -> "LatencyModel":
        """The same model without the residual."""
        return LatencyModel(self.shape, self.ceilings, self.params)

    def residual_factor(self, s) -> np.ndarray:
        """[N] r(s) multipliers (all 1 without a residual)."""
        s = np.atleast_1d(np.asarray(s, dtype=np.float64))
        if self._knots is None:
            return np.ones_like(s)
        return np.exp(np.interp(np.log2(np.maximum(s, 1.0)), self._knots, self._logr))

    def features(self, s, c) -> np.ndarray:
        """[2, N] roofline times in seconds: (FLOPs/P, Bytes/BW) for arrays s, c of N points."""
        s = np.atleast_1d(np.asarray(s, dtype=np.float64))
        c = np.broadcast_to(np.asarray(c, dtype=np.float64), s.shape)
        return np.stack([self.shape.flops(s, c) / self.ceilings.flops_per_s,
                         self.shape.bytes(s, c) / self.ceilings.bytes_per_s])

    def predict(self, s, c):
        """C(s, c) in seconds; s, c ints (returns float) or arrays (returns [N] array)."""
        scalar = np.ndim(s) == 0 and np.ndim(c) == 0
        out = _roofline(self.features(s, c), *self.params.as_tuple())
        if self._knots is not None:
            out = out * self.residual_factor(np.broadcast_to(np.asarray(s, dtype=np.float64), out.shape))
        return float(out[0]) if scalar else out

    def predict_batch(self, n, b: int, c_total: int, seq_overhead: float = 0.0):
        """C_b(N; c_1..c_b) in seconds: one forward verifying n tree tokens in all for b sequences
        that cache c_total tokens in all (docs/method.md, section 9).

        Weights are read once, KV bytes add up over the sequences (Bytes(n, c_total)); the
        attention FLOPs sum_r n_r (c_r + n_r) are taken at equal trees and contexts, which is
        FLOPs(n, c_total / b). The residual is read at n (the matmuls see n rows); seq_overhead
        seconds are added per sequence beyond the first (per-sequence attention work). With
        b = 1 this is `predict(n, c_total)`. n: int or array; returns float or [N] array.
        Raises ValueError when b < 1.
        """
        if b < 1:
            raise ValueError(f"a batch needs b >= 1 sequences, got {b}")
        scalar = np.ndim(n) == 0
        n_arr = np.atleast_1d(np.asarray(n, dtype=np.float64))
        x = np.stack([self.shape.flops(n_arr, np.full_like(n_arr, c_total / b)) / self.ceilings.flops_per_s,
                      self.shape.bytes(n_arr, np.full_like(n_arr, c_total)) / self.ceilings.bytes_per_s])
        out = _roofline(x, *self.params.as_tuple()) * self.residual_factor(n_arr) + seq_overhead * (b - 1)
        return float(out[0]) if scalar else out

    def batch_costs(self, max_n: int, b: int, c_total: int, seq_overhead: float = 0.0) -> list[float]:
        """[max_n + 1] Python list: entry n = C_b(n; ...) seconds (`predict_batch`) for n = b..max_n,
        made non-decreasing in n (a forward of more tokens does not cost less; a dip is a fitted
        residual's artifact); entries below b (a batch verifies at least its b roots) are 0.0."""
        if max_n < b:
            return [0.0] * (max_n + 1)
        n = np.arange(b, max_n + 1)
        return [0.0] * b + np.maximum.accumulate(self.predict_batch(n, b, c_total, seq_overhead)).tolist()

    def verify_costs(self, max_n: int, c: int) -> list[float]:
        """[max_n + 1] Python list: entry n = C(n, c) seconds for n = 1..max_n, made non-decreasing
        in n (a forward of more tokens does not cost less); entry 0 = 0.0.

        One vectorised evaluation, so a policy can index it per node at no cost.
        """
        n = np.arange(1, max_n + 1)
        return [0.0] + np.maximum.accumulate(self.predict(n, np.full_like(n, c))).tolist()

    def bound(self, s: int, c: int) -> str:
        """'compute' or 'memory': which line of the max is active at (s, c)."""
        x = self.features(s, c)
        a_c, b_c, a_m, b_m = self.params.as_tuple()
        return "compute" if a_c * x[0, 0] + b_c >= a_m * x[1, 0] + b_m else "memory"


def mape(measured, predicted) -> float:
    """Mean absolute percentage error, as a fraction (0.05 = 5 %). Empty input -> nan."""
    measured = np.asarray(measured, dtype=np.float64)
    predicted = np.asarray(predicted, dtype=np.float64)
    if measured.size == 0:
        return float("nan")
    return float(np.mean(np.abs(predicted - measured) / measured))


def _line_fit(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Weighted least-squares y ~ a*x + b with a, b >= 0 (clipped)."""
    A = np.stack([x, np.ones_like(x)], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    return max(float(a), 1e-6), max(float(b), 0.0)


def fit_params(model_shape: ModelShape, ceilings: Ceilings, s, c, seconds,
               sigma_scale=None, robust: bool = True, start: LatencyParams | None = None,
               max_nfev: int = 2000) -> LatencyParams:
    """Fit (alpha_c, beta_c, alpha_m, beta_m) to measured forwards by non-linear least squares.

    s, c: [N] new and cached tokens; seconds: [N] measured latencies (seconds, > 0).
    sigma_scale: optional [N] multiplier of each point's uncertainty (> 1: counts less).
    Residuals are relative (sigma = measured) and weighted by log2(2s), so larger s counts
    more, as in the reference calibration, while s = 1 (the AR step) still matters.
    Several starts (each line fitted alone to the points it would dominate) guard against
    the kink of the max; the start with the lowest weighted residual wins.
    robust: soft-L1 loss (scale 5 % relative error), so a few timings spoiled by another
    process on a shared machine do not drag the fit; False gives plain least squares.
    start: fit from these parameters and the joint line fit only, instead of the five starts
    (an online refit from the current model: about a third of the time).
    max_nfev: model evaluations per start; a start that has not converged by then gives its best
    point so far, judged against the others like any.
    Raises ValueError with fewer than 4 points or non-positive timings, or when no start gave a fit.
    """
    s = np.asarray(s, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if y.size < 4:
        raise ValueError(f"need at least 4 timings to fit 4 parameters, got {y.size}")
    if not np.all(y > 0):
        raise ValueError("timings must be positive seconds")
    x = LatencyModel(model_shape, ceilings, LatencyParams(1, 0, 1, 0)).features(s, c)
    sigma = y / np.sqrt(np.log2(2 * s))
    if sigma_scale is not None:
        sigma = sigma * np.asarray(sigma_scale, dtype=np.float64)
    w = 1.0 / sigma

    ac, bc = _line_fit(x[0], y, w)
    am, bm = _line_fit(x[1], y, w)
    starts = [(ac, bc, am, bm)]
    if start is not None:
        starts.append((start.alpha_c, start.beta_c, start.alpha_m, start.beta_m))
    else:
        # Split by compute intensity: high-FLOP points for the compute line, the rest for memory.
        ratio = x[0] / x[1]
        for q in (0.3, 0.5, 0.7):
            cut = np.quantile(ratio, q)
            hi, lo = ratio >= cut, ratio < cut
            if hi.sum() >= 2 and lo.sum() >= 2:
                ac, bc = _line_fit(x[0][hi], y[hi], w[hi])
                am, bm = _line_fit(x[1][lo], y[lo], w[lo])
                starts.append((ac, bc, am, bm))

    loss = {"loss": "soft_l1", "f_scale": 0.05} if robust else {}
    best, best_cost = None, float("inf")
    bounds = ([0.0, 0.0, 0.0, 0.0], [np.inf] * 4)
    for p0 in starts:
        try:
            fit = least_squares(lambda p: (_roofline(x, *p) - y) / sigma, p0, bounds=bounds, max_nfev=max_nfev,
                                **loss)
        except ValueError:  # a start outside the bounds
            continue
        popt = fit.x  # the best point so far when the evaluations ran out (status 0)
        if fit.status < 0 or not np.all(np.isfinite(popt)):
            continue
        z = ((_roofline(x, *popt) - y) / sigma) ** 2
        cost = float(np.sum(2 * 0.05**2 * (np.sqrt(1 + z / 0.05**2) - 1)) if robust else np.sum(z))
        if cost < best_cost:
            best, best_cost = popt, cost
    if best is None:
        raise ValueError("latency fit did not converge from any start")
    return LatencyParams(*(float(v) for v in best))


def nearest_knot(s, knots) -> np.ndarray:
    """[N] index into `knots` (increasing s values) of the knot nearest each of s ([N] tokens) in
    log2 s: the points a knot's residual is fitted from (`fit_residual`)."""
    s = np.atleast_1d(np.asarray(s, dtype=np.float64))
    kn = np.asarray(knots, dtype=np.float64)
    return np.abs(np.log2(s)[:, None] - np.log2(kn)[None, :]).argmin(axis=1)


def fit_residual(model: LatencyModel, s, c, seconds, knots) -> tuple[tuple[float, float], ...]:
    """Per-knot median log(measured / C) of the points nearest each knot in log2 s, smoothed by a
    three-knot median where one knot spikes, made non-decreasing in s and bounded to
    |log r| <= log RESIDUAL_BOUND.

    Non-decreasing: C(s_knot, c) at the points' median context must not fall from one knot to
    the next (a forward of more tokens does not cost less). Where the medians say it does, the
    knots that disagree are pooled into their point-weighted mean (isotonic regression,
    scipy.optimize.isotonic_regression). An inversion comes from timings taken under different
    loads, for example plain steps of a busy start-up against trees timed later on a quiet
    machine; uncorrected, `LatencyModel.verify_costs` (non-decreasing by construction) priced
    every tree up to the inverted knot at C(1), and trees of 30-40 nodes followed.

    model: the fitted roofline (its own residual is ignored); s, c, seconds: [N] points;
    knots: s values. Knots without a point are dropped. Returns ((s_knot, log r), ...).
    """
    s = np.asarray(s, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    c = np.broadcast_to(np.asarray(c, dtype=np.float64), s.shape)
    roof = model.roofline()
    logr = np.log(y / roof.predict(s, c))
    kn = np.array(sorted(set(float(k) for k in knots)))
    if kn.size == 0:
        return ()
    nearest = nearest_knot(s, kn)
    ks, vals, counts = [], [], []
    for j, k in enumerate(kn):
        sel = nearest == j
        if sel.any():
            ks.append(float(k))
            vals.append(float(np.median(logr[sel])))
            counts.append(int(sel.sum()))
    # Smooth and bounded: an interior knot more than RESIDUAL_SPIKE above or below both its
    # neighbours (a spike from spoiled timings) takes their three-knot median, a step of the
    # kernels stays; r stays in [1 / RESIDUAL_BOUND, RESIDUAL_BOUND].
    spike = math.log(RESIDUAL_SPIKE)
    smooth = list(vals)
    for i in range(1, len(vals) - 1):
        lo, hi = vals[i] - vals[i - 1], vals[i] - vals[i + 1]
        if (lo > spike and hi > spike) or (lo < -spike and hi < -spike):
            smooth[i] = float(np.median(vals[i - 1:i + 2]))
    if len(ks) > 1:
        log_base = np.log(roof.predict(np.array(ks), np.full(len(ks), float(np.median(c)))))
        mono = isotonic_regression(log_base + np.array(smooth), weights=np.array(counts, dtype=np.float64)).x
        smooth = (mono - log_base).tolist()
    lim = math.log(RESIDUAL_BOUND)
    return tuple((k, min(max(v, -lim), lim)) for k, v in zip(ks, smooth))


def fit_model(model_shape: ModelShape, ceilings: Ceilings, s, c, seconds, sigma_scale=None,
              knots=None, rounds: int = 3, start: LatencyParams | None = None, max_nfev: int = 2000) -> LatencyModel:
    """`fit_params`, then the per-s residual at `knots` (None: the distinct s of the points;
    empty: none, the plain roofline). With a residual, the two are fitted alternately
    (`rounds` times): the four parameters to the timings divided by r(s), then r(s) to what
    the roofline leaves, so a per-s quirk does not bend the lines. start: see `fit_params`
    (the first round only); max_nfev: per start, see `fit_params`. Raises ValueError like `fit_params`.
    """
    y = np.asarray(seconds, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    params = fit_params(model_shape, ceilings, s, c, y, sigma_scale=sigma_scale, start=start, max_nfev=max_nfev)
    model = LatencyModel(model_shape, ceilings, params)
    if knots is None:
        knots = sorted(set(s.tolist()))
    if len(knots) == 0:
        return model
    for i in range(rounds):
        model = LatencyModel(model_shape, ceilings, params, fit_residual(model, s, c, y, knots))
        if i + 1 < rounds:
            params = fit_params(model_shape, ceilings, s, c, y / model.residual_factor(s), sigma_scale=sigma_scale,
                                start=params if start is not None else None, max_nfev=max_nfev)
            model = LatencyModel(model_shape, ceilings, params, model.residual)
    return model
