"""The gate's Prometheus metric families (docs/reference.md, Metrics; docs/observability.md).

`GateMetrics(registry)` registers every series the gates, their probes and the ownership
check write, on the registry it is given: the proxy's `KvgateMetrics` composes one on
its own registry, and gate tests build one on a fresh `CollectorRegistry`. The gate
writes these families and never renders them; exposition is the front door's job.

Series are labelled by replica (and admission reason, probe or cause); no family carries
a session id: session ids are unbounded and would explode the series count.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
PROBE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
SUPERSESSION_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100)


class GateMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._register_admission(registry)
        self._register_probes(registry)
        self._register_ownership(registry)
        self._register_dashboard(registry)

    def _register_admission(self, r: CollectorRegistry) -> None:
        self.admissions = Counter(
            "kvgate_admissions", "Gate admissions by replica and reason.", ["replica", "reason"], registry=r
        )
        self.admission_wait = Histogram(
            "kvgate_admission_wait_seconds",
            "Time a request was held at the gate.",
            ["replica"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.waiters = Gauge(
            "kvgate_waiters", "Turns waiting at the gate (named and anonymous).", ["replica"], registry=r
        )
        self.windows = Gauge(
            "kvgate_windows",
            "Sessions holding a window, in flight or idle.",
            ["replica", "state"],
            registry=r,
        )
        self.superseded_attempts = Counter(
            "kvgate_superseded_attempts",
            "Waiting attempts aborted by a newer attempt of their session.",
            ["replica"],
            registry=r,
        )
        self.session_supersessions = Histogram(
            "kvgate_session_supersessions",
            "Superseded attempts per session, observed when a session ends.",
            buckets=SUPERSESSION_BUCKETS,
            registry=r,
        )
        self.window_ends = Counter(
            "kvgate_window_ends",
            "Ownership windows ended, by cause (finish|quiet|grace|lost|revoked).",
            ["replica", "cause"],
            registry=r,
        )

    def _register_probes(self, r: CollectorRegistry) -> None:
        # the balancer's /metrics mirror times its reads here too
        self.probe_seconds = Histogram(
            "kvgate_probe_seconds",
            "Latency of replica probes.",
            ["replica", "probe"],
            buckets=PROBE_BUCKETS,
            registry=r,
        )
        self.probe_errors = Counter(
            "kvgate_probe_errors",
            "Probes that failed, timed out or answered garbage.",
            ["replica", "probe"],
            registry=r,
        )
        self.replica_kv_usage = Gauge(
            "kvgate_replica_kv_usage", "Last KV-cache usage read from each replica.", ["replica"], registry=r
        )

    def _register_ownership(self, r: CollectorRegistry) -> None:
        # docs/ARCHITECTURE.md, Conflict detection
        self.gate_conflict = Gauge(
            "kvgate_gate_conflict",
            "1 while another gate also enforces (or tries to) on the replica.",
            ["replica"],
            registry=r,
        )

    def _register_dashboard(self, r: CollectorRegistry) -> None:
        # for the operator's dashboard and alerts (docs/observability.md)
        self.admission_reason_wait = Histogram(
            "kvgate_admission_reason_wait_seconds",
            "Time a request was held at the gate, by admission reason.",
            ["replica", "reason"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.oldest_waiter_seconds = Gauge(
            "kvgate_oldest_waiter_seconds",
            "How long the oldest request waiting at the gate has waited (0: none).",
            ["replica"],
            registry=r,
        )
        self.reprefill_tokens = Counter(
            "kvgate_reprefill_tokens_estimated",
            "Prompt tokens a session had prefilled on its replica before, found evicted by the prefix probe "
            "when its next turn was admitted (a lower bound: only probed turns count).",
            ["replica"],
            registry=r,
        )
        self.replica_probe_api = Gauge(
            "kvgate_replica_probe_api",
            "1 while the replica answers the probe API; 0 on the /metrics fallback "
            "(the gate is degraded: no block counts, no prefix probe).",
            ["replica"],
            registry=r,
        )
