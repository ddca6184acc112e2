"""The gate's operator metrics (docs/observability.md): oldest waiter, wait by reason,
estimated re-prefill. Every test ends with nothing left."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from kvgate.gate.book import WindowEnd
from kvgate.gate.gate import Gate
from kvgate.gate.metrics import GateMetrics
from kvgate.gate.observations import reprefill_tokens
from tests.gate.helpers import FakeProbe, assert_clean, body, make_probe, sample, settings, until

# Logic tests: the gate's timers run on the fake clock (see conftest.loop_on_clock).
pytestmark = pytest.mark.usefixtures("loop_on_clock")


@pytest.mark.parametrize(
    "previous, prompt, hit_blocks, block_size, expected",
    [
        (None, 320, 0, 16, 0),  # no history: a first turn re-prefills nothing
        (320, 352, 20, 16, 0),  # the previous prompt's 20 full blocks are all resident
        (320, 352, 18, 16, 32),  # two of them were evicted
        (320, 352, 0, 16, 320),  # all evicted
        (330, 352, 0, 16, 320),  # the previous prompt's partial block was never cached
        (320, 100, 0, 16, 96),  # a shorter prompt (history rewritten) shares at most itself
        (320, 352, 25, 16, 0),  # more resident than before (another session's prefix): never negative
        (320, 352, 0, None, 0),  # block size unknown (/metrics fallback): no estimate
        (320, 0, 0, 16, 0),
    ],
)
def test_reprefill_tokens(previous, prompt, hit_blocks, block_size, expected):
    assert reprefill_tokens(previous, prompt, hit_blocks, block_size) == expected


async def test_oldest_waiter_age_and_wait_by_reason(metrics, clock):
    probe = FakeProbe()
    gate = Gate("r0", probe, settings(wait_poll_sec=60), metrics, clock)
    assert sample(metrics, "kvgate_oldest_waiter_seconds", replica="r0") == 0
    holder = await gate.acquire("busy", "chat", body("busy"))
    probe.usage_value = 0.9
    first = asyncio.create_task(gate.acquire("cold1", "chat", body("cold1")))
    await until(lambda: gate.counts()["waiters"] == 1, "cold1 to wait")
    clock.advance(2.0)
    second = asyncio.create_task(gate.acquire("cold2", "chat", body("cold2")))
    await until(lambda: gate.counts()["waiters"] == 2, "cold2 to wait")
    clock.advance(0.5)
    assert sample(metrics, "kvgate_oldest_waiter_seconds", replica="r0") == pytest.approx(2.5)
    probe.usage_value = 0.1
    holder.release()
    leases = [await first, await second]
    assert sample(metrics, "kvgate_oldest_waiter_seconds", replica="r0") == 0
    assert sample(metrics, "kvgate_admission_reason_wait_seconds_count", replica="r0", reason="open") == 3
    assert sample(metrics, "kvgate_admission_reason_wait_seconds_sum", replica="r0", reason="open") == (
        pytest.approx(2.5 + 0.5)
    )
    for lease in leases:
        lease.release()
    assert_clean(gate, clock)
    gate.close("test over")
    assert sample(metrics, "kvgate_oldest_waiter_seconds", replica="r0") == 0


async def test_reprefill_counts_evicted_blocks_of_the_previous_turn(metrics, clock):
    probe = FakeProbe(usage=0.9, total=64, free=10, block_size=16)
    gate = Gate("r0", probe, settings(policy="watermark", retain_session=False), metrics, clock)  # every turn probed
    probe.set_prefix("s1", total=20, hit=18, tokens=330)
    lease = await gate.acquire("s1", "chat", body("s1"))
    lease.release()
    assert sample(metrics, "kvgate_reprefill_tokens_estimated_total", replica="r0") == 0  # first turn
    probe.set_prefix("s1", total=22, hit=18, tokens=360)  # 2 of the 20 earlier full blocks are gone
    lease = await gate.acquire("s1", "chat", body("s1"))
    assert lease.reason == "resident_prefix" and probe.prefix_calls == ["s1", "s1"]
    lease.release()
    assert sample(metrics, "kvgate_reprefill_tokens_estimated_total", replica="r0") == 32
    gate.finish_session("s1")
    assert_clean(gate, clock)


async def test_probe_api_gauge_follows_the_fallback(replica_url, http, script, metrics, clock):
    probe = make_probe(replica_url, http, metrics, clock)
    assert metrics.registry.get_sample_value("kvgate_replica_probe_api", {"replica": "r0"}) is None  # unknown yet
    await probe.usage()
    assert sample(metrics, "kvgate_replica_probe_api", replica="r0") == 1
    script.has_probe_api = False
    clock.advance(1)
    await probe.usage(newer_than=clock() - 0.5)
    assert sample(metrics, "kvgate_replica_probe_api", replica="r0") == 0
    clock.advance(2)
    await probe.usage(newer_than=clock() - 0.5)  # still on the fallback
    assert sample(metrics, "kvgate_replica_probe_api", replica="r0") == 0
    script.has_probe_api = True
    clock.advance(60)
    await probe.usage()
    assert sample(metrics, "kvgate_replica_probe_api", replica="r0") == 1
    probe.close()  # the replica was removed: no series left to alert on
    assert metrics.registry.get_sample_value("kvgate_replica_probe_api", {"replica": "r0"}) is None


async def test_unreachable_replica_sets_no_probe_api_series(http, metrics, clock, unused_tcp_port):
    probe = make_probe(f"http://127.0.0.1:{unused_tcp_port}", http, metrics, clock)
    assert await probe.usage() is None
    assert metrics.registry.get_sample_value("kvgate_replica_probe_api", {"replica": "r0"}) is None


def test_the_window_ends_help_names_every_cause():
    registry = CollectorRegistry()
    GateMetrics(registry)
    (family,) = [m for m in registry.collect() if m.name == "kvgate_window_ends"]
    assert all(cause in family.documentation for cause in WindowEnd)
