"""scripts/gpu_check.py runs end to end on CPU with tiny shapes (so it is known to work when a GPU comes)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_tiny_on_cpu(tmp_path):
    gc = _load()
    report = gc.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--budget-s", "10"])
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    md = (tmp_path / "gpu_check.md").read_text()
    assert saved["tiny"] and saved["device"] == "cpu" and not saved["flash_attn_available"]
    assert set(saved["backends"]) == {"sdpa", "flex"}
    assert all(r["ok"] for r in saved["backends"].values()), saved["backends"]
    assert saved["selected_backend"] in ("sdpa", "flex")
    timed = [r for r in saved["verification"] if r["seconds"] is not None]
    assert {(r["backend"], r["s"]) for r in timed} >= {("sdpa", 1), ("flex", 1)}
    cal = saved["calibration"]
    assert cal["points"] >= 4 and cal["fit_mape"] >= 0 and cal["measured"]["flops_per_s"] > 0
    assert cal["datasheet"] is None  # a CPU has no datasheet entry
    assert all(r["seconds"] > 0 for r in saved["drafter"])
    ov = saved["overhead"]
    assert ov["n"] == 64 and ov["accepted_path"] >= 2 and ov["total_device_path"] > 0
    assert ov["total_device_path"] > 0 and ov["accept_device"] > 0 and ov["load_device"] > 0
    exact = {r["dtype"]: r for r in saved["tree_vs_ar"]}
    assert exact["float32"]["first_divergence"] is None and exact["float32"]["tree_nodes"] == 15
    assert "first divergence" in md
    assert "| device |" in md
    assert "| backend |" in md and "Verification latency" in md and "Calibration" in md
    assert report["elapsed_s"] < 60


def test_datasheet_reference_is_the_h200():
    from controller.ceilings import datasheet_ceilings

    h200 = datasheet_ceilings("NVIDIA H200")
    assert h200.flops_per_s == pytest.approx(989e12) and h200.bytes_per_s == pytest.approx(4.8e12)
