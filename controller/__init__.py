"""Hardware-aware budget controller: cost model, calibration, profiler and adaptive stopping policy.

Modules, one job each:
    cost_model     FLOPs(s, c) and bytes(s, c) of one target forward, from the HF config
    ceilings       measured FLOP/s and bytes/s of the device, datasheet cross-check
    latency_model  C(s, c) = max(alpha_c FLOPs/P + beta_c, alpha_m Bytes/BW + beta_m) and its fit
    calibration    timing grid, held-out error, disk cache, report and plot
    policy         AdaptivePolicy (docs/method.md, section 4: the stopping rule), PolicySettings
    profiler       per-step records, T_draft / T_other, background refit on drift
    gate           "never slower than AR": skip drafting when it does not pay, probe with backoff
    surrogate      predicted A_hat vs realised acceptance, optional per-depth correction
    metrics        the controller's prometheus metrics (prefix bastion_) on controller.metrics.REGISTRY
    budget         BudgetController, the engine's StepController in mode `bastion`

The method is described in docs/method.md, sections 4, 7 and 8. The controller imports
nothing from engine/: the engine calls it through the StepController protocol.
"""
from controller.budget import BudgetController
from controller.calibration import CalibrationGrid, CalibrationResult, calibrate, report
from controller.ceilings import Ceilings, device_name, measure_ceilings
from controller.cost_model import ModelShape
from controller.latency_model import LatencyModel, LatencyParams
from controller.policy import CPU_SETTINGS, GPU_SETTINGS, AdaptivePolicy, PolicySettings, default_settings
from controller.surrogate import depth_mass

__all__ = [
    "AdaptivePolicy", "BudgetController", "CPU_SETTINGS", "CalibrationGrid", "CalibrationResult", "Ceilings",
    "GPU_SETTINGS", "LatencyModel", "LatencyParams", "ModelShape", "PolicySettings", "calibrate", "default_settings",
    "depth_mass", "device_name", "measure_ceilings", "report",
]
