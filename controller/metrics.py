"""Prometheus metrics of the budget controller (prefix `bastion_`), on a registry the server exposes.

`REGISTRY` is the module-level registry the server's /metrics serves; tests pass a fresh
`CollectorRegistry`. `controller_metrics(registry)` returns one `ControllerMetrics` per
registry, so building several controllers in one process never registers a name twice.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller.latency_model import PARAM_NAMES, LatencyParams

#: The registry the server exports.
REGISTRY = CollectorRegistry()
#: s values of the latency-table gauge.
TABLE_S = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_LATENCY_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ControllerMetrics:
    """All controller metrics registered on one registry."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.params = Gauge("bastion_latency_model_param", "Fitted roofline parameter (alphas unitless, betas seconds)",
                            ["param"], registry=r)
        self.fit_error = Gauge("bastion_latency_model_error_ratio",
                               "Latency model MAPE as a fraction: calibration held-out, or online over recent steps",
                               ["kind"], registry=r)
        self.table = Gauge("bastion_predicted_verify_seconds",
                           "Predicted verify latency of s tree tokens at the current context length", ["s"],
                           registry=r)
        self.context = Gauge("bastion_context_tokens",
                             "Context length (cached tokens) the latency table was last computed at "
                             "(0 at start-up; a batched step's mean)", registry=r)
        self.t_draft = Gauge("bastion_draft_seconds", "Running estimate of the drafter's pass per step", registry=r)
        self.t_other = Gauge("bastion_other_seconds",
                             "Running estimate of per-step overhead outside draft and verify", registry=r)
        self.verify_measured = Histogram("bastion_verify_seconds", "Measured verify latency per step",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.verify_last = Gauge("bastion_verify_last_seconds", "Latest step's verify latency", ["kind"], registry=r)
        self.verify_ratio = Histogram("bastion_verify_predicted_over_measured",
                                      "Predicted / measured verify latency per step",
                                      buckets=(0.5, 0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0), registry=r)
        self.refits = Counter("bastion_latency_model_refits", "Background refits of the latency model", registry=r)
        self.rescales = Counter("bastion_latency_model_rescales",
                                "Rescales of the latency model's level to recent measured steps", registry=r)
        self.drafting = Gauge("bastion_drafting_enabled", "1 when drafting is the controller's best choice (by realised gain)", registry=r)

    def observe_step(self, verify_s: float, predicted_s: float, t_draft: float, t_other: float,
                     drafting: bool) -> None:
        """One step's latency figures (seconds): measured and predicted verify time, the running
        T_draft / T_other estimates, and whether the next step may draft."""
        self.verify_measured.observe(verify_s)
        self.verify_last.labels(kind="measured").set(verify_s)
        self.verify_last.labels(kind="predicted").set(predicted_s)
        if verify_s > 0:
            self.verify_ratio.observe(predicted_s / verify_s)
        self.t_draft.set(t_draft)
        self.t_other.set(t_other)
        self.drafting.set(1 if drafting else 0)

    def set_params(self, params: LatencyParams) -> None:
        for name, value in zip(PARAM_NAMES, params.as_tuple()):
            self.params.labels(param=name).set(value)

    def set_table(self, s_values, seconds) -> None:
        for s, t in zip(s_values, seconds):
            self.table.labels(s=str(int(s))).set(float(t))


_lock = threading.Lock()
_by_registry: dict[int, tuple[CollectorRegistry, ControllerMetrics]] = {}


def controller_metrics(registry: CollectorRegistry | None = None) -> ControllerMetrics:
    """The ControllerMetrics of `registry` (default REGISTRY), created on first use."""
    registry = REGISTRY if registry is None else registry
    with _lock:
        entry = _by_registry.get(id(registry))
        if entry is None or entry[0] is not registry:
            entry = (registry, ControllerMetrics(registry))
            _by_registry[id(registry)] = entry
        return entry[1]
