"""Helpers of the gate's tests: a fake clock, a fake probe, settings, stepping the loop,
reading metrics, and the leak check every gate test ends with. Fixtures: conftest.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvgate.gate.gate import Gate
from kvgate.gate.metrics import GateMetrics
from kvgate.gate.policies.registry import Policy
from kvgate.gate.policies.views import GateFacts
from kvgate.gate.policies.vocabulary import ProbeFirst
from kvgate.gate.probe import ReplicaProbe
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.settings import GateSettings, ProbeSettings

COLD = PrefixReading(total_blocks=10, hit_blocks=0, hit_ratio=0.0)
# FakeProbe's `measured` fields of an engine on which the work-conserving rule holds what
# the windows' books do not fit: its prefill throughput is measured, so every hold is
# priced (an unmeasured engine admits a turn that pushes no idle window out:
# `unpriced_admission`), and its decode step is not, so holding costs nothing.
HOLDING_PAYS = {"prefill_tokens_per_sec": 1600.0}
CLEAN = {"leases": 0, "windows": 0, "waiters": 0, "attempts": 0, "sessions": 0}


class FakeClock:
    """The gate's injected clock; tests move it with `advance` instead of sleeping."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class FakeProbe:
    """A probe whose answers the test sets; prefix readings are keyed by body["id"].

    A body id without a reading set is cold (no hit); prompt routes only (chat,
    completion, messages, responses), as the real probe. A body id in `unavailable`
    gets no reading, as when the replica cannot render the body.

    `hold` (an asyncio.Event), when set to an unset event, makes usage() block until
    the test sets it, to catch an attempt in the middle of a probe. `measured` adds
    UsageReading fields (prefill_tokens_per_sec, decode_step_sec, the CPU tier's, ...).
    """

    def __init__(
        self,
        usage: float | None = 0.1,
        total: int | None = None,
        free: int | None = None,
        block_size: int | None = None,
        max_model_len: int | None = None,
        max_token_bytes: int | None = None,
        scheduling_policy: str | None = None,
        **measured: Any,
    ) -> None:
        self.measured = measured
        self.usage_value = usage
        self.scheduling_policy = scheduling_policy
        self.max_model_len = max_model_len
        self.max_token_bytes = max_token_bytes
        self.total = total
        self.free = free
        self.block_size = block_size
        self.prefixes: dict[str, PrefixReading] = {}
        self.usage_calls = 0
        self.newer_than: list[float | None] = []
        self.prefix_calls: list[str] = []
        self.unavailable: set[str] = set()
        self.hold: asyncio.Event | None = None

    def ready_usage(self) -> UsageReading | None:
        """The reading at once (the gate's calm path), counted as a reading; None while
        `hold` is set (a caller must wait) or when usage is unknown."""
        if self.hold is not None:
            return None
        self.usage_calls += 1
        self.newer_than.append(None)
        return self._reading()

    async def usage(self, newer_than: float | None = None) -> UsageReading | None:
        self.usage_calls += 1
        self.newer_than.append(newer_than)
        if self.hold is not None:
            await self.hold.wait()
        return self._reading()

    def _reading(self) -> UsageReading | None:
        if self.usage_value is None:
            return None
        return UsageReading(
            self.usage_value,
            self.total,
            self.free,
            self.block_size,
            max_model_len=self.max_model_len,
            max_token_bytes=self.max_token_bytes,
            scheduling_policy=self.scheduling_policy,
            **self.measured,
        )

    async def prefix(self, route_kind: str, body: dict[str, Any]) -> PrefixReading | None:
        self.prefix_calls.append(body.get("id", ""))
        if route_kind not in ("chat", "completion", "messages", "responses"):
            return None
        if body.get("id", "") in self.unavailable:
            return None
        return self.prefixes.get(body.get("id", ""), COLD)

    def set_prefix(self, body_id: str, total: int, hit: int, tokens: int = 0, hit_cpu: int = 0) -> None:
        self.prefixes[body_id] = PrefixReading(total, hit, hit / total if total else 0.0, tokens, hit_cpu)


def body(session: str, content: str = "hi", **fields: Any) -> dict[str, Any]:
    """A chat request body of `session`: its `id` keys FakeProbe's prefix readings and the
    fake replica's; `fields` add or replace top-level keys (max_tokens, model, ...)."""
    return {"id": session, "messages": [{"role": "user", "content": content}], **fields}


def settings(**overrides: Any) -> GateSettings:
    """GateSettings with test-friendly defaults: the default policy (tests of the watermark
    policy ask for it by name), long grace, a 60 s poll (a waiter re-decides when the gate
    wakes it, or when a test moves the fake clock past its poll). Quiet expiry is off
    (its floor is the grace: a window lives `idle_grace_sec`) unless a test sets
    `quiet_floor_sec`, no session is late before the grace unless a test sets
    `late_floor_sec`, and the cap on a held turn's wait unless a test sets
    `wait_cap_factor` (its default is on): the tests of the grace rules keep their
    hand-worked clocks."""
    base = GateSettings(
        wait_poll_sec=60.0, idle_grace_sec=60.0, quiet_floor_sec=60.0, late_floor_sec=60.0, wait_cap_factor=0.0
    )
    return replace(base, **overrides)


def asks_probe(policy: Policy[Any], facts: GateFacts, usage: UsageReading | None, gate_settings: GateSettings) -> bool:
    """Whether `policy`, deciding the turn without a prefix reading (as the gate does first),
    answers ProbeFirst."""
    return isinstance(policy.decide(policy.view(facts), usage, None, gate_settings), ProbeFirst)


async def until(condition: Callable[[], bool], what: str = "condition", steps: int = 2000) -> None:
    """Let the event loop run until `condition()` holds (no timing assertions: a step budget).

    On a loop whose time is a FakeClock (`loop_on_clock`) only the clock moves time, so
    the budget is in loop iterations alone; otherwise real-time waits get 1 s more."""
    for _ in range(steps):
        if condition():
            return
        await asyncio.sleep(0)
    if not isinstance(asyncio.get_running_loop().time, FakeClock):
        for _ in range(200):  # give real-time waits (a real HTTP round trip) a chance too
            if condition():
                return
            await asyncio.sleep(0.005)
    raise AssertionError(f"gave up waiting for {what}")


async def settle(steps: int = 50) -> None:
    """Let every ready callback run (a woken waiter re-decides), without moving any clock."""
    for _ in range(steps):
        await asyncio.sleep(0)


def assert_clean(gate: Gate, clock: FakeClock) -> None:
    """After a test: no lease, window, waiter, attempt or session is left once windows expire."""
    clock.advance(gate.settings.idle_grace_sec + 1)
    assert gate.counts() == CLEAN


def sample(metrics: GateMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def make_probe(url, http, metrics, clock, api_key=None, **settings) -> ReplicaProbe:
    """The real probe client of replica "r0" at `url`, on the test's HTTP session and clock."""
    return ReplicaProbe("r0", url, lambda: http, ProbeSettings(**settings), metrics, api_key, clock)
