"""A held turn forwarded at low priority, end to end: the real proxy and the working_set
gate (`gate.held_priority: 1`) before a simulated replica that schedules by priority, and
the real OpenAI SDK. The replica's engine receives the turn at priority 1, preempts it
when the window holder needs its blocks, and serves both; nothing is left behind (no
lease, waiter or attempt)."""

from __future__ import annotations

import asyncio
import contextlib

import openai

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.settings import Settings
from kvgate.simulator.replica_server import start_simulated_replicas
from kvgate.simulator.reply_model import FIXED_LENGTHS

MODEL = "kvgate-sim"
CONTEXT = "tool output line\n" * 120  # ~370 tokens: two such sessions overfill 40 blocks of 16


@contextlib.asynccontextmanager
async def priority_stack(
    scheduling_policy: str, num_blocks: int = 40, time_scale: float = 0.0, quiet_floor_sec: float = 0.5
):
    """kvgate before one replica of `num_blocks` blocks; the work-conserving rule off, so
    that a turn that does not fit beside the windows is one the gate would hold. An idle
    window lives at least `quiet_floor_sec`; a held turn is re-decided every 0.1 s."""
    # Every reply exactly max_tokens long: the arithmetic below decodes each turn's whole allowance.
    (replica,) = await start_simulated_replicas(
        1,
        time_scale=time_scale,
        num_blocks=num_blocks,
        block_size=16,
        scheduling_policy=scheduling_policy,
        reply_model=FIXED_LENGTHS,
    )
    seen: list[int] = []
    add_request = replica.engine.add_request

    def recording_add_request(prompt_token_ids, max_tokens, cache_salt=None, priority=0, pin=None):
        seen.append(priority)
        return add_request(prompt_token_ids, max_tokens, cache_salt, priority, pin)

    replica.engine.add_request = recording_add_request  # type: ignore[method-assign]  # records, then the real one
    gate = GateSettings(
        mode="enforce",
        policy="working_set",
        work_conserving=False,
        held_priority=1,
        quiet_floor_sec=quiet_floor_sec,
        wait_poll_sec=0.1,  # not the default 1 s: a held turn goes in soon after the window ends
    )
    app = create_app(Settings(replicas=(ReplicaSettings(replica.name, replica.url),), gate=gate), health_checks=False)
    try:
        host, port = await app.start("127.0.0.1", 0)
        client = openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key="k", max_retries=0)
        yield app, client, seen, replica.engine
        await client.close()
    finally:
        await app.close()
        await replica.stop()


async def turn(client: openai.AsyncOpenAI, session: str, max_tokens: int = 8) -> tuple[str, str]:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"{session}: {CONTEXT}"}],
        max_tokens=max_tokens,
        extra_headers={"x-session-id": session},
    )
    answer = raw.parse()
    return raw.headers["x-kvgate-admission"], answer.choices[0].finish_reason


async def test_a_turn_the_gate_would_hold_runs_at_low_priority_and_yields_to_the_window():
    """64 blocks. a's window is priced at its prompt (23 blocks) and its 400-token output
    allowance (25): 48. While a decodes, b (23 blocks and 13 of output allowance) fits
    vLLM's free blocks but not the windows' books: the gate would hold it; it goes in at
    priority 1 instead. The two outgrow the cache and the engine preempts b, not a."""
    # a's idle window must outlive the moments between its turns however loaded the machine;
    # at half the cost model's step times a still decodes for a second and more after b is sent
    async with priority_stack("priority", num_blocks=64, time_scale=0.5, quiet_floor_sec=30.0) as (
        app,
        client,
        seen,
        engine,
    ):
        first = asyncio.create_task(turn(client, "a", max_tokens=400))
        for _ in range(500):
            if engine.scheduler.running:
                break
            await asyncio.sleep(0.01)
        assert await turn(client, "b", max_tokens=200) == ("low_priority", "length")
        assert await first == ("window_fits", "length")
        assert seen == [0, 1]
        assert engine.scheduler.counters.num_preemptions >= 1  # b yielded its blocks to a
        assert await turn(client, "a") == ("holds_window", "length")
        assert seen[-1] == 0  # a window holder goes as sent
        for session in ("a", "b"):
            app.admission.finish_session(session)
        counts = app.admission.counts()
        assert (counts["leases"], counts["waiters"], counts["attempts"]) == (0, 0, 0), counts


async def test_a_replica_that_schedules_first_come_first_served_gets_no_priority():
    """The same turns on a replica with vLLM's default policy: the gate holds b until a's
    idle window ends (its session went quiet), and no request reaches the engine with a priority."""
    async with priority_stack("fcfs") as (app, client, seen, _):
        assert await turn(client, "a") == ("window_fits", "length")
        admission, _ = await turn(client, "b")
        assert admission == "window_fits" and seen == [0, 0]
        for session in ("a", "b"):
            app.admission.finish_session(session)
        counts = app.admission.counts()
        assert (counts["leases"], counts["waiters"], counts["attempts"]) == (0, 0, 0), counts
