"""The replicas' own counters, mirrored into kvgate's `/metrics` under the replica label.

An operator who scrapes only kvgate still sees each replica's prefix-cache hit rate
as vLLM counts it: every `balancer.health.interval_sec`, in the health checker's loop, kvgate reads each
replica's `GET /metrics` and re-exports the few series the dashboard and the alert
rules need (`MIRRORED`), summed over the replica's engines and models:

| kvgate series (label replica) | vLLM series | type |
|---|---|---|
| `kvgate_replica_prefix_cache_queries_total` | `vllm:prefix_cache_queries_total` | counter (tokens) |
| `kvgate_replica_prefix_cache_hits_total` | `vllm:prefix_cache_hits_total` | counter (tokens) |
| `kvgate_replica_num_preemptions_total` | `vllm:num_preemptions_total` | counter |
| `kvgate_replica_num_requests_running` | `vllm:num_requests_running` | gauge |
| `kvgate_replica_num_requests_waiting` | `vllm:num_requests_waiting` | gauge |

Counters are exported as the replica reports them, so a replica restart is a
counter reset, which Prometheus's `rate()` handles. After a failed read a replica's
counters keep their last value (counters must not vanish and come back) while its
gauges are dropped (a stale "0 running" would mislead the starvation alert). Each
read is timed in `kvgate_probe_seconds{probe="metrics"}`; a failed one counts in
`kvgate_probe_errors_total{probe="metrics"}`.

The parser is pure (`read_mirrored`); `ReplicaMetricsScraper.read_all` is the I/O.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client import Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from kvgate.balancer.registry import ReplicaRegistry


@dataclass(frozen=True)
class Mirrored:
    """One replica series kvgate re-exports: the vLLM sample name and kvgate's family name."""

    source: str  # the sample name on the replica's /metrics
    name: str  # kvgate's family name (a counter's samples get `_total` appended)
    kind: str  # "counter" | "gauge"
    documentation: str


MIRRORED = (
    Mirrored(
        "vllm:prefix_cache_queries_total",
        "kvgate_replica_prefix_cache_queries",
        "counter",
        "The replica's vllm:prefix_cache_queries_total (prompt tokens looked up in its prefix cache).",
    ),
    Mirrored(
        "vllm:prefix_cache_hits_total",
        "kvgate_replica_prefix_cache_hits",
        "counter",
        "The replica's vllm:prefix_cache_hits_total (prompt tokens found in its prefix cache).",
    ),
    Mirrored(
        "vllm:num_preemptions_total",
        "kvgate_replica_num_preemptions",
        "counter",
        "The replica's vllm:num_preemptions_total (running requests its scheduler preempted).",
    ),
    Mirrored(
        "vllm:num_requests_running",
        "kvgate_replica_num_requests_running",
        "gauge",
        "The replica's vllm:num_requests_running at kvgate's last read.",
    ),
    Mirrored(
        "vllm:num_requests_waiting",
        "kvgate_replica_num_requests_waiting",
        "gauge",
        "The replica's vllm:num_requests_waiting at kvgate's last read.",
    ),
)
_BY_SOURCE = {m.source: m for m in MIRRORED}
_SOURCES = tuple(_BY_SOURCE)


def read_mirrored(text: str) -> dict[str, float]:
    """The mirrored series' values in a replica's exposition text, by source name.

    Samples of one series with different labels (engines, models) are summed; a series
    the replica does not export is absent from the result (text with none of them, an
    error page say, gives {}); NaN samples are skipped. Raises ValueError on a mirrored
    sample line that does not parse.
    """
    values: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(_mirrored_lines(text)) + "\n"):
        for sample in family.samples:
            if sample.name in _BY_SOURCE and not math.isnan(sample.value):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def _mirrored_lines(text: str):
    """The sample lines of the mirrored series. vLLM's /metrics is tens of KB of
    histograms and this runs on the proxy's event loop, so only these lines are parsed
    (a prefix test per line first: C speed)."""
    for line in text.splitlines():
        if line.startswith(_SOURCES) and line.split("{", 1)[0].split(None, 1)[0] in _BY_SOURCE:
            yield line


class ReplicaMetricsScraper:
    """Reads every registered replica's /metrics each round; a prometheus-client collector.

    Each read is timed in `probe_seconds` and a failed one counted in `probe_errors`
    (the gate's `kvgate_probe_seconds` and `kvgate_probe_errors_total` families, label
    probe="metrics"). Register it on the proxy's registry (`registry.register(scraper)`) and hand
    `read_all` to the health checker (`HealthChecker.add_round`), whose loop runs it
    every `interval_sec` over its own ClientSession (timeout `timeout_sec`).
    """

    def __init__(self, registry: ReplicaRegistry, probe_seconds: Histogram, probe_errors: Counter) -> None:
        self._registry = registry
        self._values: dict[str, dict[str, float]] = {}  # replica name -> source name -> value
        self._seconds = probe_seconds
        self._errors = probe_errors

    # ---- prometheus-client collector ----------------------------------------------

    def describe(self):
        return [self._family(m) for m in MIRRORED]

    def collect(self):
        for mirrored in MIRRORED:
            family = self._family(mirrored)
            for replica, values in sorted(self._values.items()):
                value = values.get(mirrored.source)
                if value is not None:
                    family.add_metric([replica], value)
            yield family

    @staticmethod
    def _family(mirrored: Mirrored):
        cls = CounterMetricFamily if mirrored.kind == "counter" else GaugeMetricFamily
        return cls(mirrored.name, mirrored.documentation, labels=["replica"])

    def values(self, name: str) -> dict[str, float]:
        """Replica `name`'s mirrored values at the last read, by source name (a copy; {}: none yet)."""
        return dict(self._values.get(name, {}))

    # ---- one round (run by the health checker's loop) --------------------------------

    async def read_all(self, session: aiohttp.ClientSession) -> None:
        """One round over the replicas registered now; forgets removed replicas."""
        replicas = self._registry.all()
        names = {r.name for r in replicas}
        for gone in set(self._values) - names:
            del self._values[gone]
        await asyncio.gather(*(self._read(session, r.name, r.url) for r in replicas))

    async def _read(self, session: aiohttp.ClientSession, name: str, url: str) -> None:
        started = time.perf_counter()
        try:
            async with session.get(f"{url}/metrics") as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise ValueError(f"answered HTTP {resp.status}")
            values = read_mirrored(text)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            self._errors.labels(name, "metrics").inc()
            previous = self._values.get(name, {})
            self._values[name] = {k: v for k, v in previous.items() if _BY_SOURCE[k].kind == "counter"}
            return
        self._seconds.labels(name, "metrics").observe(time.perf_counter() - started)
        self._values[name] = values
