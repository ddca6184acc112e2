"""The probe client against a fake replica: answers, sharing, fallbacks and every fault."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.gate.gate import Gate
from kvgate.gate.readings import PrefixReading, UsageReading
from tests.gate.helpers import assert_clean, body, make_probe, sample, settings, until


async def test_kv_reading_and_metrics(replica_url, http, script, metrics, clock):
    probe = make_probe(replica_url, http, metrics, clock)
    reading = await probe.usage()
    assert reading == UsageReading(0.1, 100, 90, 16, "kv")
    assert sample(metrics, "kvgate_replica_kv_usage", replica="r0") == 0.1
    assert sample(metrics, "kvgate_probe_seconds_count", replica="r0", probe="kv") == 1
    assert script.authorization == [None]


async def test_api_key_is_sent_as_bearer(replica_url, http, script, metrics, clock):
    probe = make_probe(replica_url, http, metrics, clock, api_key="sekrit")
    await probe.usage()
    assert script.authorization == ["Bearer sekrit"]


async def test_concurrent_callers_share_one_probe_and_reuse_a_fresh_result(replica_url, http, script, metrics, clock):
    probe = make_probe(replica_url, http, metrics, clock, usage_max_age_ms=50)
    readings = await asyncio.gather(*(probe.usage() for _ in range(25)))
    assert script.kv_hits == 1 and len(set(readings)) == 1
    clock.advance(0.049)
    await probe.usage()
    assert script.kv_hits == 1
    clock.advance(0.002)
    script.usage(0.7)
    # stale: answered at once from the cache, while one refresh runs in the background
    stale = await asyncio.gather(*(probe.usage() for _ in range(10)))
    assert {r.kv_cache_usage for r in stale} == {0.1}
    await until(lambda: script.kv_hits == 2 and not probe._usage.refreshing, "the background refresh")
    assert (await probe.usage()).kv_cache_usage == 0.7
    assert script.kv_hits == 2
    # past usage_max_age_ms + timeout_sec a reading is not used: callers wait for a fresh one
    clock.advance(2.0)
    script.usage(0.3)
    assert (await probe.usage()).kv_cache_usage == 0.3
    assert script.kv_hits == 3


async def test_ready_usage_answers_what_usage_would_without_waiting(replica_url, http, script, metrics, clock):
    """The gate's calm path reads `ready_usage`: the reading `usage()` would return at once
    (a stale one while its refresh runs), else None: the caller must wait for a probe."""
    probe = make_probe(replica_url, http, metrics, clock, usage_max_age_ms=50)
    assert probe.ready_usage() is None  # no reading yet: the calm path never waits for one
    assert script.kv_hits == 0
    await probe.usage()
    assert probe.ready_usage().kv_cache_usage == 0.1  # fresh
    clock.advance(0.051)
    script.usage(0.7)
    assert probe.ready_usage().kv_cache_usage == 0.1  # stale: answered, a refresh started
    await until(lambda: script.kv_hits == 2 and not probe._usage.refreshing, "the background refresh")
    assert probe.ready_usage().kv_cache_usage == 0.7
    clock.advance(2.0)  # past usage_max_age_ms + timeout_sec: not used, and no probe awaited
    assert probe.ready_usage() is None
    assert (await probe.usage()).kv_cache_usage == 0.7


async def test_newer_than_insists_on_a_probe_started_after_a_release(replica_url, http, script, metrics, clock):
    probe = make_probe(replica_url, http, metrics, clock, usage_max_age_ms=50)
    assert (await probe.usage()).kv_cache_usage == 0.1
    released_at = clock()
    clock.advance(0.001)
    script.usage(0.5)
    assert (await probe.usage()).kv_cache_usage == 0.1  # fresh enough for a first look
    assert (await probe.usage(newer_than=released_at)).kv_cache_usage == 0.5
    assert script.kv_hits == 2
    assert (await probe.usage(newer_than=released_at)).kv_cache_usage == 0.5  # now cached
    assert script.kv_hits == 2


async def test_a_cancelled_caller_does_not_cancel_the_shared_probe(replica_url, http, script, metrics, clock):
    script.kv_delay = 0.05
    probe = make_probe(replica_url, http, metrics, clock)
    first = asyncio.create_task(probe.usage())
    second = asyncio.create_task(probe.usage())
    await asyncio.sleep(0.01)
    first.cancel()
    assert (await second).kv_cache_usage == 0.1
    assert script.kv_hits == 1


async def test_prefix_sends_chat_and_completion_bodies(replica_url, http, script, metrics, clock):
    probe = make_probe(replica_url, http, metrics, clock)
    script.prefix("s1", total=20, hit=18)
    chat = {"id": "s1", "model": "m", "messages": [{"role": "user", "content": "hello"}]}
    assert await probe.prefix("chat", chat) == PrefixReading(20, 18, 0.9, 320)
    completion = {"id": "s2", "model": "m", "prompt": "hello"}
    assert (await probe.prefix("completion", completion)).hit_blocks == 0
    assert script.prefix_requests == [{"chat": chat}, {"completion": completion}]
    assert sample(metrics, "kvgate_probe_seconds_count", replica="r0", probe="prefix") == 2


async def test_prefix_sends_messages_and_responses_bodies(replica_url, http, script, metrics, clock):
    probe = make_probe(replica_url, http, metrics, clock)
    script.prefix("s1", total=20, hit=18)
    messages = {"id": "s1", "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
    assert await probe.prefix("messages", messages) == PrefixReading(20, 18, 0.9, 320)
    responses = {"id": "s2", "model": "m", "input": "hello", "previous_response_id": "resp_1"}
    assert (await probe.prefix("responses", responses)).hit_blocks == 0
    assert script.prefix_requests == [{"messages": messages}, {"responses": responses}]


async def test_prefix_not_held_by_the_replica_is_unavailable(replica_url, http, script, metrics, clock):
    """vLLM answers 404 for a previous_response_id it does not hold: no reading, counted."""
    probe = make_probe(replica_url, http, metrics, clock)
    script.prefix_status = 404
    assert await probe.prefix("responses", {"id": "s1", "input": "x", "previous_response_id": "resp_gone"}) is None
    assert sample(metrics, "kvgate_probe_errors_total", replica="r0", probe="prefix") == 1


@pytest.mark.parametrize("route_kind", ["models"])
async def test_prefix_unavailable_for_routes_the_replica_cannot_render(
    replica_url, http, script, metrics, clock, route_kind
):
    probe = make_probe(replica_url, http, metrics, clock)
    assert await probe.prefix(route_kind, {"id": "s1"}) is None
    assert script.prefix_requests == []
    assert sample(metrics, "kvgate_probe_errors_total", replica="r0", probe="prefix") == 0


async def test_missing_probe_api_falls_back_to_metrics(replica_url, http, script, metrics, clock):
    script.has_probe_api = False
    probe = make_probe(replica_url, http, metrics, clock)
    assert await probe.usage() == UsageReading(0.42, source="metrics")
    assert not probe.has_probe_api
    assert await probe.prefix("chat", {"id": "s1"}) is None  # not even asked
    clock.advance(2)
    await probe.usage()
    assert (script.kv_hits, script.metrics_hits) == (1, 2)  # the probe API is not re-asked at once
    assert sample(metrics, "kvgate_probe_errors_total", replica="r0", probe="kv") == 0
    # the replica restarts with the plugin: found again after KV_RECHECK_SEC
    script.has_probe_api = True
    clock.advance(60)
    assert (await probe.usage()).source == "kv" and probe.has_probe_api


async def test_missing_metrics_gauge_counts_an_error(replica_url, http, script, metrics, clock):
    script.has_probe_api = False
    script.metrics_text = "vllm:num_requests_running 1\n"
    probe = make_probe(replica_url, http, metrics, clock)
    assert await probe.usage() is None
    assert sample(metrics, "kvgate_probe_errors_total", replica="r0", probe="kv") == 1


async def test_slow_kv_probe_times_out_as_unavailable(replica_url, http, script, metrics, clock):
    script.kv_delay = 0.5
    probe = make_probe(replica_url, http, metrics, clock, timeout_sec=0.05)
    assert await probe.usage() is None
    assert sample(metrics, "kvgate_probe_errors_total", replica="r0", probe="kv") == 1
    # the failure is cached like a result, so a dead replica is not hammered
    assert await probe.usage() is None and script.kv_hits == 1


async def test_a_timed_out_kv_probe_of_a_replica_that_answered_recently_keeps_its_last_reading(
    replica_url, http, script, metrics, clock
):
    """A probe timeout on a busy replica (a long engine step) is not 'usage unknown' (which
    admits `open`): the last good reading stands for BUSY_READING_MAX_AGE_SEC."""
    # a timeout generous enough for the first answer on a loaded machine
    probe = make_probe(replica_url, http, metrics, clock, timeout_sec=0.5, usage_max_age_ms=0)
    first = await probe.usage()
    assert first is not None and first.kv_cache_usage == 0.1
    script.kv_delay = 2.0
    clock.advance(1)
    assert await probe.usage(newer_than=clock()) == first  # timed out: the last reading
    assert sample(metrics, "kvgate_probe_errors_total", replica="r0", probe="kv") == 1
    clock.advance(31)  # too old to stand for the replica now
    assert await probe.usage(newer_than=clock()) is None


async def test_slow_prefix_probe_times_out_as_unavailable(replica_url, http, script, metrics, clock):
    script.prefix_delay = 0.5
    probe = make_probe(replica_url, http, metrics, clock, timeout_sec=0.05)
    assert await probe.prefix("chat", {"id": "s1"}) is None
    assert sample(metrics, "kvgate_probe_errors_total", replica="r0", probe="prefix") == 1


@pytest.mark.parametrize(
    "raw, status",
    [
        (b"{not json", 200),
        (b'{"kv_cache_usage": 1.5}', 200),
        (b'{"kv_cache_usage": -0.2}', 200),
        (b'{"kv_cache_usage": "high"}', 200),
        (b"[0.5]", 200),
        (b'{"kv_cache_usage": 0.5}', 500),
    ],
)
async def test_garbage_kv_answers_are_errors(replica_url, http, script, metrics, clock, raw, status):
    script.kv_raw, script.kv_status = raw, status
    probe = make_probe(replica_url, http, metrics, clock)
    assert await probe.usage() is None
    assert sample(metrics, "kvgate_probe_errors_total", replica="r0", probe="kv") == 1
    assert sample(metrics, "kvgate_probe_seconds_count", replica="r0", probe="kv") == 0


@pytest.mark.parametrize(
    "raw, status",
    [(b"<html>", 200), (b'{"total_blocks": 1, "hit_blocks": 2, "hit_ratio": 1}', 200), (b'{"error": "x"}', 400)],
)
async def test_garbage_prefix_answers_are_errors(replica_url, http, script, metrics, clock, raw, status):
    script.prefix_raw, script.prefix_status = raw, status
    probe = make_probe(replica_url, http, metrics, clock)
    assert await probe.prefix("chat", {"id": "s1"}) is None
    assert sample(metrics, "kvgate_probe_errors_total", replica="r0", probe="prefix") == 1


async def test_unreachable_replica_is_an_error_not_an_exception(http, metrics, clock, unused_tcp_port):
    probe = make_probe(f"http://127.0.0.1:{unused_tcp_port}", http, metrics, clock)
    assert await probe.usage() is None
    assert await probe.prefix("chat", {"id": "s1"}) is None
    assert sample(metrics, "kvgate_probe_errors_total", replica="r0", probe="kv") == 1
    assert sample(metrics, "kvgate_probe_errors_total", replica="r0", probe="prefix") == 1


async def test_a_reading_under_revalidation_is_used_until_the_refresh_ends(replica_url, http, script, metrics, clock):
    probe = make_probe(replica_url, http, metrics, clock, usage_max_age_ms=50, timeout_sec=0.5)
    assert (await probe.usage()).kv_cache_usage == 0.1
    script.usage(0.6)
    script.kv_delay = 0.1
    clock.advance(0.06)
    assert (await probe.usage()).kv_cache_usage == 0.1  # stale: refresh started in the background
    clock.advance(5)  # far past the limit, but its revalidation started in time: no waiting
    assert (await probe.usage()).kv_cache_usage == 0.1
    await until(lambda: not probe._usage.refreshing, "the refresh to end")
    assert script.kv_hits == 2
    # an idle gate: the reading is too old and nothing refreshes it, so the caller waits
    script.usage(0.2)
    clock.advance(10)
    assert (await probe.usage()).kv_cache_usage == 0.2 and script.kv_hits == 3


async def test_revalidate_refreshes_a_reading_past_max_age_in_the_background(replica_url, http, script, metrics, clock):
    """`revalidate_usage` (the gate calls it at each release) starts one background refresh
    of a reading older than usage_max_age_ms, none of a fresh one or while one runs; its
    reading then answers at once past the stale limit of the reading it replaced."""
    probe = make_probe(replica_url, http, metrics, clock, usage_max_age_ms=50, timeout_sec=0.5)
    assert (await probe.usage()).kv_cache_usage == 0.1
    probe.revalidate_usage()  # fresh: nothing to do
    assert not probe._usage.refreshing
    clock.advance(0.4)
    script.usage(0.6)
    script.kv_delay = 0.05
    probe.revalidate_usage()
    probe.revalidate_usage()  # one refresh at a time
    assert probe._usage.refreshing
    await until(lambda: not probe._usage.refreshing, "the background refresh")
    assert script.kv_hits == 2
    clock.advance(0.4)  # 0.8 s after the first reading, past its stale limit (0.55 s)
    assert probe.ready_usage().kv_cache_usage == 0.6  # the refreshed one, at once


async def test_a_gate_revalidates_its_usage_reading_when_a_turn_ends(replica_url, http, script, metrics, clock):
    """A release changes the replica's blocks: the gate has its probe refresh the reading in
    the background, so the next turn after a quiet spell finds one it may use at once (the
    calm path's `ready_usage`) instead of waiting a probe, up to an engine step on vLLM."""
    probe = make_probe(replica_url, http, metrics, clock, usage_max_age_ms=50, timeout_sec=0.5)
    gate = Gate("r0", probe, settings(), metrics, clock)
    lease = await gate.acquire("s1", "chat", body("s1"))
    assert script.kv_hits == 1
    clock.advance(0.4)  # the turn runs
    lease.release()
    await until(lambda: script.kv_hits == 2 and not probe._usage.refreshing, "the release's refresh")
    clock.advance(0.4)  # past the stale limit of the reading the turn was admitted on
    assert probe.ready_usage() is not None  # (and, 0.4 s old, it starts a refresh of its own)
    await until(lambda: script.kv_hits == 3 and not probe._usage.refreshing, "the calm path's refresh")
    unbooked = await gate.acquire("s1", "models", {})  # no prompt: books nothing, reads nothing
    clock.advance(1.0)
    unbooked.release()
    await asyncio.sleep(0.05)
    assert script.kv_hits == 3 and not probe._usage.refreshing
    clock.advance(61)
    assert_clean(gate, clock)
    probe.close()
