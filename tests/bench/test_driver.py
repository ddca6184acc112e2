"""The workload driver against a scripted replica: histories, headers, retries, stranded attempts."""

import aiohttp

from kvgate.bench.agentic.driver import WorkloadDriver
from kvgate.bench.agentic.workload import WorkloadSpec, generate_workload

SPEC = WorkloadSpec(
    sessions=3,
    concurrency=2,
    turns_min=3,
    turns_max=3,
    system_prompt_words=5,
    task_words=5,
    tool_result_words_min=3,
    tool_result_words_max=5,
    reply_tokens=3,
    tool_latency_median_s=0.001,
)


async def drive(url, workload, timeout=30.0):
    async with aiohttp.ClientSession() as http:
        driver = WorkloadDriver(workload, lambda session: url, "m", http, request_timeout_s=timeout)
        makespan = await driver.run()
    return driver, makespan


async def test_sessions_resend_history_with_the_returned_replies(scripted_replica):
    replica, url = await scripted_replica()
    workload = generate_workload(SPEC, 1)
    driver, makespan = await drive(url, workload)
    assert makespan > 0
    assert len(driver.turns) == 9 and all(t.ok for t in driver.turns)
    assert len(driver.attempts) == 9 and all(a.used and a.status == 200 for a in driver.attempts)
    assert {(a.replica, a.admission, a.wait_ms, a.prompt_tokens) for a in driver.attempts} == {("r0", "open", 1.5, 42)}
    by_session: dict[str, list] = {}
    for headers, body in replica.requests:
        by_session.setdefault(headers["x-session-id"], []).append((headers, body))
    assert sorted(by_session) == sorted(s.session_id for s in workload.sessions)
    for requests in by_session.values():
        third_headers, third = requests[2]
        assert third["stream"] is True and third["max_tokens"] == 3
        # turn 3 carries the replies of turns 1 and 2 exactly as they were streamed
        assert third["messages"][2] == {"role": "assistant", "content": " w1x0 w1x1 w1x2"}
        assert third["messages"][4] == {"role": "assistant", "content": " w2x0 w2x1 w2x2"}
        assert third_headers.get("x-session-finish") == "true"
        assert all("x-session-finish" not in h for h, _ in requests[:2])


async def test_a_retry_supersedes_the_waiting_attempt(scripted_replica):
    replica, url = await scripted_replica(supersede=True)
    workload = generate_workload(
        SPEC.replace(
            sessions=2, turns_min=2, turns_max=2, retry_prob=1.0, retry_after_s_min=0.01, retry_after_s_max=0.02
        ),
        2,
    )
    driver, _ = await drive(url, workload)
    assert len(driver.turns) == 4 and all(t.ok and t.attempts == 2 for t in driver.turns)
    first = [a for a in driver.attempts if a.attempt == 1]
    second = [a for a in driver.attempts if a.attempt == 2]
    assert all(a.status == 409 and a.error_code == "admission_superseded" and not a.used for a in first)
    assert all(a.status == 200 and a.used for a in second)
    assert len(replica.requests) == 8


async def test_an_unanswered_attempt_fails_its_turn_and_ends_the_session(scripted_replica):
    workload = generate_workload(SPEC.replace(sessions=1), 3)
    session_id = workload.sessions[0].session_id
    replica, url = await scripted_replica(never_answer={(session_id, 2)})
    driver, _ = await drive(url, workload, timeout=0.5)
    assert [(t.turn, t.ok) for t in driver.turns] == [(1, True), (2, False)]
    assert [a.status for a in driver.attempts] == [200, "timeout"]


async def test_sessions_start_no_earlier_than_their_interval(scripted_replica):
    replica, url = await scripted_replica()
    workload = generate_workload(SPEC.replace(turns_min=1, turns_max=1, concurrency=3, start_interval_s=0.05), 4)
    driver, _ = await drive(url, workload)
    first_send = {a.session_index: a.start_s for a in driver.attempts}
    assert all(first_send[i] >= i * 0.05 for i in range(3))


async def test_without_send_finish_no_turn_carries_the_finish_header(scripted_replica):
    replica, url = await scripted_replica()
    workload = generate_workload(SPEC.replace(send_finish=False), 5)
    driver, _ = await drive(url, workload)
    assert len(driver.turns) == 9 and all(t.ok for t in driver.turns)
    assert len(replica.requests) == 9
    assert all("x-session-finish" not in headers for headers, _ in replica.requests)


async def test_a_subagent_runs_its_thread_under_the_session_id_before_the_main_thread_goes_on(scripted_replica):
    replica, url = await scripted_replica()
    workload = generate_workload(SPEC.replace(sessions=2, subagent_prob=1.0, subagent_turns=2), 4)
    driver, _ = await drive(url, workload)
    # 3 main turns, and a subagent of 2 turns at each of the 2 tool calls
    assert len(driver.turns) == 2 * 7 == workload.num_turns and all(t.ok for t in driver.turns)
    for session in workload.sessions:
        sent = [(h, b) for h, b in replica.requests if h["x-session-id"] == session.session_id]
        threads = [b["messages"][0]["content"] for _, b in sent]
        (_, first), (_, second) = session.subagents
        main, one, two = session.system_prompt, first.system_prompt, second.system_prompt
        assert threads == [main, one, one, main, two, two, main]
        assert [len(b["messages"]) for _, b in sent] == [2, 2, 4, 4, 2, 4, 6]  # each thread's own history
        assert [h.get("x-session-finish") for h, _ in sent] == [None] * 6 + ["true"]
        numbers = sorted(t.turn for t in driver.turns if t.session_index == session.index)
        assert numbers == list(range(1, 8))


async def test_a_capped_workload_with_stop_strings_sends_them_with_every_turn(scripted_replica):
    replica, url = await scripted_replica()
    workload = generate_workload(SPEC.replace(sessions=1, max_tokens=64, stop=(" ", "e")), 6)
    driver, _ = await drive(url, workload)
    assert len(driver.turns) == 3 and all(t.ok for t in driver.turns)
    assert [(b["max_tokens"], b["min_tokens"], b["stop"]) for _, b in replica.requests] == [(64, 3, [" ", "e"])] * 3
