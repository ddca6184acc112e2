"""What `GET /admin/status` answers: the status page's and `kvgate top`'s view of this kvgate.

`status_snapshot(sources, query)` builds it from the live objects (docs/reference.md,
Admin API). It is the paged, aggregated sibling of `/admin/state`: its cost follows the
replicas, the waiters and one page of sessions, not the number of sessions (a search
walks the session keys once), so a page polling it every second stays cheap with
10,000 sessions. Per replica: its health, its owner record, its gate's counts, its KV
usage beside the blocks the gate's books expect resident, and its recent hit rate.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from kvgate.proxy.access_log import session_hash
from kvgate.proxy.errors import RequestRejected

VIEWS = ("windows", "waiting", "all")  # which sessions the page lists
MAX_LIMIT = 200  # rows of one page
MAX_WAITERS = 100  # waiters listed (the longest waits); the total is always given
MAX_QUERY = 600  # characters of a search: a session id is at most 512 bytes, else its 64-digit hash
# Usage counts shown as they come: pinned or CPU-tier blocks (and pinned sessions), where the
# reading has them (`num_pinned_blocks`, `num_cpu_blocks`, `num_cpu_cached_blocks`, ...).
_EXTRA_USAGE_WORDS = ("pinned", "cpu")


@dataclass(frozen=True, slots=True)
class StatusQuery:
    """Which sessions to list: a view, a search (an id, a piece of one, or the hash the
    access log shows), and a page."""

    view: str = "windows"
    q: str = ""
    offset: int = 0
    limit: int = 50


@dataclass(frozen=True, slots=True)
class StatusSources:
    """The live objects a snapshot reads (never changes)."""

    role: str
    replicas: list  # balancer Replica objects, registry order
    gates: Mapping[str, Any]  # replica name -> gate.gate.Gate
    ownership: Mapping[str, Any]  # replica name -> gate.ownership.Ownership
    mirrored: Callable[[str], dict[str, float]]  # replica name -> its mirrored /metrics values
    recent_hit_rate: Callable[[str], float | None]  # replica name -> hit rate over the last minute
    tracked_sessions: int
    now: float  # epoch seconds


def parse_status_query(query: str) -> StatusQuery:
    """The query string of `GET /admin/status`; RequestRejected (400) naming a bad parameter."""
    params = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    view = params.get("view", "windows")
    if view not in VIEWS:
        raise RequestRejected(400, f"view must be one of {', '.join(VIEWS)}, not {view!r}", "invalid_query")
    q = params.get("q", "").strip()
    if len(q) > MAX_QUERY:
        raise RequestRejected(400, f"q is longer than {MAX_QUERY} characters", "invalid_query")
    return StatusQuery(
        view, q, _int_param(params, "offset", 0, 0, 10**9), _int_param(params, "limit", 50, 1, MAX_LIMIT)
    )


def _int_param(params: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise RequestRejected(400, f"{name} must be a whole number from {low} to {high}", "invalid_query")
    return int(raw)


def status_snapshot(sources: StatusSources, query: StatusQuery) -> dict[str, Any]:
    waiters = _waiters(sources.gates)
    return {
        "time": sources.now,
        "role": sources.role,
        "tracked_sessions": sources.tracked_sessions,
        "replicas": [_replica(sources, r) for r in sources.replicas],
        "waiters": {"total": len(waiters), "items": waiters[:MAX_WAITERS]},
        "sessions": _sessions(sources.gates, waiters, query),
    }


def _replica(sources: StatusSources, replica) -> dict[str, Any]:
    gate = sources.gates.get(replica.name)
    overview = gate.overview() if gate is not None else None
    usage = overview.pop("usage") if overview is not None else None
    owner = sources.ownership.get(replica.name)
    mirrored = sources.mirrored(replica.name)
    return {
        **replica.describe(),
        "owner": dataclasses.asdict(owner) if owner is not None else None,
        "gate": overview,
        "usage": usage_summary(usage),
        "running": mirrored.get("vllm:num_requests_running"),
        "waiting": mirrored.get("vllm:num_requests_waiting"),
        "hit_rate_1m": sources.recent_hit_rate(replica.name),
    }


def usage_summary(reading) -> dict[str, Any] | None:
    """A usage reading (gate.readings.UsageReading) as the page shows it: usage, block counts
    (used = total - free) and any pinned or CPU-tier figures the replica reports."""
    if reading is None:
        return None
    out: dict[str, Any] = {
        "kv_cache_usage": reading.kv_cache_usage,
        "num_total_blocks": reading.num_total_blocks,
        "num_free_blocks": reading.num_free_blocks,
        "used_blocks": (reading.num_total_blocks - reading.num_free_blocks) if reading.has_blocks else None,
        "block_size": reading.block_size,
        "source": reading.source,
    }
    for f in dataclasses.fields(reading):
        value = getattr(reading, f.name)
        if value is not None and f.name.startswith("num_") and any(word in f.name for word in _EXTRA_USAGE_WORDS):
            out[f.name] = value  # only what the replica reports: a null is a replica without the tier
    return out


def _waiters(gates: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every waiter of every gate, longest wait first."""
    rows = [
        {**w, "replica": name, "log_id": session_hash(w["session"]) if w["session"] is not None else None}
        for name, gate in gates.items()
        for w in gate.waiters()
    ]
    rows.sort(key=lambda w: w["waited_sec"], reverse=True)
    return rows


def _sessions(gates: Mapping[str, Any], waiters: list[dict[str, Any]], query: StatusQuery) -> dict[str, Any]:
    """One page of the view's (or the search's) sessions, as (replica, key) rows."""
    if query.q:
        matches = [(name, key) for name, gate in gates.items() for key in gate.session_keys() if _matches(key, query.q)]
        total, page = len(matches), matches[query.offset : query.offset + query.limit]
    elif query.view == "waiting":
        named = list(dict.fromkeys((w["replica"], w["session"]) for w in waiters if w["session"] is not None))
        total, page = len(named), named[query.offset : query.offset + query.limit]
    else:
        windows_only = query.view == "windows"
        total = sum(_count(gate, windows_only) for gate in gates.values())
        keys: Iterator[tuple[str, str]] = itertools.chain.from_iterable(
            ((name, key) for key in gate.session_keys(windows_only)) for name, gate in gates.items()
        )
        page = list(itertools.islice(keys, query.offset, query.offset + query.limit))
    items = []
    for name, key in page:
        state = gates[name].session_state(key)
        if state is not None:
            items.append({"session": key, "log_id": _log_id(key), "replica": name, **state})
    return {
        "view": query.view,
        "q": query.q,
        "offset": query.offset,
        "limit": query.limit,
        "total": total,
        "items": items,
    }


def _count(gate, windows_only: bool) -> int:
    overview = gate.overview()
    return overview["windows_in_flight"] + overview["windows_idle"] if windows_only else overview["sessions"]


@functools.lru_cache(maxsize=65536)
def _log_id(key: str) -> str:
    """The access log's `session` field for this key (cached: a search hashes every key)."""
    return session_hash(key)


def _matches(key: str, q: str) -> bool:
    """A search matches a session whose id contains it, or whose log hash starts with it."""
    return q in key or _log_id(key).startswith(q.lower())
