"""Reading the replicas' Prometheus counters that the benchmark reports.

The hit rate of a run is the delta of `vllm:prefix_cache_hits_total` over the delta of
`vllm:prefix_cache_queries_total` (both in tokens), summed over replicas, between a
snapshot before and one after the run. Engine preemptions come from vLLM's
`vllm:num_preemptions_total`. Counters of the simulated replica that vLLM lacks live
under the `kvgate_sim:` prefix; every one of them (`*_total` samples; gauges are not
deltas) is kept, so the report shows whatever the simulator exports (recomputed
tokens, computed prefill tokens, evictions).

Parsing is a pure function of the exposition text; only `fetch_counters` does I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
PREEMPTIONS = "vllm:num_preemptions_total"
SIM_PREFIX = "kvgate_sim:"
CPU = "process_cpu_seconds_total"  # prometheus-client's process collector: the serving process's CPU


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum every sample of the exposition text by metric name, across label sets.

    Comments, `_created` samples and unparsable lines are skipped: the benchmark only
    needs totals, and a malformed line must not abort a run that took minutes.
    """
    totals: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            _, _, value_part = rest.rpartition("}")
        else:
            name, _, value_part = line.partition(" ")
        if name.endswith("_created"):
            continue
        parts = value_part.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        totals[name] = totals.get(name, 0.0) + value
    return totals


@dataclass(frozen=True)
class Counters:
    """The counters of one or more replicas at one instant."""

    queries: float = 0.0
    hits: float = 0.0
    preemptions: float = 0.0
    sim: dict[str, float] = field(default_factory=dict)  # kvgate_sim:*_total counters by name
    cpu_seconds: float | None = None  # `process_cpu_seconds_total`; None when a replica does not export it

    @classmethod
    def from_metrics(cls, totals: dict[str, float]) -> Counters:
        sim = {k: v for k, v in totals.items() if k.startswith(SIM_PREFIX) and k.endswith("_total")}
        return cls(totals.get(QUERIES, 0.0), totals.get(HITS, 0.0), totals.get(PREEMPTIONS, 0.0), sim, totals.get(CPU))

    def __add__(self, other: Counters) -> Counters:
        sim = dict(self.sim)
        for k, v in other.sim.items():
            sim[k] = sim.get(k, 0.0) + v
        return Counters(
            self.queries + other.queries,
            self.hits + other.hits,
            self.preemptions + other.preemptions,
            sim,
            _add(self.cpu_seconds, other.cpu_seconds),
        )

    def minus(self, earlier: Counters) -> Counters:
        """The delta since `earlier` (a counter missing earlier counts from 0; the CPU is None
        unless both snapshots have it)."""
        sim = {k: v - earlier.sim.get(k, 0.0) for k, v in self.sim.items()}
        cpu = None
        if self.cpu_seconds is not None and earlier.cpu_seconds is not None:
            cpu = self.cpu_seconds - earlier.cpu_seconds
        return Counters(
            self.queries - earlier.queries,
            self.hits - earlier.hits,
            self.preemptions - earlier.preemptions,
            sim,
            cpu,
        )

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _add(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def sum_counters(items) -> Counters:
    items = list(items)
    if not items:
        return Counters()
    total = items[0]
    for item in items[1:]:
        total = total + item
    return total


async def fetch_counters(session, url: str, timeout_s: float = 5.0) -> Counters:
    """GET `url`/metrics and extract the counters; raises with the URL on failure."""
    import aiohttp

    try:
        async with session.get(url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise RuntimeError(f"GET {url}/metrics answered {resp.status}: {text[:200]}")
    except aiohttp.ClientError as exc:
        raise RuntimeError(f"GET {url}/metrics failed: {exc!r}; is the replica up?") from exc
    return Counters.from_metrics(parse_prometheus(text))


PROBE_SECONDS = "kvgate_probe_seconds"


def probe_totals(text: str) -> dict[str, dict[str, float]]:
    """Per probe kind (`probe` label: kv, prefix, metrics): how many probes kvgate made and
    the seconds they took, summed over replicas, from kvgate's own /metrics text."""
    totals: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        for suffix, field_name in (("_count{", "count"), ("_sum{", "seconds")):
            if not line.startswith(PROBE_SECONDS + suffix):
                continue
            labels, _, value = line[len(PROBE_SECONDS + suffix) :].rpartition("}")
            kind = next((p.split("=", 1)[1].strip('"') for p in labels.split(",") if p.startswith("probe=")), "?")
            try:
                amount = float(value.split()[0])
            except (ValueError, IndexError):
                continue
            entry = totals.setdefault(kind, {"count": 0.0, "seconds": 0.0})
            entry[field_name] += amount
    return totals


async def fetch_probe_totals(http, kvgate_url: str) -> dict[str, dict[str, float]]:
    """`probe_totals` of a running kvgate; empty if its /metrics cannot be read."""
    import aiohttp

    try:
        async with http.get(kvgate_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return probe_totals(await resp.text()) if resp.status == 200 else {}
    except (TimeoutError, aiohttp.ClientError):
        return {}
