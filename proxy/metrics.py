"""The proxy's Prometheus metrics (docs/reference.md, Metrics), on a registry of their own.

One `KvgateMetrics` per proxy app, so tests can run several apps in one process
without colliding in prometheus-client's global registry. It defines the front
door's families and composes the parts' own (`gate.metrics.GateMetrics`,
`balancer.metrics.BalancerMetrics`), as vLLM's metrics layer turns the scheduler's
stats into series: the gate and the balancer never import the front door. No metric
carries a session id: session ids are unbounded and would explode the series count.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvgate.balancer.metrics import BalancerMetrics
from kvgate.gate.metrics import GateMetrics

TURN_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

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
    """Every kvgate series on one registry: the front door's own families here, the
    gate's (`gate`: `GateMetrics`) and the balancer's (`balancer`: `BalancerMetrics`)
    composed, each part registering its own on this registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvgate_requests",
            "Forwarded requests by route, replica and final status.",
            ["route", "replica", "status"],
            registry=r,
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
        self.gate = GateMetrics(r)
        self.balancer = BalancerMetrics(r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
