"""The balancer's Prometheus metric family (docs/reference.md, Metrics): replica health.

`BalancerMetrics(registry)` registers it on the registry it is given (the proxy's
`KvgateMetrics` composes one). The replicas' own counters, mirrored by
`balancer.replica_metrics.ReplicaMetricsScraper`, are a collector of their own on the
same registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge


class BalancerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.replica_healthy = Gauge(
            "kvgate_replica_healthy", "1 when the replica passes health checks.", ["replica"], registry=registry
        )
