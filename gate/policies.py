"""Admission policies: pure functions from (gate view, readings, knobs) to a decision.

A policy is two functions (DESIGN.md sections 2-4):

- `needs_prefix_probe(view, usage, knobs) -> bool`: whether the gate must ask the
  prefix probe before deciding. The gate asks only when this says so, so the common
  path (no pressure, or a reserved session) costs one shared usage reading.
- `decide(view, usage, prefix, knobs) -> Admit | Wait | Reject`.

`usage is None` means the usage probe failed (usage unknown); `prefix is None` means
the prefix probe is unavailable (not asked, unsupported route, replica without the
probe API, or a failed probe). Invariant tested for every policy: whenever
`needs_prefix_probe` is False, `decide` gives the same answer for any `prefix`.

`POLICIES` maps `gate.policy` names to policies, so adding or comparing one is a
dict entry. Nothing here touches asyncio, clocks or I/O: the simulator can call the
same functions in virtual time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from gate.readings import PrefixReading, UsageReading
from proxy.settings import GateSettings

# Reasons (the x-kvgate-admission header and kvgate_admissions_total{reason}).
OPEN = "open"
RESERVED_SESSION = "reserved_session"
PREFIX_PROBE_UNAVAILABLE = "prefix_probe_unavailable"
RESIDENT_PREFIX = "resident_prefix"
ANONYMOUS = "anonymous"
CONTRACT_FITS = "contract_fits"
PROMPT_TOO_LONG = "prompt_too_long"


@dataclass(frozen=True, slots=True)
class GateView:
    """What the gate knows about the deciding request and its replica's sessions.

    anonymous: the request has no session id (never reserved).
    reserved: the session holds a live (unexpired) reservation on this replica.
    idle_reserved_blocks: resident blocks of *other* sessions in idle grace windows.
    """

    anonymous: bool = False
    reserved: bool = False
    idle_reserved_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Admit:
    """Forward the request now.

    reserve: the session holds (or keeps) a reservation for this request; on release
    it becomes an idle window. resident_blocks: blocks to price that reservation at
    (None keeps the previous figure).
    """

    reason: str
    reserve: bool = False
    resident_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class Wait:
    """Hold the request and decide again when woken."""

    why: str


@dataclass(frozen=True, slots=True)
class Reject:
    """Refuse the request for good (it can never be admitted on this replica)."""

    code: str
    message: str


Decision = Union[Admit, Wait, Reject]


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    needs_prefix_probe: Callable[[GateView, UsageReading | None, GateSettings], bool]
    decide: Callable[[GateView, UsageReading | None, PrefixReading | None, GateSettings], Decision]


def _keep(view: GateView, knobs: GateSettings) -> bool:
    """A session that already owns a window keeps it through any admission."""
    return knobs.retain_session and view.reserved and not view.anonymous


# ---------------------------------------------------------------- seed policy


def seed_needs_prefix_probe(view: GateView, usage: UsageReading | None, knobs: GateSettings) -> bool:
    """Only above the watermark, and only for named sessions without a reservation."""
    return (
        usage is not None
        and usage.kv_cache_usage >= knobs.high_watermark
        and not view.anonymous
        and not view.reserved
    )


def seed_decide(
    view: GateView, usage: UsageReading | None, prefix: PrefixReading | None, knobs: GateSettings
) -> Decision:
    """DESIGN.md section 2's tree.

    - usage unknown (probe failed): admit `open` (the probe error metric says why).
    - anonymous: below the watermark `anonymous`, at or above it wait; never reserved.
    - below the watermark: `open` (a session's existing window is kept and renewed).
    - at or above it: `reserved_session` if the session owns a window; else
      `prefix_probe_unavailable` if there is no prefix reading; else `resident_prefix`
      if hit_ratio >= hit_threshold; else wait.
    With retain_session, `reserved_session` and `resident_prefix` hold a reservation.
    """
    if usage is None:
        return Admit(OPEN, reserve=_keep(view, knobs))
    pressure = usage.kv_cache_usage >= knobs.high_watermark
    if view.anonymous:
        return Wait("anonymous request above the watermark") if pressure else Admit(ANONYMOUS)
    if not pressure:
        return Admit(OPEN, reserve=_keep(view, knobs))
    if view.reserved:
        return Admit(RESERVED_SESSION, reserve=knobs.retain_session)
    if prefix is None:
        return Admit(PREFIX_PROBE_UNAVAILABLE)
    if prefix.hit_ratio >= knobs.hit_threshold:
        return Admit(RESIDENT_PREFIX, reserve=knobs.retain_session, resident_blocks=prefix.total_blocks)
    return Wait("cold prefix above the watermark")


SEED = Policy("seed", seed_needs_prefix_probe, seed_decide)


# ------------------------------------------------------------ contract policy


def contract_needs_prefix_probe(view: GateView, usage: UsageReading | None, knobs: GateSettings) -> bool:
    """At any usage, for named sessions without a reservation: pricing needs the prompt.

    The watermark is exactly what this policy distrusts (idle windows hold no live
    blocks, so usage reads low while their prefixes are about to be evicted). Without
    block counts (the /metrics fallback) it falls back to the seed policy.
    """
    if usage is None or view.anonymous or view.reserved:
        return False
    if not usage.has_blocks:
        return seed_needs_prefix_probe(view, usage, knobs)
    return True


def contract_decide(
    view: GateView, usage: UsageReading | None, prefix: PrefixReading | None, knobs: GateSettings
) -> Decision:
    """DESIGN.md section 3: price a turn's uncached blocks against what is truly free.

    - usage unknown: `open`. anonymous: watermark only, as in the seed policy.
    - a session with a window: `reserved_session` at any usage (its blocks are already
      priced in the other sessions' budgets while it is idle).
    - no block counts or no prefix reading: the seed policy decides.
    - usable = num_total_blocks - headroom_blocks; total_blocks > usable: reject
      `prompt_too_long` (it could never be admitted, waiting would strand it).
    - admit `contract_fits` iff new_blocks <= num_free_blocks - idle_reserved_blocks
      - headroom_blocks, else wait. With retain_session it holds a reservation priced
      at the prompt's total blocks.
    """
    if usage is None:
        return Admit(OPEN, reserve=_keep(view, knobs))
    if view.anonymous:
        return seed_decide(view, usage, prefix, knobs)
    if view.reserved:
        return Admit(RESERVED_SESSION, reserve=knobs.retain_session)
    if not usage.has_blocks or prefix is None:
        return seed_decide(view, usage, prefix, knobs)
    assert usage.num_total_blocks is not None and usage.num_free_blocks is not None
    usable = usage.num_total_blocks - knobs.headroom_blocks
    if prefix.total_blocks > usable:
        return Reject(
            PROMPT_TOO_LONG,
            f"the prompt needs {prefix.total_blocks} KV-cache blocks but the replica has "
            f"{usage.num_total_blocks} (minus gate.headroom_blocks={knobs.headroom_blocks}); "
            "shorten the prompt or serve it from a replica with a larger KV cache",
        )
    budget = usage.num_free_blocks - view.idle_reserved_blocks - knobs.headroom_blocks
    if prefix.new_blocks <= budget:
        return Admit(CONTRACT_FITS, reserve=knobs.retain_session, resident_blocks=prefix.total_blocks)
    return Wait(f"needs {prefix.new_blocks} new blocks, {budget} free outside idle windows and headroom")


CONTRACT = Policy("contract", contract_needs_prefix_probe, contract_decide)


POLICIES: dict[str, Policy] = {p.name: p for p in (SEED, CONTRACT)}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown gate.policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}"
        ) from None
