"""`kvgate_admissions_total` and `kvgate_admission_wait_seconds` are summed, when scraped,
from the one histogram every admission is observed in (by replica and reason): they must
read as a counter and a histogram written at every admission would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.gate.metrics import WAIT_BUCKETS, GateMetrics

ADMISSIONS = [("r0", "window_fits", 0.0), ("r0", "holds_window", 0.002), ("r0", "window_fits", 0.7)]
ADMISSIONS += [("r1", "open", 0.0), ("r1", "window_fits", 31.0)]


def scraped() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    metrics = GateMetrics(registry)
    for replica, reason, wait in ADMISSIONS:
        metrics.admission_reason_wait.labels(replica, reason).observe(wait)
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_admissions_total_counts_every_admission_by_replica_and_reason():
    samples = scraped()
    counted = {labels: value for (name, labels), value in samples.items() if name == "kvgate_admissions_total"}
    assert counted == {
        (("reason", "holds_window"), ("replica", "r0")): 1.0,
        (("reason", "window_fits"), ("replica", "r0")): 2.0,
        (("reason", "open"), ("replica", "r1")): 1.0,
        (("reason", "window_fits"), ("replica", "r1")): 1.0,
    }
    assert all(
        (("reason", reason), ("replica", replica))
        in {labels for (name, labels) in samples if name == "kvgate_admissions_created"}
        for replica, reason, _ in ADMISSIONS
    )


def test_the_wait_histogram_by_replica_holds_every_admissions_wait():
    samples = scraped()
    for replica in ("r0", "r1"):
        waits = [wait for r, _, wait in ADMISSIONS if r == replica]
        for bound in (*WAIT_BUCKETS, float("inf")):
            le = "+Inf" if bound == float("inf") else str(float(bound))
            name = ("kvgate_admission_wait_seconds_bucket", (("le", le), ("replica", replica)))
            assert samples[name] == sum(wait <= bound for wait in waits), (replica, le)
        assert samples["kvgate_admission_wait_seconds_count", (("replica", replica),)] == len(waits)
        assert samples["kvgate_admission_wait_seconds_sum", (("replica", replica),)] == sum(waits)
        assert ("kvgate_admission_wait_seconds_created", (("replica", replica),)) in samples
