"""The gate's Prometheus metric families (docs/reference.md, Metrics; docs/observability.md).

`GateMetrics(registry)` registers every series the gates, their probes and the ownership
check write, on the registry it is given: the proxy's `KvgateMetrics` composes one on
its own registry, and gate tests build one on a fresh `CollectorRegistry`. The gate
writes these families and never renders them; exposition is the front door's job.

Series are labelled by replica (and admission reason, probe or cause); no family carries
a session id: session ids are unbounded and would explode the series count.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from kvgate.gate.book import WindowEnd

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
        # One observation per admission: kvgate_admission_reason_wait_seconds. The
        # admissions counter and the wait histogram by replica are its sums, taken when
        # scraped (`AdmissionTotals`), not written again on every turn's path.
        self.admission_reason_wait = Histogram(
            "kvgate_admission_reason_wait_seconds",
            "Time a request was held at the gate, by admission reason.",
            ["replica", "reason"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.admissions = AdmissionTotals(self.admission_reason_wait)
        r.register(self.admissions)
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
        self.relocated_turns = Counter(
            "kvgate_relocated_turns",
            "Held turns moved to a replica with nothing to do, by the replica they left (gate.relocate_held).",
            ["replica"],
            registry=r,
        )
        self.held_turns = Counter(
            "kvgate_held_turns",
            "Newcomers held for a window and then admitted, by outcome (window|no_window): whether waiting "
            "gave them one (those let in without one while others waited ahead of them are not counted).",
            ["replica", "outcome"],
            registry=r,
        )
        self.window_ends = Counter(
            "kvgate_window_ends",
            f"Ownership windows ended, by cause ({'|'.join(WindowEnd)}).",
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


class AdmissionTotals(Collector):
    """`kvgate_admissions_total` (by replica and reason) and `kvgate_admission_wait_seconds`
    (by replica), summed from `kvgate_admission_reason_wait_seconds` when scraped: every
    admission is observed there once, with its reason and wait, so these two hold nothing
    of their own and cost a turn nothing."""

    def __init__(self, by_reason: Histogram) -> None:
        self._by_reason = by_reason

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily("kvgate_admissions", "Gate admissions by replica and reason.", labels=[])
        yield HistogramMetricFamily("kvgate_admission_wait_seconds", "Time a request was held at the gate.", labels=[])

    def collect(self) -> Iterator[Metric]:
        admissions = CounterMetricFamily(
            "kvgate_admissions", "Gate admissions by replica and reason.", labels=["replica", "reason"]
        )
        buckets: dict[str, dict[str, float]] = {}  # replica -> le -> admissions waiting at most le
        sums: dict[str, float] = {}
        counts: dict[tuple[str, str], float] = {}
        created: dict[tuple[str, str], float] = {}
        for metric in self._by_reason.collect():
            for sample in metric.samples:
                replica, reason = sample.labels["replica"], sample.labels["reason"]
                if sample.name.endswith("_bucket"):
                    per_le = buckets.setdefault(replica, {})
                    per_le[sample.labels["le"]] = per_le.get(sample.labels["le"], 0.0) + sample.value
                elif sample.name.endswith("_sum"):
                    sums[replica] = sums.get(replica, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    counts[replica, reason] = sample.value
                elif sample.name.endswith("_created"):
                    created[replica, reason] = sample.value
        for (replica, reason), count in counts.items():
            admissions.add_metric([replica, reason], count, created=created.get((replica, reason)))
        yield admissions
        wait = HistogramMetricFamily(
            "kvgate_admission_wait_seconds", "Time a request was held at the gate.", labels=["replica"]
        )
        for replica, per_le in buckets.items():
            wait.add_metric([replica], list(per_le.items()), sums.get(replica, 0.0))
            first = min((at for (r, _), at in created.items() if r == replica), default=None)
            if first is not None:
                wait.samples.append(Sample(f"{wait.name}_created", {"replica": replica}, first))
        yield wait
