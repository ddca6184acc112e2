"""The status page's recent history: per replica, prefix-cache hit rate and admissions by
reason over the last minutes (`GET /admin/status/history`, docs/observability.md).

`CounterHistory` is pure: it keeps the last `size` samples of cumulative counters and
answers per-interval differences. A sample maps replica name -> `ReplicaCounters`. The
invariants: samples are kept oldest first, at most `size` of them; a counter that went
down between two samples (a replica restart resets vLLM's counters) counts as a reset,
so its difference is its new value, as Prometheus' `rate()` reads it; a replica absent
from a sample has no difference for that interval (None), never a made-up zero.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

HISTORY_INTERVAL_SEC = 5.0  # one sample every 5 s ...
HISTORY_SIZE = 121  # ... for 10 minutes: 120 intervals


@dataclass(frozen=True, slots=True)
class ReplicaCounters:
    """One replica's cumulative counters at one instant (None: the replica did not report it)."""

    hits: float | None = None  # vllm:prefix_cache_hits_total, as kvgate mirrors it
    queries: float | None = None  # vllm:prefix_cache_queries_total
    admissions: Mapping[str, float] = field(default_factory=dict)  # kvgate_admissions_total by reason


def _increase(new: float | None, old: float | None) -> float | None:
    if new is None or old is None:
        return None
    return new if new < old else new - old


def hit_rate(hits: float | None, queries: float | None) -> float | None:
    """Hits over queries; None when either is unknown or nothing was queried."""
    if hits is None or not queries:
        return None
    return max(0.0, min(1.0, hits / queries))


class CounterHistory:
    def __init__(self, size: int = HISTORY_SIZE) -> None:
        if size < 2:
            raise ValueError("a history needs at least 2 samples to hold one interval")
        self._samples: deque[tuple[float, dict[str, ReplicaCounters]]] = deque(maxlen=size)

    def record(self, t: float, sample: Mapping[str, ReplicaCounters]) -> None:
        """Add the counters read at time `t` (seconds; later than every earlier sample)."""
        self._samples.append((t, dict(sample)))

    def series(self) -> dict:
        """Per interval (its end time `t`, epoch seconds): per replica its hit rate and its
        admissions by reason; the JSON `/admin/status/history` answers."""
        samples = list(self._samples)
        names = sorted({name for _, sample in samples for name in sample})
        out: dict = {"t": [t for t, _ in samples[1:]], "replicas": {}}
        for name in names:
            rates: list[float | None] = []
            reasons = sorted({r for _, s in samples if name in s for r in s[name].admissions})
            admissions: dict[str, list[float | None]] = {r: [] for r in reasons}
            for (_, before), (_, after) in zip(samples, samples[1:]):
                old, new = before.get(name), after.get(name)
                if old is None or new is None:
                    rates.append(None)
                    for reason in reasons:
                        admissions[reason].append(None)
                    continue
                rates.append(hit_rate(_increase(new.hits, old.hits), _increase(new.queries, old.queries)))
                for reason in reasons:
                    admissions[reason].append(
                        _increase(new.admissions.get(reason, 0.0), old.admissions.get(reason, 0.0))
                    )
            out["replicas"][name] = {"hit_rate": rates, "admissions": admissions}
        return out

    def recent_hit_rate(self, name: str, intervals: int = 12) -> float | None:
        """The replica's hit rate over its last `intervals` intervals (default: a minute)."""
        samples = [s for _, s in list(self._samples)[-(intervals + 1) :] if name in s]
        if len(samples) < 2:
            return None
        hits = queries = 0.0
        for before, after in zip(samples, samples[1:]):
            h = _increase(after[name].hits, before[name].hits)
            q = _increase(after[name].queries, before[name].queries)
            if h is None or q is None:
                continue
            hits, queries = hits + h, queries + q
        return hit_rate(hits, queries)
