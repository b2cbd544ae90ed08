"""The server's Prometheus metrics (prefix `bastion_`): its own request metrics, and the engine's
step accounting exported as it stands at each scrape.

They live on the same registry as the controller's (`controller.metrics.REGISTRY` by
default), so one /metrics page shows both. `server_metrics(registry)` returns one
`ServerMetrics` per registry, so tests may build several apps in one process without
registering a name twice.

Request metrics are updated by the scheduler as requests arrive, start and finish. Step
figures (steps by kind, draft and accepted token counts, per-depth acceptance, tree-size and
accepted-length histograms, the estimated speedup; per target forward the batch size, the
tree tokens and the speculative tokens) are computed by the engine's
`engine.accounting.StepAccounting`; `StepCollector` only reads it (definitions there).
"""
from __future__ import annotations

import threading

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from controller.metrics import REGISTRY, controller_metrics
from engine.accounting import StepAccounting

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServerMetrics:
    """All server metrics registered on one registry (plus the controller's, which it reuses)."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.requests = Counter("bastion_requests", "Finished requests by finish reason "
                                "(stop, length, cancelled, error)", ["finish_reason"], registry=r)
        self.http_errors = Counter("bastion_http_errors", "Error responses by HTTP status (not /health's 503 "
                                   "answers: loading, draining, engine failed)", ["status"], registry=r)
        self.prompt_tokens = Counter("bastion_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("bastion_generation_tokens", "Tokens returned to clients", registry=r)
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
        self.ready = Gauge("bastion_model_ready", "1 once the model (and calibration) is ready", registry=r)
        self.steps = StepCollector()
        r.register(self.steps)
        # The controller's series exist on every page (dashboards query them in every mode);
        # only the adaptive controller updates them.
        controller_metrics(r)


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


class StepCollector(Collector):
    """Exports an engine's StepAccounting at scrape time.

    `source` returns the accounting to read (None while no engine is loaded: every total is 0
    and the speedup 1). The scheduler points it at its engine once loaded.
    """

    def __init__(self, source: Callable[[], StepAccounting | None] | None = None):
        self.source = source or (lambda: None)

    def collect(self):
        acc = self.source()
        acc = acc.snapshot() if acc is not None else StepAccounting()
        yield CounterMetricFamily("bastion_drafts", "Verification steps (target forwards over a tree)",
                                  value=acc.steps)
        kinds = CounterMetricFamily("bastion_steps", "Decoding steps by kind: draft (full drafter), cheap (its "
                                    "free part only), plain", labels=["mode"])
        for kind, n in acc.steps_by_kind.items():
            kinds.add_metric([kind], n)
        yield kinds
        yield CounterMetricFamily("bastion_draft_tokens", "Tree nodes verified, root excluded", value=acc.draft_tokens)
        yield CounterMetricFamily("bastion_accepted_tokens", "Drafted tokens committed (bonus excluded)",
                                  value=acc.accepted_tokens)
        depth = CounterMetricFamily("bastion_accepted_tokens_per_depth",
                                    "Drafted tokens committed, by tree depth (1 = first drafted token)", labels=["depth"])
        for d, n in enumerate(acc.accepted_per_depth, start=1):
            if n:
                depth.add_metric([str(d)], n)
        yield depth
        for name, doc, hist in (("bastion_tree_size_nodes", "Tree tokens verified per step (root included)",
                                 acc.tree_size),
                                ("bastion_accepted_length_tokens", "Tokens committed per step, bonus included",
                                 acc.accepted_length)):
            yield HistogramMetricFamily(name, doc, buckets=hist.cumulative(), sum_value=hist.total)
        for name, doc, hist in (("bastion_batch_size_sequences", "Sequences per target forward (batched step)",
                                 acc.batch_size),
                                ("bastion_step_nodes_tokens", "Tree tokens per target forward, all sequences together "
                                 "(roots included)", acc.step_nodes),
                                ("bastion_step_speculative_tokens", "Drafted tree tokens per target forward, all "
                                 "sequences together (roots excluded)", acc.step_speculative)):
            yield HistogramMetricFamily(name, doc, buckets=hist.cumulative(), sum_value=hist.total)
        yield GaugeMetricFamily("bastion_estimated_speedup", "Estimated speedup over AR of the recent steps: AR step "
                                "seconds x tokens per second over every step (1 for plain decoding)",
                                value=acc.speedup())
