"""Request-level Prometheus metrics of the server (prefix `bastion_`).

They live on the same registry as the controller's (`controller.metrics.REGISTRY` by
default), so one /metrics page shows both. `server_metrics(registry)` returns one
`ServerMetrics` per registry, so tests may build several apps in one process without
registering a name twice.

Definitions (see docs/SPEC.md section 1):
- drafts: verification steps (one target forward over a tree; a plain AR step is a
  root-only tree, so tau = 1 for AR);
- draft tokens: tree nodes verified, root excluded;
- accepted tokens: drafted (non-root, non-bonus) tokens that were committed;
- generation tokens: tokens returned to clients (= sum of usage.completion_tokens);
- estimated speedup over AR: tau x (AR step seconds) / (speculative step seconds), where
  the AR step time is the mean verify time of root-only steps, or a one-token forward
  timed at startup when no such step was seen.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller.metrics import REGISTRY, controller_metrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
#: Depth labels of the per-depth acceptance counter (published drafters: block 16 -> depths 1..15).
MAX_DEPTH_LABEL = 32


class ServerMetrics:
    """All server metrics registered on one registry (plus the controller's, which it reuses)."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.requests = Counter("bastion_requests", "Finished requests by finish reason "
                                "(stop, length, cancelled, error)", ["finish_reason"], registry=r)
        self.http_errors = Counter("bastion_http_errors", "Error responses by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("bastion_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("bastion_generation_tokens", "Tokens returned to clients", registry=r)
        self.drafts = Counter("bastion_drafts", "Verification steps (target forwards over a tree)", registry=r)
        self.draft_tokens = Counter("bastion_draft_tokens", "Tree nodes verified, root excluded", registry=r)
        self.accepted_tokens = Counter("bastion_accepted_tokens", "Drafted tokens committed (bonus excluded)",
                                       registry=r)
        self.accepted_per_depth = Counter("bastion_accepted_tokens_per_depth",
                                          "Drafted tokens committed, by tree depth (1 = first drafted token)",
                                          ["depth"], registry=r)
        self.ttft = Histogram("bastion_time_to_first_token_seconds",
                              "Arrival to first token (queue + prefill)", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("bastion_inter_token_latency_seconds",
                             "Decode seconds per returned token (a k-token step counts k times)",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("bastion_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("bastion_request_queue_time_seconds", "Arrival to start of prefill",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("bastion_requests_running", "Requests being decoded", registry=r)
        self.waiting = Gauge("bastion_requests_waiting", "Requests queued, not yet started", registry=r)
        self.speedup = Gauge("bastion_estimated_speedup", "Estimated speedup over AR: tau x AR step seconds / "
                             "speculative step seconds (1 when no speculative step ran)", registry=r)
        self.ready = Gauge("bastion_model_ready", "1 once the model (and calibration) is ready", registry=r)
        self.speedup.set(1.0)
        # Tree size and accepted length histograms are the controller's; reused, never redefined.
        self.controller = ctrl = controller_metrics(r)
        self.tree_size = ctrl.tree_size
        self.accepted_length = ctrl.accepted


_lock = threading.Lock()
_by_registry: dict[int, tuple[CollectorRegistry, ServerMetrics]] = {}


def server_metrics(registry: CollectorRegistry | None = None) -> ServerMetrics:
    """The ServerMetrics of `registry` (default: the controller's REGISTRY), created on first use."""
    registry = REGISTRY if registry is None else registry
    with _lock:
        entry = _by_registry.get(id(registry))
        if entry is None or entry[0] is not registry:
            entry = (registry, ServerMetrics(registry))
            _by_registry[id(registry)] = entry
        return entry[1]


class SpeedupEstimator:
    """Running estimate of the speedup over AR from the steps actually run.

    ar_probe_s: seconds of a one-token forward timed at startup (used until a root-only
    step is seen). `record` takes one step's tree size, committed tokens and times (seconds).
    """

    def __init__(self, ar_probe_s: float | None = None):
        self.ar_probe_s = ar_probe_s
        self._ar_n = 0
        self._ar_verify_s = 0.0
        self._spec_n = 0
        self._spec_tokens = 0
        self._spec_s = 0.0

    def record(self, tree_size: int, committed: int, draft_s: float, verify_s: float, other_s: float) -> None:
        if tree_size <= 1:
            self._ar_n += 1
            self._ar_verify_s += verify_s
        else:
            self._spec_n += 1
            self._spec_tokens += committed
            self._spec_s += draft_s + verify_s + other_s

    @property
    def ar_step_s(self) -> float | None:
        """Mean verify seconds of root-only steps, else the startup probe, else None."""
        if self._ar_n:
            return self._ar_verify_s / self._ar_n
        return self.ar_probe_s

    def value(self) -> float:
        """tau x AR step seconds / speculative step seconds over speculative steps; 1.0 when undefined."""
        ar = self.ar_step_s
        if not self._spec_n or ar is None or self._spec_s <= 0:
            return 1.0
        tau = self._spec_tokens / self._spec_n
        return tau * ar / (self._spec_s / self._spec_n)
