"""The client side of a run: agent sessions sending their turns over HTTP.

A pool of `spec.concurrency` workers takes sessions in index order (a rolling rollout:
when a session ends, the next one starts; session i never before i * start_interval_s). Each turn is one streaming
request of the driver's API (`bench.agentic.apis`: `/v1/chat/completions` with the
session id header by default, or Anthropic `/v1/messages`, or `/v1/responses` chained by
`previous_response_id`); the last turn also carries the finish header, as a rollout
client that knows its episode ended would (unless `spec.send_finish` is False: an
OpenAI-SDK agent sends none).

Retries: a turn planned with `retry_after_s` is re-sent if its first attempt has not
answered after that delay. The session continues with whichever attempt completes
first; the other one runs to its end in the background (through kvgate a superseded
attempt still waiting at the gate gets 409 `admission_superseded`). Every attempt is
recorded, and the run waits for all of them, so an attempt that never ends shows up
as a `timeout` (a stranded waiter) instead of hanging the benchmark.

Invariant: the reply text appended to the history is the text the server returned,
so turn k+1's prompt starts with what the replica computed for turn k.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import aiohttp
import orjson

from kvgate.bench.agentic.apis import API_PATHS, StreamState, turn_request
from kvgate.bench.agentic.workload import SessionPlan, TurnPlan, Workload

FINISH_HEADER = "x-session-finish"


@dataclass
class AttemptRecord:
    """One HTTP attempt of one turn. Times are seconds since the run started."""

    session_index: int
    turn: int  # the session's n-th turn (1-based), counted across its threads (main and subagents)
    attempt: int  # 1 = first send, 2 = retry
    start_s: float
    end_s: float
    ttft_s: float | None  # first generated-token chunk, relative to this attempt's start
    status: int | str  # HTTP status, or "timeout" / "error" / "stream_error"
    error_code: str | None
    replica: str | None  # x-kvgate-replica, or the URL picked in direct mode
    admission: str | None  # x-kvgate-admission
    wait_ms: float | None  # x-kvgate-wait-ms
    prompt_tokens: int | None  # usage.prompt_tokens
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, when given
    used: bool = False  # this attempt's reply continued the session

    @property
    def ok(self) -> bool:
        return self.status == 200

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class TurnRecord:
    """One turn as the agent saw it: from its first send to the reply it used."""

    session_index: int
    turn: int  # the session's n-th turn (1-based), counted across its threads (main and subagents)
    start_s: float
    end_s: float
    ttft_s: float | None  # from the turn's start to the used attempt's first token
    ok: bool
    attempts: int

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    def to_json(self) -> dict:
        return {**asdict(self), "latency_s": self.latency_s}


@dataclass
class _Outcome:
    record: AttemptRecord
    text: str
    response_id: str | None = None  # the answer's id (a Responses chain continues it)


class WorkloadDriver:
    """Runs a workload against base URLs; `target(session)` picks a session's base URL."""

    def __init__(
        self,
        workload: Workload,
        target: Callable[[SessionPlan], str],
        model: str,
        http: aiohttp.ClientSession,
        request_timeout_s: float = 300.0,
        api: str = "chat",
    ) -> None:
        if api not in API_PATHS:
            raise ValueError(f"unknown api {api!r}; choose from {', '.join(API_PATHS)}")
        self.api = api
        self.workload = workload
        self.target = target
        self.model = model
        self.http = http
        self.request_timeout_s = request_timeout_s
        self.attempts: list[AttemptRecord] = []
        self.turns: list[TurnRecord] = []
        self._background: set[asyncio.Task] = set()
        self._t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._t0

    async def run(self) -> float:
        """Run every session; return the makespan (first send to last attempt's end)."""
        self._t0 = time.perf_counter()
        queue: asyncio.Queue[SessionPlan] = asyncio.Queue()
        for session in self.workload.sessions:
            queue.put_nowait(session)

        async def worker() -> None:
            while True:
                try:
                    session = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                not_before = session.index * self.workload.spec.start_interval_s
                if not_before > self.now():
                    await asyncio.sleep(not_before - self.now())
                await self._run_session(session)

        workers = min(self.workload.spec.concurrency, len(self.workload.sessions))
        await asyncio.gather(*(worker() for _ in range(workers)))
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        return self.now()

    async def _run_session(self, session: SessionPlan) -> None:
        await self._run_thread(session, self.target(session), [0], main=True)

    async def _run_thread(self, thread: SessionPlan, base_url: str, turns_run: list[int], main: bool = False) -> bool:
        """Run one thread of a session: its main thread, or a subagent's that a tool call of it
        runs (under the same session id) before the main thread goes on. False when a turn
        failed: that ends the session, as there is no reply to build on. `turns_run` numbers
        the session's turns across its threads, in the order they are sent."""
        replies: list[str] = []
        previous_response_id: list[str | None] = [None]  # the last used answer's id
        for turn in thread.turns:
            turns_run[0] += 1
            finish = main and turn.index == len(thread.turns) and self.workload.spec.send_finish
            text = await self._run_turn(thread, turn, replies, base_url, previous_response_id, turns_run[0], finish)
            if text is None:
                return False
            replies.append(text)
            subagent = thread.subagent_after(turn.index)
            if subagent is not None and not await self._run_thread(subagent, base_url, turns_run):
                return False
            if turn.tool_latency_s > 0:
                await asyncio.sleep(turn.tool_latency_s)
        return True

    async def _run_turn(
        self,
        session: SessionPlan,
        turn: TurnPlan,
        replies: list[str],
        base_url: str,
        previous_response_id: list[str | None],
        number: int,
        finish: bool,
    ) -> str | None:
        """Send turn `turn` of the thread `session` (its `number`-th of the session, as the
        records count it); its reply's text, or None if no attempt succeeded."""
        body, headers = turn_request(
            self.api,
            self.model,
            session,
            turn.index,
            replies,
            self.workload.reply_tokens(turn),
            previous_response_id[0],
            self.workload.spec.max_tokens,
            self.workload.spec.stop,
        )
        if finish:
            headers[FINISH_HEADER] = "true"
        payload = orjson.dumps(body)
        start = self.now()

        def launch(attempt: int) -> asyncio.Task:
            task = asyncio.create_task(self._send(session, number, attempt, base_url, payload, headers))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return task

        pending = {launch(1)}
        attempts = 1
        # when the retry is sent; None: no retry planned, or it is sent
        retry_at = None if turn.retry_after_s is None else start + turn.retry_after_s
        used: _Outcome | None = None
        while pending and used is None:
            timeout = None if retry_at is None else max(0.0, retry_at - self.now())
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                outcome = task.result()
                if outcome.record.ok and used is None:
                    used = outcome
            if not done and retry_at is not None:
                pending.add(launch(2))
                attempts = 2
                retry_at = None
        if used is None:
            self.turns.append(TurnRecord(session.index, number, start, self.now(), None, False, attempts))
            return None
        used.record.used = True
        previous_response_id[0] = used.response_id
        record = used.record
        ttft = None if record.ttft_s is None else record.start_s + record.ttft_s - start
        self.turns.append(TurnRecord(session.index, number, start, record.end_s, ttft, True, attempts))
        return used.text

    async def _send(
        self, session: SessionPlan, number: int, attempt: int, base_url: str, payload: bytes, headers: dict
    ) -> _Outcome:
        start = self.now()
        record = AttemptRecord(
            session.index, number, attempt, start, start, None, "error", None, None, None, None, None, None
        )
        state = StreamState(self.api)
        try:
            async with asyncio.timeout(self.request_timeout_s):
                async with self.http.post(
                    base_url + API_PATHS[self.api],
                    data=payload,
                    headers={**headers, "content-type": "application/json"},
                ) as resp:
                    record.replica = resp.headers.get("x-kvgate-replica", base_url)
                    record.admission = resp.headers.get("x-kvgate-admission")
                    wait = resp.headers.get("x-kvgate-wait-ms")
                    record.wait_ms = float(wait) if wait else None
                    if resp.status != 200:
                        record.status = resp.status
                        record.error_code = _error_code(await resp.read())
                    else:
                        record.status = await self._read_stream(resp, record, start, state)
        except TimeoutError:
            record.status = "timeout"
        except aiohttp.ClientError as exc:
            record.status = "error"
            record.error_code = type(exc).__name__
        record.end_s = self.now()
        self.attempts.append(record)
        return _Outcome(record, state.text, state.response_id)

    async def _read_stream(self, resp, record: AttemptRecord, start: float, state: StreamState) -> int | str:
        """Consume the SSE stream, filling TTFT, usage and the reply text; return the status."""
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            try:
                event = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if state.on_event(event) and record.ttft_s is None:
                record.ttft_s = self.now() - start
            if state.error is not None:
                record.error_code = _error_code(data)
                return "stream_error"
        record.prompt_tokens = state.prompt_tokens
        record.cached_tokens = state.cached_tokens
        return 200


def _error_code(body: bytes) -> str | None:
    try:
        document = orjson.loads(body)
        error = document.get("error") or document  # a Responses "error" event carries code at the top
        return error.get("code") or error.get("type")
    except (orjson.JSONDecodeError, AttributeError):
        return None
