"""The proxy's Prometheus metrics (SPEC.md section 9), on a registry of their own.

One `KvgateMetrics` per proxy app, so tests can run several apps in one process
without colliding in prometheus-client's global registry. No metric carries a
session id: session ids are unbounded and would explode the series count.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
PROBE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
TURN_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
PREEMPTION_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100)

CONTENT_TYPE = CONTENT_TYPE_LATEST


TURN_LABELS = ("1", "2-3", "4-7", "8-15", "16+")  # the `turn` label's values, in order


def turn_bucket(turn_index: int) -> str:
    """The `turn` label for the 1-based index of a turn in its session."""
    if turn_index <= 1:
        return "1"
    if turn_index <= 3:
        return "2-3"
    if turn_index <= 7:
        return "4-7"
    if turn_index <= 15:
        return "8-15"
    return "16+"


class KvgateMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvgate_requests",
            "Forwarded requests by route, replica and final status.",
            ["route", "replica", "status"],
            registry=r,
        )
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
        self.pending_sessions = Gauge(
            "kvgate_pending_sessions", "Sessions waiting at the gate.", ["replica"], registry=r
        )
        self.reserved_sessions = Gauge(
            "kvgate_reserved_sessions",
            "Sessions holding a reservation, in flight or idle.",
            ["replica", "state"],
            registry=r,
        )
        self.preempted_attempts = Counter(
            "kvgate_preempted_attempts",
            "Waiting attempts aborted by a newer attempt of their session.",
            ["replica"],
            registry=r,
        )
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
        self.replica_healthy = Gauge(
            "kvgate_replica_healthy", "1 when the replica passes health checks.", ["replica"], registry=r
        )
        self.upstream_errors = Counter(
            "kvgate_upstream_errors",
            "Upstream failures by kind (connect, mid_stream, client_disconnect, ...).",
            ["replica", "kind"],
            registry=r,
        )
        self.turn_seconds = Histogram(
            "kvgate_turn_seconds",
            "End-to-end time of a turn, by its index in the session.",
            ["turn"],
            buckets=TURN_SECONDS_BUCKETS,
            registry=r,
        )
        self.session_preemptions = Histogram(
            "kvgate_session_preemptions",
            "Preempted attempts per session, observed when a session ends.",
            buckets=PREEMPTION_BUCKETS,
            registry=r,
        )
        self.window_ends = Counter(
            "kvgate_window_ends",
            "Ownership windows ended, by cause (finish|quiet|grace|lost|revoked).",
            ["replica", "cause"],
            registry=r,
        )

        self.gate_conflict = Gauge(
            "kvgate_gate_conflict",
            "1 while another gate also enforces (or tries to) on the replica.",
            ["replica"],
            registry=r,
        )

    @property
    def operator(self) -> OperatorMetrics:
        """The operator metrics (issue 13), built on first use on this registry. The proxy
        app touches it when it is built, so the series exist from the first scrape."""
        operator = self.__dict__.get("_operator")
        if operator is None:
            operator = self.__dict__["_operator"] = OperatorMetrics(self.registry)
        return operator

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ---------------------------------------------------------------- operator metrics (issue 13)
# Added for the dashboard and alert rules in docker/grafana and docker/prometheus
# (docs/observability.md). Kept as a separate block so other branches' additions merge.


class OperatorMetrics:
    """The metrics an operator's dashboard and alerts read, beyond SPEC.md section 9.

    Gate-side series are labelled by replica (and admission reason); the replicas'
    own counters, mirrored by `balancer.replica_metrics.ReplicaMetricsScraper`, are
    exported by that scraper's collector on the same registry.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
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
