"""Latency-model fit, calibration grid timing, disk cache, report, ceilings and a real tiny forward."""
import json
import logging

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from controller import calibration as cal
from controller.ceilings import (Ceilings, datasheet_ceilings, device_name, measure_bandwidth,
                                 measure_matmul_flops)
from controller.cost_model import ModelShape
from controller.latency_model import LatencyModel, LatencyParams, fit_params, mape

# KV-heavy tiny shape: bytes vary strongly with c and FLOPs with s, so all four parameters are identifiable.
CFG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, head_dim=64, vocab_size=256, tie_word_embeddings=False)
SHAPE = ModelShape.from_config(CFG, torch.float32)
CEIL = Ceilings(1e11, 1e10, "synthetic device", "given")
TRUE = LatencyParams(alpha_c=1.5, beta_c=1e-3, alpha_m=1.2, beta_m=5e-4)
GRID = cal.CalibrationGrid((1, 2, 4, 8, 16, 32, 64, 128, 256), (64, 512, 2048, 8192))


def synthetic_measure(noise=0.02, seed=0):
    """measure_fn from the model itself with multiplicative Gaussian noise; counts its calls."""
    rng = np.random.default_rng(seed)
    truth = LatencyModel(SHAPE, CEIL, TRUE)

    def measure(s, c):
        measure.calls += 1
        return truth.predict(s, c) * (1 + noise * rng.standard_normal())
    measure.calls = 0
    return measure


def test_fit_recovers_known_parameters_from_noisy_timings():
    truth = LatencyModel(SHAPE, CEIL, TRUE)
    pts = np.array(GRID.points())
    s, c = pts[:, 0], pts[:, 1]
    y = truth.predict(s, c) * (1 + 0.02 * np.random.default_rng(1).standard_normal(len(s)))
    p = fit_params(SHAPE, CEIL, s, c, y)
    assert p.alpha_c == pytest.approx(TRUE.alpha_c, rel=0.05)
    assert p.alpha_m == pytest.approx(TRUE.alpha_m, rel=0.05)
    assert p.beta_c == pytest.approx(TRUE.beta_c, rel=0.25)
    assert p.beta_m == pytest.approx(TRUE.beta_m, rel=0.25)
    assert mape(truth.predict(s, c), LatencyModel(SHAPE, CEIL, p).predict(s, c)) < 0.02


def test_a_fit_out_of_evaluations_keeps_its_best_point():
    """An online refit caps the model evaluations (profiler.REFIT_MAX_NFEV): a start that runs
    out of them gives its best point so far, no worse than where it started, not an error."""
    truth = LatencyModel(SHAPE, CEIL, TRUE)
    pts = np.array(GRID.points())
    s, c = pts[:, 0], pts[:, 1]
    y = truth.predict(s, c)
    far = LatencyParams(TRUE.alpha_c * 3, TRUE.beta_c * 3, TRUE.alpha_m * 3, TRUE.beta_m * 3)
    p = fit_params(SHAPE, CEIL, s, c, y, start=far, max_nfev=3)
    err_start = mape(y, LatencyModel(SHAPE, CEIL, far).predict(s, c))
    assert mape(y, LatencyModel(SHAPE, CEIL, p).predict(s, c)) < err_start
    full = fit_params(SHAPE, CEIL, s, c, y, start=far)
    assert mape(y, LatencyModel(SHAPE, CEIL, full).predict(s, c)) < 0.01


def test_fit_rejects_too_few_or_bad_points():
    with pytest.raises(ValueError, match="at least 4"):
        fit_params(SHAPE, CEIL, [1, 2], [0, 0], [0.1, 0.2])
    with pytest.raises(ValueError, match="positive"):
        fit_params(SHAPE, CEIL, [1, 2, 3, 4], [0] * 4, [0.1, 0.2, 0.0, 0.3])


def test_measure_grid_warmups_repeats_and_median():
    values = iter([9.0, 9.0, 9.0, 5.0, 1.0, 3.0, 2.0, 4.0] + [7.0] * 8)
    calls = []

    def fn(s, c):
        calls.append((s, c))
        return next(values)
    out = cal.measure_grid(fn, [(1, 10), (2, 10)], warmup=3, repeats=5, progress=False)
    assert len(calls) == 16  # 3 warm-ups + 5 timed runs per point
    assert out == [(1, 10, 3.0), (2, 10, 7.0)]  # median of 5,1,3,2,4 -> 3 (warm-ups ignored)


def test_measure_grid_time_budget_cuts_repeats():
    import time

    def slow(s, c):
        time.sleep(0.01)
        return 0.01
    t0 = time.perf_counter()
    out = cal.measure_grid(slow, [(s, 64) for s in (1, 2, 4, 8)], warmup=3, repeats=5, time_budget_s=0.1,
                           progress=False)
    assert len(out) == 4 and time.perf_counter() - t0 < 0.5  # unbounded would be 32 calls = 0.32 s+


def test_calibrate_heldout_error_cache_hit_report_and_plot(tmp_path):
    fn = synthetic_measure()
    res = cal.calibrate(fn, CFG, torch.float32, GRID, model_name="tiny/llama", ceilings=CEIL, cache_dir=tmp_path,
                        warmup=1, repeats=3, time_budget_s=None, progress=False)
    n = len(GRID.points())
    assert fn.calls == n * 4
    assert res.heldout == list(range(1, n, 4)) and 0 < res.heldout_mape < 0.04 and res.fit_mape < 0.03
    assert res.params.alpha_c == pytest.approx(1.5, rel=0.05)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["model"] == "tiny/llama"

    again = cal.calibrate(fn, CFG, torch.float32, GRID, model_name="tiny/llama", ceilings=CEIL,
                          cache_dir=tmp_path, progress=False)
    assert fn.calls == n * 4 and again.from_cache and again.params == res.params

    png = tmp_path / "plot.png"
    lines = []

    class Sink:
        def write(self, text):
            lines.append(text)
    text = cal.report(res, png, file=Sink(), extra="surrogate: none")
    rows = [l for l in text.splitlines() if l.split() and l.split()[0].isdigit()]
    assert len(rows) == n and sum(r.endswith("*") for r in rows) == len(res.heldout)
    assert "datasheet ceilings: none" in text and text.endswith("surrogate: none")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _calibrate(fn, tmp_path):
    return cal.calibrate(fn, CFG, torch.float32, GRID, model_name="tiny/llama", ceilings=CEIL, cache_dir=tmp_path,
                         warmup=0, repeats=1, time_budget_s=None, progress=False)


def test_corrupt_cache_is_ignored_with_warning_and_recomputed(tmp_path, caplog):
    fn = synthetic_measure()
    first = _calibrate(fn, tmp_path)
    path = next(tmp_path.glob("*.json"))
    path.write_text('{"key": {"format": 1}, "params": [truncated')
    with caplog.at_level(logging.WARNING, logger="controller.calibration"):
        again = _calibrate(fn, tmp_path)
    assert "corrupt calibration cache" in caplog.text
    assert fn.calls == 2 * len(GRID.points()) and not again.from_cache
    assert json.loads(path.read_text())["params"] == again.params.to_dict()  # rewritten
    assert first.params.alpha_c == pytest.approx(again.params.alpha_c, rel=0.05)


@pytest.mark.parametrize("field,value", [("torch", "1.0.0"), ("attn_backend", "eager"), ("dtype", "bfloat16")])
def test_mismatching_cache_is_ignored_with_warning(tmp_path, caplog, field, value):
    fn = synthetic_measure()
    _calibrate(fn, tmp_path)
    path = next(tmp_path.glob("*.json"))
    doc = json.loads(path.read_text())
    doc["key"][field] = value
    path.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="controller.calibration"):
        again = _calibrate(fn, tmp_path)
    assert "does not match" in caplog.text and field in caplog.text
    assert fn.calls == 2 * len(GRID.points()) and not again.from_cache


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("BASTION_CACHE", str(tmp_path))
    assert cal.default_cache_dir() == tmp_path / "calibration"
    assert cal.default_grid("cpu") is cal.CPU_GRID and cal.default_grid("cuda") is cal.GPU_GRID
    assert cal.GPU_GRID.s_values[0] == 1 and max(cal.GPU_GRID.s_values) == 512 and max(cal.GPU_GRID.c_values) == 2048
    assert cal.CPU_GRID.points(max_context=600)[-1] == (64, 512)


def test_ceilings_microbenchmarks_and_datasheet():
    flops = measure_matmul_flops("cpu", n=128, budget_s=0.05)
    bw = measure_bandwidth("cpu", nbytes=8 << 20, budget_s=0.05)
    assert 1e8 < flops < 1e14 and 1e8 < bw < 1e13
    assert datasheet_ceilings("NVIDIA A100-SXM4-80GB").flops_per_s == 312e12
    assert datasheet_ceilings("NVIDIA H100 80GB HBM3").bytes_per_s == 3.35e12
    assert datasheet_ceilings("NVIDIA H100 PCIe").flops_per_s == 756e12
    assert datasheet_ceilings("NVIDIA H200").bytes_per_s == 4.8e12
    assert datasheet_ceilings("Intel(R) Xeon(R)") is None
    assert f" threads)" in device_name("cpu") and f"{torch.get_num_threads()} threads" in device_name("cpu")


def test_cpu_identity_tells_apart_machines_with_the_same_model_name(monkeypatch, tmp_path):
    """Same "Intel(R) Xeon(R) Processor" string, one with AMX and one without: different cache keys."""
    import builtins

    from controller import ceilings

    def fake_cpuinfo(flags: str):
        text = f"processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu {flags}\n"
        real_open = builtins.open

        def fake_open(path, *a, **k):
            if str(path) == "/proc/cpuinfo":
                f = tmp_path / f"cpuinfo-{len(flags)}"
                f.write_text(text)
                return real_open(f, *a, **k)
            return real_open(path, *a, **k)
        return fake_open

    monkeypatch.setattr(builtins, "open", fake_cpuinfo("avx2 avx512f avx512_bf16 amx_bf16 amx_tile"))
    with_amx = ceilings.device_name("cpu")
    monkeypatch.setattr(builtins, "open", fake_cpuinfo("avx2"))
    without = ceilings.device_name("cpu")
    assert "amx_bf16" in with_amx and "amx_bf16" not in without and with_amx != without
    assert without.startswith("Intel(R) Xeon(R) Processor [avx2] (")
    shape = SHAPE
    grid = cal.CalibrationGrid((1, 2), (16,))
    keys = [cal.cache_key("m", d, torch.float32, "sdpa", shape, grid) for d in (with_amx, without)]
    assert keys[0] != keys[1] and cal.cache_path(tmp_path, keys[0]) != cal.cache_path(tmp_path, keys[1])


def test_calibrate_real_tiny_forward(tmp_path):
    from engine.timing import verify_timer
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    measure = verify_timer(model)
    grid = cal.CalibrationGrid((1, 4, 16, 64), (16, 128))
    ceil = Ceilings(measure_matmul_flops("cpu", n=128, budget_s=0.05),
                    measure_bandwidth("cpu", nbytes=8 << 20, budget_s=0.05), device_name("cpu"))
    res = cal.calibrate(measure, cfg, torch.float32, grid, model_name="tiny-random", cache_dir=tmp_path,
                        ceilings=ceil, warmup=1, repeats=2, time_budget_s=None, progress=False)
    assert len(res.points) == 8 and all(t > 0 for _, _, t in res.points)
    assert np.isfinite(res.heldout_mape) and np.isfinite(res.fit_mape)
    assert res.key["attn_backend"] == cfg._attn_implementation or res.key["attn_backend"] == "default"
    # the timer trims its cache back to c tokens after each call: the same c times the same shape
    assert 0 < measure(8, 128) and 0 < measure(8, 128)


def test_robust_fit_ignores_timings_spoiled_by_a_busy_machine():
    truth = LatencyModel(SHAPE, CEIL, TRUE)
    pts = np.array(GRID.points())
    s, c = pts[:, 0], pts[:, 1]
    y = truth.predict(s, c) * (1 + 0.02 * np.random.default_rng(2).standard_normal(len(s)))
    y[[3, 10, 22]] *= np.array([8.0, 15.0, 4.0])  # another process stole the cores for three points
    robust = LatencyModel(SHAPE, CEIL, fit_params(SHAPE, CEIL, s, c, y))
    plain = LatencyModel(SHAPE, CEIL, fit_params(SHAPE, CEIL, s, c, y, robust=False))
    clean = np.setdiff1d(np.arange(len(s)), [3, 10, 22])
    err_robust = mape(truth.predict(s[clean], c[clean]), robust.predict(s[clean], c[clean]))
    err_plain = mape(truth.predict(s[clean], c[clean]), plain.predict(s[clean], c[clean]))
    assert err_robust < 0.01 and err_plain > 1.5 * err_robust


def test_outliers_are_measured_again_and_the_faster_median_kept(tmp_path):
    truth = LatencyModel(SHAPE, CEIL, TRUE)
    spoiled = {(8, 512): 6, (64, 2048): 6}  # the first 6 calls at these points are 10x slow
    calls = {}

    def measure(s, c):
        calls[(s, c)] = calls.get((s, c), 0) + 1
        slow = spoiled.get((s, c), 0) >= calls[(s, c)]
        return truth.predict(s, c) * (10.0 if slow else 1.0)
    res = cal.calibrate(measure, CFG, torch.float32, GRID, model_name="m", ceilings=CEIL, cache_dir=tmp_path,
                        warmup=1, repeats=5, time_budget_s=None, progress=False)
    assert calls[(8, 512)] == 12 and calls[(64, 2048)] == 12 and calls[(1, 64)] == 6
    got = {(s, c): t for s, c, t in res.points}
    assert got[(8, 512)] == pytest.approx(truth.predict(8, 512))
    assert res.fit_mape < 1e-3


def test_spent_budget_skips_warmups_or_points():
    import time
    calls = []

    def slow(s, c):
        calls.append(s)
        time.sleep(0.02)
        return 0.02
    pts = [(s, 64) for s in range(1, 9)]
    out = cal.measure_grid(slow, pts, warmup=3, repeats=5, time_budget_s=0.05, progress=False)
    assert len(out) == 8 and len(calls) <= 3 + 1 + 2 * 2 + 8  # budget gone after ~2 points: 1 run each after
    calls.clear()
    out = cal.measure_grid(slow, pts, warmup=3, repeats=5, time_budget_s=0.05, progress=False, stop_when_spent=True)
    assert 1 <= len(out) < 8 and out == [(s, 64, 0.02) for s, _ in pts[:len(out)]]


def _kernel_quirk(s):
    """A CPU-like per-s factor two lines cannot express: 1-2 tokens cost 40 % less, 4 tokens 20 % less."""
    s = np.asarray(s, dtype=np.float64)
    return np.where(s <= 2, 0.6, np.where(s <= 4, 0.8, 1.0))


def test_residual_absorbs_a_per_s_quirk_and_survives_the_cache(tmp_path):
    """Timings = roofline x a per-s factor: the four-parameter fit alone misses the small-s points,
    the fitted residual recovers the factor, held-out error drops, and the cache keeps it."""
    truth = LatencyModel(SHAPE, CEIL, TRUE)
    rng = np.random.default_rng(3)

    def measure(s, c):
        return float(truth.predict(s, c) * _kernel_quirk(s) * (1 + 0.01 * rng.standard_normal()))

    res = cal.calibrate(measure, CFG, torch.float32, GRID, model_name="tiny", ceilings=CEIL, cache_dir=tmp_path,
                        warmup=0, repeats=1, time_budget_s=None, progress=False)
    m = res.model()
    assert m.knots == tuple(float(s) for s in GRID.s_values)
    # the residual times the fitted roofline reproduces the truth at every grid point
    pts = np.array(GRID.points())
    want = truth.predict(pts[:, 0], pts[:, 1]) * _kernel_quirk(pts[:, 0])
    assert mape(want, m.predict(pts[:, 0], pts[:, 1])) < 0.03
    assert res.heldout_mape < 0.6 * res.heldout_mape_roofline
    # between knots log r is interpolated in log2 s: s = 3 lies between s = 2 and s = 4
    r = m.residual_factor([2, 3, 4])
    lr = np.log(r)
    assert r[0] < r[1] < r[2] and lr[1] == pytest.approx(lr[0] + (lr[2] - lr[0]) * np.log2(1.5), rel=1e-6)
    again = cal.calibrate(measure, CFG, torch.float32, GRID, model_name="tiny", ceilings=CEIL, cache_dir=tmp_path,
                          progress=False)
    assert again.from_cache and again.residual == res.residual
    assert again.model().predict(3, 512) == pytest.approx(m.predict(3, 512))
    text = cal.report(again, file=open(tmp_path / "r.txt", "w"))
    assert "residual r(s): 1:" in text and "roofline alone" in text


def test_plain_roofline_has_no_residual_and_fit_model_can_skip_it():
    from controller.latency_model import fit_model

    truth = LatencyModel(SHAPE, CEIL, TRUE)
    assert truth.residual_factor([1, 7, 300]).tolist() == [1.0, 1.0, 1.0]
    pts = np.array(GRID.points())
    y = truth.predict(pts[:, 0], pts[:, 1])
    assert fit_model(SHAPE, CEIL, pts[:, 0], pts[:, 1], y, knots=()).residual == ()
    m = fit_model(SHAPE, CEIL, pts[:, 0], pts[:, 1], y)
    assert np.allclose(m.residual_factor(GRID.s_values), 1.0, atol=0.02)


def test_a_residual_whose_medians_fall_with_s_is_pooled_into_a_non_decreasing_curve():
    """Plain steps timed under load (s = 1, 1.5x slow) beside trees timed on a quiet machine
    (s = 2..64): the knots' medians say C falls from s = 1 to s = 2, which would price every tree
    up to that size at C(1). The fitted residual pools the disagreeing knots into their
    point-weighted mean, so C is non-decreasing over the knots; the knot that already rises
    (s = 64, 3.7 C(1) on this device) is kept as it is."""
    from controller.latency_model import fit_residual

    truth = LatencyModel(SHAPE, CEIL, TRUE)
    knots = (1, 2, 4, 8, 64)
    s = np.repeat(knots, [30, 10, 10, 10, 10]).astype(float)
    c = np.full_like(s, 512.0)
    y = truth.predict(s, c) * np.where(s == 1, 1.5, 1.0)
    res = dict(fit_residual(truth, s, c, y, knots))
    model = LatencyModel(SHAPE, CEIL, TRUE, tuple(res.items()))
    cost = model.predict(np.array(knots, dtype=float), np.full(5, 512.0))
    assert np.all(np.diff(cost) >= -1e-12 * cost[:-1])
    assert res[64.0] == pytest.approx(0.0, abs=1e-9)
    # the pooled knots share one cost: the point-weighted mean of their log times (half the
    # points at 1.5 C(1), half at about C(1)), so between the two kinds' times
    assert cost[0] == pytest.approx(cost[3], rel=1e-9)
    assert 1.15 * truth.predict(1, 512) < cost[0] < 1.3 * truth.predict(1, 512)
    # on timings that rise with s, the residual is the knots' own medians (all 0 here)
    same = fit_residual(truth, s, c, truth.predict(s, c), knots)
    assert [v for _, v in same] == pytest.approx([0.0] * 5, abs=1e-9)


def test_noisy_calibration_is_used_but_not_cached_and_warns(tmp_path, caplog):
    """Timings from a machine that was busy (random 0.1x-10x factors): the fit is returned
    with a warning and no cache file, so the next start calibrates again; a residual that
    does not help on held-out points is dropped."""
    truth = LatencyModel(SHAPE, CEIL, TRUE)
    rng = np.random.default_rng(7)

    def busy(s, c):
        return float(truth.predict(s, c) * 10 ** rng.uniform(-1, 1))

    with caplog.at_level(logging.WARNING, logger="controller.calibration"):
        res = cal.calibrate(busy, CFG, torch.float32, GRID, model_name="tiny", ceilings=CEIL, cache_dir=tmp_path,
                            warmup=0, repeats=1, time_budget_s=None, progress=False)
    assert res.heldout_mape > cal.NOISY_MAPE
    assert "not cached" in caplog.text and list(tmp_path.glob("*.json")) == []
    assert res.heldout_mape <= res.heldout_mape_roofline + 1e-12
    if res.residual:  # kept only when it did not make the held-out error worse
        assert res.heldout_mape < res.heldout_mape_roofline
