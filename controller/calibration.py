"""Calibration of the latency model: time target forwards over an (s, c) grid, fit, cache, report.

The engine supplies `measure_fn(s, c) -> seconds`, one timed target forward with s new
tokens over a KV cache of c tokens (synchronised on GPU). `calibrate` repeats it (warm-ups,
timed runs, median), fits the four roofline parameters on most grid points, reports the
error on the points left out, and caches the result on disk per (device, model, dtype,
attention backend, torch version).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

import numpy as np
import torch
from tqdm.auto import tqdm

from controller.ceilings import Ceilings, datasheet_ceilings, device_name, measure_ceilings
from controller.cost_model import ModelShape
from controller.latency_model import LatencyModel, LatencyParams, fit_model, mape

log = logging.getLogger(__name__)

#: Bumped whenever the cached JSON layout or the fitting method changes.
CACHE_FORMAT = 5  # 2: the per-s residual; 3: timed through engine.forward; 4: the batched cost; 5: smoothed residual, spread

MeasureFn = Callable[[int, int], float]
#: measure(b, n, c) -> seconds of one forward verifying b trees of n nodes, each over c cached tokens.
BatchMeasureFn = Callable[[int, int, int], float]


@dataclass(frozen=True)
class CalibrationGrid:
    """Grid of (s new tokens, c cached tokens) points, iterated c-major (all s for one c, then the next c),
    so a measure function can keep one prefilled cache per c."""

    s_values: tuple[int, ...]
    c_values: tuple[int, ...]

    def points(self, max_context: int | None = None) -> list[tuple[int, int]]:
        """[(s, c)] in c-major order, dropping points with s + c > max_context."""
        return [(s, c) for c in self.c_values for s in self.s_values
                if max_context is None or s + c <= max_context]


#: CPU grid: a 135M-parameter target in float32 measures in well under 60 s on 2 cores.
CPU_GRID = CalibrationGrid((1, 2, 4, 8, 16, 32, 64, 128, 256), (64, 512, 1024))
#: GPU grid: the reference s = 16..512, c = 64..2048, plus s = 1 (the AR step).
GPU_GRID = CalibrationGrid((1, 16, 32, 64, 128, 256, 512), (64, 256, 512, 1024, 2048))
#: Seconds of timed forwards allowed on CPU for the grid, and for re-measuring outliers
#: (bounded to 60 s in all, ceilings included).
CPU_TIME_BUDGET_S = 40.0
CPU_REMEASURE_BUDGET_S = 10.0
#: Held-out MAPE (fraction) above which a calibration is not cached: timings spoiled by other work.
NOISY_MAPE = 0.5
#: Relative residual beyond which a grid point is timed again (a busy machine spoils timings).
OUTLIER_REL_ERROR = 0.25
#: Median relative spread (interquartile range / median) of a point's repeated timings above which the
#: machine is taken to be busy: the calibration is used, reported as such, and not cached.
BUSY_SPREAD = 0.25


@dataclass(frozen=True)
class BatchGrid:
    """Grid of batched forwards: b sequences of n tree tokens each, each over c cached tokens
    (docs/method.md, section 9), iterated c-major."""

    b_values: tuple[int, ...]
    n_values: tuple[int, ...]
    c_values: tuple[int, ...]

    def points(self, max_context: int | None = None) -> list[tuple[int, int, int]]:
        """[(b, n, c)] in c-major order, dropping points with n + c > max_context."""
        return [(b, n, c) for c in self.c_values for b in self.b_values for n in self.n_values
                if max_context is None or n + c <= max_context]


#: Batched points on any device: 2, 4 and 8 sequences of 1 and 4 tree tokens at two contexts.
BATCH_GRID = BatchGrid((2, 4, 8), (1, 4), (64, 512))
#: Seconds of timed batched forwards allowed on CPU.
CPU_BATCH_BUDGET_S = 12.0


def default_grid(device: torch.device | str) -> CalibrationGrid:
    """CPU_GRID on a CPU, GPU_GRID otherwise."""
    return CPU_GRID if torch.device(device).type == "cpu" else GPU_GRID


def default_cache_dir() -> Path:
    """$BASTION_CACHE/calibration, else ~/.cache/bastion/calibration."""
    root = os.environ.get("BASTION_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "bastion") / "calibration"


@dataclass
class CalibrationResult:
    """A fitted latency model and the evidence behind it.

    key: the cache key (device, model, dtype, attention backend, torch version, shape, grid).
    points: [(s, c, median seconds)] measured; heldout: indices into points left out of the
    held-out fit. heldout_mape: error (fraction) of the fit without them, on them;
    fit_mape: error of the final fit (all points) on all points. elapsed_s: wall seconds.
    residual: the latency model's per-s residual ((s, log r), ...), see controller.latency_model.
    heldout_mape_roofline: held-out error of the four-parameter roofline alone (no residual).
    batch_points: [(b, n, c, median seconds)] of batched forwards (b trees of n nodes over c
    cached tokens each); seq_overhead: seconds per sequence beyond the first that the batched
    cost adds to the roofline (`fit_seq_overhead`); batch_mape: the batched model's error on them.
    spread: median over points of the relative spread (interquartile range / median) of their repeated
    timings (nan with single timings); above BUSY_SPREAD the machine was busy.
    """

    key: dict
    shape: ModelShape
    ceilings: Ceilings
    params: LatencyParams
    points: list[tuple[int, int, float]]
    heldout: list[int]
    heldout_mape: float
    fit_mape: float
    elapsed_s: float = 0.0
    residual: tuple = ()
    heldout_mape_roofline: float = float("nan")
    batch_points: list[tuple[int, int, int, float]] = field(default_factory=list)
    seq_overhead: float = 0.0
    batch_mape: float = float("nan")
    spread: float = float("nan")
    from_cache: bool = field(default=False, compare=False)

    def model(self) -> LatencyModel:
        """The calibrated LatencyModel (roofline times the per-s residual)."""
        return LatencyModel(self.shape, self.ceilings, self.params, self.residual)

    def to_json(self) -> dict:
        return {
            "key": self.key, "shape": self.shape.to_dict(), "ceilings": self.ceilings.to_dict(),
            "params": self.params.to_dict(), "points": [list(p) for p in self.points],
            "heldout": self.heldout, "heldout_mape": self.heldout_mape, "fit_mape": self.fit_mape,
            "elapsed_s": self.elapsed_s, "residual": [list(r) for r in self.residual],
            "heldout_mape_roofline": self.heldout_mape_roofline,
            "batch_points": [list(p) for p in self.batch_points], "seq_overhead": self.seq_overhead,
            "batch_mape": self.batch_mape, "spread": self.spread,
        }

    @classmethod
    def from_json(cls, d: dict) -> "CalibrationResult":
        """Raises KeyError, TypeError or ValueError on a malformed document."""
        return cls(
            key=dict(d["key"]), shape=ModelShape(**d["shape"]), ceilings=Ceilings.from_dict(d["ceilings"]),
            params=LatencyParams.from_dict(d["params"]),
            points=[(int(s), int(c), float(t)) for s, c, t in d["points"]],
            heldout=[int(i) for i in d["heldout"]], heldout_mape=float(d["heldout_mape"]),
            fit_mape=float(d["fit_mape"]), elapsed_s=float(d.get("elapsed_s", 0.0)),
            residual=tuple((float(k), float(v)) for k, v in d.get("residual", [])),
            heldout_mape_roofline=float(d.get("heldout_mape_roofline", float("nan"))),
            batch_points=[(int(b), int(n), int(c), float(t)) for b, n, c, t in d.get("batch_points", [])],
            seq_overhead=float(d.get("seq_overhead", 0.0)), batch_mape=float(d.get("batch_mape", float("nan"))),
            spread=float(d.get("spread", float("nan"))),
            from_cache=True,
        )


def cache_key(model_name: str, device: str, dtype: torch.dtype | str, attn_backend: str,
              shape: ModelShape, grid: CalibrationGrid, batch_grid: BatchGrid | None = None) -> dict:
    """The identity a cached calibration must match exactly (torch version included)."""
    key = {
        "format": CACHE_FORMAT, "device": device, "model": model_name, "dtype": str(dtype).removeprefix("torch."),
        "attn_backend": attn_backend, "torch": torch.__version__, "shape": shape.to_dict(),
        "grid": {"s": list(grid.s_values), "c": list(grid.c_values)},
    }
    if batch_grid is not None:
        key["batch_grid"] = {"b": list(batch_grid.b_values), "n": list(batch_grid.n_values),
                             "c": list(batch_grid.c_values)}
    return key


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:60] or "x"


def cache_path(cache_dir: Path | str, key: dict) -> Path:
    """One file per (model, device, dtype, backend): a stale file for the same setup is found and replaced."""
    ident = f"{key['device']}|{key['dtype']}|{key['attn_backend']}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:10]
    return Path(cache_dir) / f"{_slug(key['model'])}-{key['dtype']}-{_slug(key['attn_backend'])}-{digest}.json"


def load_cached(path: Path, key: dict) -> CalibrationResult | None:
    """The cached result at `path` if it parses and its key equals `key`; else None.

    A missing file returns None silently; a corrupt or mismatching one logs a warning.
    """
    if not path.exists():
        return None
    try:
        result = CalibrationResult.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring corrupt calibration cache %s (%s: %s); recalibrating", path, type(e).__name__, e)
        return None
    if result.key != key:
        diff = sorted(k for k in set(key) | set(result.key) if key.get(k) != result.key.get(k))
        log.warning("ignoring calibration cache %s: it does not match this setup (%s differ); recalibrating",
                    path, ", ".join(diff))
        return None
    return result


def save_cached(path: Path, result: CalibrationResult) -> None:
    """Write atomically (temporary file, then rename); failures are logged, not raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(result.to_json(), indent=1))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not write calibration cache %s: %s", path, e)


def measure_grid(measure_fn: MeasureFn, points: list[tuple[int, int]], warmup: int = 3, repeats: int = 5,
                 time_budget_s: float | None = None, progress: bool = True,
                 stop_when_spent: bool = False, spreads: list[float] | None = None) -> list[tuple[int, int, float]]:
    """Median latency (seconds) per (s, c) point: `warmup` untimed calls, then `repeats` timed calls.

    With time_budget_s (CPU), the full warm-up is done once at the first point and one
    warm-up when c changes; timed runs stop early (at least one) when a point exceeds
    its share of the remaining budget, so the grid finishes in about time_budget_s; once the
    budget is spent, later points get one timed run and no warm-up, or (stop_when_spent) are
    skipped. Returns [(s, c, median seconds)] in the order of `points` (a prefix if skipped).
    spreads: if given, each point with two timed runs or more appends its interquartile range / median.
    """
    out: list[tuple[int, int, float]] = []
    start = time.perf_counter()
    bar = tqdm(points, desc="calibrating verify latency", unit="pt", disable=not progress, leave=False)
    for i, (s, c) in enumerate(bar):
        point_start = time.perf_counter()
        share = None
        if time_budget_s is not None:
            share = max(time_budget_s - (point_start - start), 0.0) / (len(points) - i)
            if share == 0.0 and stop_when_spent:
                break
        if time_budget_s is None or i == 0:
            n_warm = warmup
        elif share == 0.0 or c == points[i - 1][1]:
            n_warm = 0  # same cache as the previous point: the median of the timed runs suffices
        else:
            n_warm = min(warmup, 1)
        for _ in range(n_warm):
            measure_fn(s, c)
        runs: list[float] = []
        while len(runs) < repeats:
            runs.append(float(measure_fn(s, c)))
            if share is not None and time.perf_counter() - point_start > share:
                break
        out.append((s, c, statistics.median(runs)))
        if spreads is not None and len(runs) >= 2:
            q1, q3 = np.percentile(runs, [25, 75])
            spreads.append(float(q3 - q1) / out[-1][2])
        bar.set_postfix(s=s, c=c, ms=f"{out[-1][2] * 1e3:.1f}")
    return out


def heldout_indices(n: int, every: int = 4) -> list[int]:
    """Indices left out of the held-out fit: every `every`-th point starting at 1 (interior of each row)."""
    return list(range(1, n, every)) if n >= 8 else []


def fit_result(key: dict, shape: ModelShape, ceilings: Ceilings, points: list[tuple[int, int, float]],
               elapsed_s: float = 0.0) -> CalibrationResult:
    """Fit on the points minus `heldout_indices` (held-out error), then refit on all points.

    Raises ValueError when the fit fails (see `fit_params`).
    """
    arr = np.asarray(points, dtype=np.float64)
    s, c, t = arr[:, 0], arr[:, 1], arr[:, 2]
    held = heldout_indices(len(points))
    roof_err = float("nan")
    if held:
        train = np.setdiff1d(np.arange(len(points)), held)
        m_train = fit_model(shape, ceilings, s[train], c[train], t[train])
        heldout_err = mape(t[held], m_train.predict(s[held], c[held]))
        roof_err = mape(t[held], m_train.roofline().predict(s[held], c[held]))
    else:
        heldout_err = float("nan")
    model = fit_model(shape, ceilings, s, c, t)
    if held and not heldout_err <= roof_err:
        # The residual does not generalise (noisy timings): keep the plain roofline.
        model, heldout_err = model.roofline(), roof_err
    fit_err = mape(t, model.predict(s, c))
    return CalibrationResult(key, shape, ceilings, model.params, [tuple(p) for p in points], held,
                             heldout_err, fit_err, elapsed_s, model.residual, roof_err)


def measure_batch_grid(measure_fn: BatchMeasureFn, points: list[tuple[int, int, int]], repeats: int = 3,
                       time_budget_s: float | None = None, progress: bool = True
                       ) -> list[tuple[int, int, int, float]]:
    """Median seconds per (b, n, c) point: one untimed call when c changes, then up to `repeats`
    timed calls (at least one; fewer when a point exceeds its share of time_budget_s).
    Returns [(b, n, c, median seconds)]."""
    out: list[tuple[int, int, int, float]] = []
    start = time.perf_counter()
    bar = tqdm(points, desc="calibrating batched verify", unit="pt", disable=not progress, leave=False)
    for i, (b, n, c) in enumerate(bar):
        point_start = time.perf_counter()
        share = None if time_budget_s is None else max(time_budget_s - (point_start - start), 0.0) / (len(points) - i)
        if i == 0 or c != points[i - 1][2]:
            measure_fn(b, n, c)
        runs: list[float] = []
        while len(runs) < repeats:
            runs.append(float(measure_fn(b, n, c)))
            if share is not None and time.perf_counter() - point_start > share:
                break
        out.append((b, n, c, statistics.median(runs)))
    return out


def fit_seq_overhead(model: LatencyModel, points: list[tuple[int, int, int, float]]) -> tuple[float, float]:
    """Per-sequence overhead of a batched forward and the batched model's error.

    model: the single-sequence LatencyModel; points: [(b, n, c, seconds)] with b >= 2 trees of
    n nodes over c cached tokens each. The overhead is the median over points of
    (measured - C_b(b n; b c)) / (b - 1), not below 0 (docs/method.md, section 9).
    Returns (seq_overhead seconds, MAPE of `predict_batch` with it, as a fraction; nan without points).
    """
    pts = [p for p in points if p[0] >= 2]
    if not pts:
        return 0.0, float("nan")
    extra = [(t - model.predict_batch(b * n, b, b * c)) / (b - 1) for b, n, c, t in pts]
    overhead = max(float(np.median(extra)), 0.0)
    pred = [model.predict_batch(b * n, b, b * c, overhead) for b, n, c, _ in pts]
    return overhead, mape([t for *_, t in pts], pred)


def remeasure_outliers(measure_fn: MeasureFn, shape: ModelShape, ceilings: Ceilings,
                       points: list[tuple[int, int, float]], warmup: int, repeats: int,
                       time_budget_s: float | None, progress: bool = True) -> tuple[list[tuple[int, int, float]], int]:
    """Time again the points a robust fit misses by more than OUTLIER_REL_ERROR; keep the faster median.

    Another process on the machine only ever slows a forward down, so of two medians the
    lower is the better estimate. Stops when time_budget_s is spent.
    Returns (points, number re-measured).
    """
    arr = np.asarray(points, dtype=np.float64)
    pred = fit_model(shape, ceilings, arr[:, 0], arr[:, 1], arr[:, 2]).predict(arr[:, 0], arr[:, 1])
    bad = [i for i in range(len(points)) if abs(pred[i] - arr[i, 2]) / arr[i, 2] > OUTLIER_REL_ERROR]
    if not bad:
        return points, 0
    again = measure_grid(measure_fn, [points[i][:2] for i in bad], min(warmup, 1), repeats, time_budget_s, progress,
                         stop_when_spent=True)
    out = list(points)
    for i, (s, c, t) in zip(bad, again):
        out[i] = (s, c, min(t, points[i][2]))
    log.info("re-measured %d of %d calibration points off the first fit by > %.0f %%", len(again), len(bad),
             100 * OUTLIER_REL_ERROR)
    return out, len(again)


def calibrate(measure_fn: MeasureFn, config, dtype: torch.dtype, grid: CalibrationGrid | None = None, *,
              model_name: str | None = None, device: torch.device | str = "cpu", attn_backend: str | None = None,
              cache_dir: Path | str | None = None, use_cache: bool = True, ceilings: Ceilings | None = None,
              warmup: int = 3, repeats: int = 5, time_budget_s: float | None = -1.0,
              max_context: int | None = None, progress: bool = True,
              measure_batch_fn: BatchMeasureFn | None = None, batch_grid: BatchGrid | None = None
              ) -> CalibrationResult:
    """Calibrated latency model for the target described by `config`, from the cache when it matches.

    measure_fn(s, c) -> seconds of one target forward with s new tokens over c cached tokens.
    config: the target's Hugging Face config; dtype: the dtype it runs in.
    grid: default CPU_GRID / GPU_GRID by device. model_name: default config.name_or_path.
    attn_backend: default config._attn_implementation. cache_dir: default `default_cache_dir()`.
    ceilings: skip the microbenchmarks and use these. time_budget_s: seconds allowed for the
    grid; -1 means CPU_TIME_BUDGET_S on CPU and unlimited on GPU, None unlimited. Points a
    first (robust) fit misses by over OUTLIER_REL_ERROR are timed once more (CPU: within
    CPU_REMEASURE_BUDGET_S) and the faster median kept.
    max_context: drop grid points with s + c above it.
    measure_batch_fn(b, n, c) -> seconds of one forward over b trees of n nodes, each over c
    cached tokens: with it, `batch_grid` (default BATCH_GRID; CPU: within CPU_BATCH_BUDGET_S)
    is timed too and the batched cost's per-sequence overhead fitted (`fit_seq_overhead`).
    Raises ValueError for an unsupported config or a failed fit.
    """
    shape = ModelShape.from_config(config, dtype)
    grid = grid or default_grid(device)
    if measure_batch_fn is not None:
        batch_grid = batch_grid or BATCH_GRID
    model_name = model_name or getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "") or "unknown"
    attn_backend = attn_backend or getattr(config, "_attn_implementation", None) or "default"
    name = device_name(device)
    key = cache_key(str(model_name), name, dtype, str(attn_backend), shape, grid,
                    batch_grid if measure_batch_fn is not None else None)
    path = cache_path(cache_dir if cache_dir is not None else default_cache_dir(), key)
    if use_cache:
        cached = load_cached(path, key)
        if cached is not None:
            log.info("calibration cache hit %s (held-out MAPE %.1f %%)", path, 100 * cached.heldout_mape)
            return cached
    remeasure_budget = None
    if time_budget_s is not None and time_budget_s < 0:
        on_cpu = torch.device(device).type == "cpu"
        time_budget_s = CPU_TIME_BUDGET_S if on_cpu else None
        remeasure_budget = CPU_REMEASURE_BUDGET_S if on_cpu else None
    elif time_budget_s is not None:
        remeasure_budget = time_budget_s / 4
    t0 = time.perf_counter()
    if ceilings is None:
        ceilings = measure_ceilings(device, dtype)
    spreads: list[float] = []
    points = measure_grid(measure_fn, grid.points(max_context), warmup, repeats, time_budget_s, progress,
                          spreads=spreads)
    if len(points) >= 4:
        points, _ = remeasure_outliers(measure_fn, shape, ceilings, points, warmup, repeats, remeasure_budget,
                                       progress)
    result = fit_result(key, shape, ceilings, points, time.perf_counter() - t0)
    result.spread = float(np.median(spreads)) if spreads else float("nan")
    if measure_batch_fn is not None:
        on_cpu = torch.device(device).type == "cpu"
        result.batch_points = measure_batch_grid(measure_batch_fn, batch_grid.points(max_context),
                                                 time_budget_s=CPU_BATCH_BUDGET_S if on_cpu else None,
                                                 progress=progress)
        result.seq_overhead, result.batch_mape = fit_seq_overhead(result.model(), result.batch_points)
        result.elapsed_s = time.perf_counter() - t0
    log.info("calibrated %s on %s in %.1f s: %s, held-out MAPE %.1f %%", model_name, name, result.elapsed_s,
             result.params, 100 * result.heldout_mape)
    if result.heldout_mape > NOISY_MAPE or result.spread > BUSY_SPREAD:
        log.warning("the machine looks busy during calibration (held-out MAPE %.0f %%, repeated timings of one "
                    "forward spread by %.0f %%). It is used for now, the online profiler refits it as steps run, "
                    "and it is not cached; run `bastion calibrate --force` on a quiet machine.",
                    100 * result.heldout_mape, 100 * result.spread)
    elif use_cache:
        save_cached(path, result)
    return result


def report(result: CalibrationResult, png_path: Path | str | None = None, file: TextIO | None = None,
           extra: str = "") -> str:
    """Print (to `file`, default stdout) and return the calibration report; write the PNG plot if asked.

    Table columns: s, c, measured ms, predicted ms, error %, active roofline line; held-out
    points are marked '*'. The header compares measured ceilings with the datasheet when the
    device is known. `extra`: more text to append (e.g. the surrogate-calibration summary).
    """
    model = result.model()
    ce = result.ceilings
    lines = [f"device: {ce.device}",
             f"measured ceilings: {ce.flops_per_s / 1e12:.3f} TFLOP/s, {ce.bytes_per_s / 1e9:.1f} GB/s"]
    sheet = datasheet_ceilings(ce.device)
    if sheet is not None:
        lines.append(f"datasheet ceilings: {sheet.flops_per_s / 1e12:.0f} TFLOP/s, {sheet.bytes_per_s / 1e9:.0f} GB/s "
                     f"(measured/datasheet: {ce.flops_per_s / sheet.flops_per_s:.2f}, "
                     f"{ce.bytes_per_s / sheet.bytes_per_s:.2f})")
    else:
        lines.append("datasheet ceilings: none for this device")
    p = result.params
    lines.append(f"fit: alpha_c={p.alpha_c:.4g} beta_c={p.beta_c * 1e3:.3f} ms alpha_m={p.alpha_m:.4g} "
                 f"beta_m={p.beta_m * 1e3:.3f} ms")
    if result.residual:
        lines.append("residual r(s): " + "  ".join(f"{k:g}:{math.exp(v):.3f}" for k, v in result.residual))
    if result.spread == result.spread:
        busy = "  (busy machine: not cached)" if result.spread > BUSY_SPREAD else ""
        lines.append(f"spread of repeated timings (median over points): {100 * result.spread:.1f} %{busy}")
    lines.append(f"MAPE held-out ({len(result.heldout)} pts, '*'): {100 * result.heldout_mape:.2f} % "
                 f"(roofline alone: {100 * result.heldout_mape_roofline:.2f} %)   "
                 f"all points (final fit): {100 * result.fit_mape:.2f} %" + ("   [cached]" if result.from_cache else ""))
    lines.append(f"{'s':>6} {'c':>6} {'measured ms':>12} {'predicted ms':>13} {'error %':>8}  bound")
    held = set(result.heldout)
    for i, (s, c, t) in enumerate(result.points):
        pred = model.predict(s, c)
        lines.append(f"{s:>6} {c:>6} {t * 1e3:>12.3f} {pred * 1e3:>13.3f} {100 * (pred - t) / t:>+8.2f}  "
                     f"{model.bound(s, c)}{' *' if i in held else ''}")
    if result.batch_points:
        lines.append(f"batched forwards: per-sequence overhead {result.seq_overhead * 1e3:.3f} ms, "
                     f"MAPE {100 * result.batch_mape:.2f} %")
        lines.append(f"{'b':>6} {'n/seq':>6} {'c/seq':>6} {'measured ms':>12} {'predicted ms':>13} {'error %':>8}")
        for b, n, c, t in result.batch_points:
            pred = model.predict_batch(b * n, b, b * c, result.seq_overhead)
            lines.append(f"{b:>6} {n:>6} {c:>6} {t * 1e3:>12.3f} {pred * 1e3:>13.3f} {100 * (pred - t) / t:>+8.2f}")
    if extra:
        lines.append(extra)
    text = "\n".join(lines)
    print(text, file=file or sys.stdout)
    if png_path is not None:
        plot(result, png_path)
    return text


def plot(result: CalibrationResult, png_path: Path | str) -> Path:
    """Write a PNG: latency vs s per context length (measured dots, model lines) and predicted vs measured."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    model = result.model()
    arr = np.asarray(result.points, dtype=np.float64)
    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    for c in sorted(set(arr[:, 1].tolist())):
        rows = arr[arr[:, 1] == c]
        line = ax1.plot(rows[:, 0], rows[:, 2] * 1e3, "o", label=f"c={int(c)} measured")[0]
        s_dense = np.unique(np.geomspace(rows[:, 0].min(), rows[:, 0].max(), 64).round())
        ax1.plot(s_dense, model.predict(s_dense, np.full_like(s_dense, c)) * 1e3, "-", color=line.get_color())
    ax1.set(xscale="log", yscale="log", xlabel="new tokens s", ylabel="verify latency (ms)",
            title="measured (dots) vs model (lines)")
    ax1.legend(fontsize=7)
    pred = model.predict(arr[:, 0], arr[:, 1]) * 1e3
    ax2.plot(arr[:, 2] * 1e3, pred, "o")
    lo, hi = min(pred.min(), arr[:, 2].min() * 1e3), max(pred.max(), arr[:, 2].max() * 1e3)
    ax2.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax2.set(xscale="log", yscale="log", xlabel="measured (ms)", ylabel="predicted (ms)",
            title=f"held-out MAPE {100 * result.heldout_mape:.1f} %")
    fig.suptitle(f"{result.key.get('model')} on {result.ceilings.device}", fontsize=9)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    return png_path
