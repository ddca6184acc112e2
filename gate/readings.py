"""What the gate reads from a replica, and how raw probe answers become readings.

Two readings feed every admission decision:

- `UsageReading`: the cheap probe, `GET /v1/kvgate/kv` (docs/reference.md), or
  vLLM's `vllm:kv_cache_usage_perc` gauge from `/metrics` on replicas without the
  probe endpoints (then the block counts are unknown).
- `PrefixReading`: the prefix probe, `POST /v1/kvgate/prefix`, for one request body.

The parsers here are pure: they take the decoded JSON (or the `/metrics` text) and
return a reading, or raise `ProbeAnswerError` naming what was wrong. A reading that
exists is valid: usage in [0, 1], block counts non-negative and consistent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class ProbeAnswerError(ValueError):
    """A replica answered a probe with something that is not a valid reading."""


@dataclass(frozen=True, slots=True)
class UsageReading:
    """A replica's KV-cache usage.

    Invariants: 0 <= kv_cache_usage <= 1. The block counts are either all known (probe
    API) or all None (`/metrics` fallback); when known, num_free_blocks <= num_total_blocks.
    `num_total_blocks` is the usable block count (vLLM's pool without its null block).
    """

    kv_cache_usage: float
    num_total_blocks: int | None = None
    num_free_blocks: int | None = None
    block_size: int | None = None
    source: str = "kv"  # "kv" (probe API) | "metrics" (vllm:kv_cache_usage_perc)
    # Measured by the replica (optional fields of the probe API; None: no measurement yet).
    # prefill_tokens_per_sec: prompt tokens the engine computes per second of prefill;
    # decode_step_sec: seconds per decode step (one output token of every running request);
    # num_running / num_waiting: the engine's running and waiting requests;
    # prefill_share: the share of the engine's recent time spent prefilling, in [0, 1].
    prefill_tokens_per_sec: float | None = None
    decode_step_sec: float | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    prefill_share: float | None = None

    @property
    def has_blocks(self) -> bool:
        return self.num_total_blocks is not None and self.num_free_blocks is not None


@dataclass(frozen=True, slots=True)
class PrefixReading:
    """How much of one prompt is resident in a replica's prefix cache.

    Invariants: 0 <= hit_blocks <= total_blocks; 0 <= hit_ratio <= 1.
    """

    total_blocks: int
    hit_blocks: int
    hit_ratio: float
    total_tokens: int = 0

    @property
    def new_blocks(self) -> int:
        """Blocks this prompt must allocate: its full blocks that are not resident."""
        return self.total_blocks - self.hit_blocks


def _ratio(doc: dict[str, object], key: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProbeAnswerError(f"field {key!r} must be a number, got {value!r:.80}")
    value = float(value)
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        raise ProbeAnswerError(f"field {key!r} must lie in [0, 1], got {value}")
    return value


def _count(doc: dict[str, object], key: str, required: bool) -> int | None:
    value = doc.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProbeAnswerError(f"field {key!r} must be a non-negative integer, got {value!r:.80}")
    return value


def parse_kv_answer(doc: object) -> UsageReading:
    """Turn the JSON of `GET /v1/kvgate/kv` into a UsageReading, or raise ProbeAnswerError."""
    if not isinstance(doc, dict):
        raise ProbeAnswerError(f"the kv probe answer must be a JSON object, got {type(doc).__name__}")
    usage = _ratio(doc, "kv_cache_usage")
    total = _count(doc, "num_total_blocks", required=False)
    free = _count(doc, "num_free_blocks", required=False)
    block_size = _count(doc, "block_size", required=False)
    if (total is None) != (free is None):
        raise ProbeAnswerError("num_total_blocks and num_free_blocks must come together")
    if total is not None and free is not None and free > total:
        raise ProbeAnswerError(f"num_free_blocks {free} exceeds num_total_blocks {total}")
    return UsageReading(
        usage,
        total,
        free,
        block_size,
        "kv",
        _positive(doc, "prefill_tokens_per_sec"),
        _positive(doc, "decode_step_sec"),
        _count(doc, "num_running", required=False),
        _count(doc, "num_waiting", required=False),
        _ratio(doc, "prefill_share") if doc.get("prefill_share") is not None else None,
    )


def _positive(doc: dict[str, object], key: str) -> float | None:
    """An optional measurement: a positive finite number, or None (absent, null: not measured yet)."""
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ProbeAnswerError(f"field {key!r} must be a positive number or null, got {value!r:.80}")
    return float(value)


def parse_prefix_answer(doc: object) -> PrefixReading:
    """Turn the JSON of `POST /v1/kvgate/prefix` into a PrefixReading, or raise ProbeAnswerError."""
    if not isinstance(doc, dict):
        raise ProbeAnswerError(f"the prefix probe answer must be a JSON object, got {type(doc).__name__}")
    total = _count(doc, "total_blocks", required=True)
    hit = _count(doc, "hit_blocks", required=True)
    assert total is not None and hit is not None
    if hit > total:
        raise ProbeAnswerError(f"hit_blocks {hit} exceeds total_blocks {total}")
    ratio = _ratio(doc, "hit_ratio")
    tokens = _count(doc, "total_tokens", required=False) or 0
    return PrefixReading(total, hit, ratio, tokens)


USAGE_GAUGE = "vllm:kv_cache_usage_perc"


def parse_metrics_usage(text: str) -> UsageReading:
    """Read `vllm:kv_cache_usage_perc` from Prometheus text; with several engines, the highest.

    vLLM reports the gauge as a fraction in [0, 1] despite its name. A line scan, not a
    full exposition parser: vLLM's /metrics is large and this runs on the probe path.
    """
    best: float | None = None
    for line in text.splitlines():
        if not line.startswith(USAGE_GAUGE):
            continue
        rest = line[len(USAGE_GAUGE) :]
        if rest and rest[0] not in "{ \t":
            continue  # another metric whose name merely starts the same
        if "}" in rest:
            rest = rest[rest.rindex("}") + 1 :]
        parts = rest.split()
        if not parts:
            raise ProbeAnswerError(f"{USAGE_GAUGE} line has no value: {line[:120]!r}")
        try:
            value = float(parts[0])
        except ValueError:
            raise ProbeAnswerError(f"{USAGE_GAUGE} value is not a number: {line[:120]!r}") from None
        if not (0.0 <= value <= 1.0):
            raise ProbeAnswerError(f"{USAGE_GAUGE} must lie in [0, 1], got {value}")
        best = value if best is None else max(best, value)
    if best is None:
        raise ProbeAnswerError(f"/metrics has no {USAGE_GAUGE} sample")
    return UsageReading(best, source="metrics")
