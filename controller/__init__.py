"""Hardware-aware budget controller: cost model, calibration, profiler and adaptive stopping policy."""
