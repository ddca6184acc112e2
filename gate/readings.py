"""What the gate reads from a replica, and how raw probe answers become readings.

Two readings feed every admission decision:

- `UsageReading`: the cheap probe's `KvAnswer` (`kvgate.wire.probe_api`, docs/reference.md),
  or vLLM's `vllm:kv_cache_usage_perc` gauge from `/metrics` on replicas without the
  probe endpoints (then the block counts are unknown).
- `PrefixReading`: the prefix probe's `PrefixAnswer`, for one request body.

The parsers here are pure: they take the decoded JSON (or the `/metrics` text) and
return a reading, or raise `ProbeAnswerError` naming what was wrong (the answers are
validated by `kvgate.wire.probe_api`). A reading that exists is valid: usage in [0, 1],
block counts non-negative and consistent.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.wire.probe_api import KvAnswer, PrefixAnswer, ProbeAnswerError


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
    # prefill_share: the share of the engine's recent time spent prefilling, in [0, 1];
    # busy_share: the share of its recent wall time spent in scheduler steps, in [0, 1].
    prefill_tokens_per_sec: float | None = None
    decode_step_sec: float | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    prefill_share: float | None = None
    # The server's figures (None when it does not give them): the longest prompt it
    # serves, and the most bytes of text one token of its vocabulary stands for.
    max_model_len: int | None = None
    max_token_bytes: int | None = None
    busy_share: float | None = None
    # The server's `--scheduling-policy` ("fcfs" | "priority"; None: not said).
    scheduling_policy: str | None = None
    # KV pins (`kvgate.wire.kv_pins`; None: the server keeps none): blocks pins hold (never
    # free, so outside `num_free_blocks`) and the sessions holding one.
    num_pinned_blocks: int | None = None
    num_pinned_sessions: int | None = None
    # The CPU tier (vLLM's KV offloading; None: the server has none): its capacity in
    # blocks and the seconds to load one block back into GPU memory.
    num_cpu_blocks: int | None = None
    cpu_load_sec_per_block: float | None = None

    @property
    def keeps_pins(self) -> bool:
        """The replica keeps KV pins: a turn forwarded with one keeps its window resident."""
        return self.num_pinned_sessions is not None

    @property
    def tier_holds_evictions(self) -> bool:
        """The replica's CPU tier still holds what its GPU evicts: vLLM stores every computed
        block to the tier (write-through) and evicts the tier's least recently used, so a tier
        at least as large as the GPU cache holds the blocks the GPU evicts (the GPU's least
        recently used are among the tier's most recent)."""
        cpu_blocks = self.num_cpu_blocks or 0
        return bool(self.cpu_load_sec_per_block and cpu_blocks) and cpu_blocks >= (self.num_total_blocks or 0)

    @property
    def schedules_by_priority(self) -> bool:
        """The replica orders requests by their `priority` field (vLLM's priority scheduling)."""
        return self.scheduling_policy == "priority"

    @property
    def has_blocks(self) -> bool:
        return self.num_total_blocks is not None and self.num_free_blocks is not None


@dataclass(frozen=True, slots=True)
class PrefixReading:
    """How much of one prompt is resident in a replica's prefix cache.

    Invariants: 0 <= hit_blocks <= total_blocks; 0 <= hit_ratio <= 1;
    hit_blocks + hit_blocks_cpu <= total_blocks. `hit_blocks_cpu`: the blocks right after
    the GPU hit that the replica's CPU tier holds (0 without one): a load, not a prefill.
    """

    total_blocks: int
    hit_blocks: int
    hit_ratio: float
    total_tokens: int = 0
    hit_blocks_cpu: int = 0

    @property
    def new_blocks(self) -> int:
        """Blocks this prompt must allocate: its full blocks that are not resident."""
        return self.total_blocks - self.hit_blocks


def usage_reading(answer: KvAnswer) -> UsageReading:
    """The reading a kv probe answer gives (its whole-server figures)."""
    return UsageReading(
        answer.kv_cache_usage,
        answer.num_total_blocks,
        answer.num_free_blocks,
        answer.block_size,
        "kv",
        answer.prefill_tokens_per_sec,
        answer.decode_step_sec,
        answer.num_running,
        answer.num_waiting,
        answer.prefill_share,
        answer.max_model_len,
        answer.max_token_bytes,
        answer.busy_share,
        answer.scheduling_policy,
        answer.num_pinned_blocks,
        answer.num_pinned_sessions,
        answer.num_cpu_blocks,
        answer.cpu_load_sec_per_block,
    )


def prefix_reading(answer: PrefixAnswer) -> PrefixReading:
    """The reading a prefix probe answer gives (the whole server's: its engine with the fewest hits)."""
    return PrefixReading(
        answer.total_blocks, answer.hit_blocks, answer.hit_ratio, answer.total_tokens or 0, answer.hit_blocks_cpu or 0
    )


def parse_kv_answer(doc: object) -> UsageReading:
    """Turn the JSON of the kv probe into a UsageReading, or raise ProbeAnswerError."""
    return usage_reading(KvAnswer.parse(doc))


def parse_prefix_answer(doc: object) -> PrefixReading:
    """Turn the JSON of the prefix probe into a PrefixReading, or raise ProbeAnswerError."""
    return prefix_reading(PrefixAnswer.parse(doc))


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
