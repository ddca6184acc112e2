"""One replica's admission gate: the asyncio shell around a policy and a SessionBook.

`Gate.acquire(session_key, route_kind, body)` returns a `Lease` or raises an
`AdmissionError`. Per attempt it loops: read usage (shared, cached), build the view
the policy reads (`TurnFacts`), decide without a prefix reading; on `ProbeFirst` ask
the prefix probe and decide again with its answer (`Policy.decide_read`: never
ProbeFirst twice); then admit, reject, or wait in the queue (the oldest session's
turn first) until woken and decide again. The shell carries out what the decision says (window,
footprint, repricing, wake-ups: the fields of `Admit`, `Wait`, `Reject`) and infers
no policy meaning of its own.

Invariants (each has a test):
- Every lease is counted until released; `Lease.release()` is idempotent.
- A turn has at most one attempt acquiring: a re-sent turn (same `turn_key`: same
  prompt) aborts its older attempt, which raises `AdmissionSuperseded` at its next
  checkpoint (before and after each probe, and on waking); so a retry storm leaves at
  most one waiter per turn. Distinct turns of one session (a main turn beside a side
  request, parallel subagents) acquire side by side; while one is in flight in the
  session's window the next is priced behind it, and the window covers both.
- Cancelling an acquire (client disconnect) leaves no waiter, attempt or lease.
- A held turn re-decides on its last prefix reading while it is younger than
  HELD_READING_MAX_AGE_SEC, and probes again only if that reading would admit it
  (every admission is priced on a reading taken for it).
- Waiters queue in the order the book first saw their sessions (`SessionRecord.started`;
  an anonymous turn behind the sessions seen before it), in arrival order among turns of
  one session: a turn of an older session goes ahead of a younger session's. So the
  sessions a replica began first finish first, instead of every session's turns
  taking their chances (docs/decisions/oldest-session-first.md).
- Waiters are woken in queue order: one per released lease, finished, expired or
  lost window, or shrunk window footprint (anything that lowers the blocks committed
  to windows), and each admitted waiter (or an `Admit` with `wake_next`: no
  pressure), or a head waiter that leaves, wakes the next. The head of the queue
  also wakes itself every `wait_poll_sec` and when the next idle window is due, so
  no wake-up is ever needed for liveness: the head always has a timer, and whoever
  heads the queue next is woken when it leaves. Behind the head, a waiter does the
  same unless its last Wait set `poll=False` (the policy says only what the shell sees
  can change its decision). A waiter whose last Wait set `wake_on_release` (one
  behind others the work-conserving rule may let in) is also woken whenever blocks
  are freed, not only when it heads the queue; a release that leaves the replica
  without a lease out (it goes idle) wakes every waiter.
- The policy sees how many named waiters are ahead of the attempt, where it is queued or
  would be (the working_set policy gives newcomers windows in queue order), and the
  output the turn is priced at (`SessionBook.output_price`: its body's allowance, capped
  by the replica's longest recent reply), read once from the body.
- A `Wait(drop_window=True)` takes the session's window back before it waits; so does
  a `Reject`: a session never holds a window while it waits or after it was refused.
- Expired windows are purged lazily, by whichever acquire, wake, release or look at
  the state comes next; purging a window wakes a waiter.
- An `Admit` with `reprice_above` (priced at the body's upper bound) gets its exact
  price from a prefix probe beside the forwarded turn once the windows hold more blocks.
- A route without a prompt (`GET /v1/models`) is admitted `open` with no probe and no
  session bookkeeping (`_grant_unbooked`): it neither opens nor renews a window. A
  lease released with `served=False` (no prompt was served) ends the window its
  admission opened.
- Every window end is counted in `kvgate_window_ends_total{replica,cause}`; an idle
  window ends when its session goes quiet (`SessionBook`), and a waiter whose policy
  names a `recheck_sec` (the work-conserving rule) re-decides by then.
- A prompt turn whose body proves it longer than the replica's `max_model_len`
  (`request_body.over_long`, from the last usage reading) is refused before the policy
  decides: no prefix probe, never forwarded (in `shadow` mode it is recorded as
  `shadow_prompt_too_long`, unprobed, and forwarded).
- A held turn whose caller offers other replicas (`elsewhere`) moves to one with nothing
  to do once it has waited its re-prefill (`gate/relocation.py`): its window here ends
  first, then `SessionRelocated` names that replica; it leaves no waiter or attempt here.
- mode `off`: admit `open` with no probe and no session bookkeeping
  (`_grant_unbooked`). mode `shadow`: decide as `enforce` would (windows included),
  record `shadow_<reason>` (`shadow_wait`, `shadow_prompt_too_long`), never hold or
  reject.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import Histogram

from kvgate.gate.book import SessionBook, SessionRecord, WindowEnd
from kvgate.gate.errors import (
    AdmissionError,
    AdmissionSuperseded,
    AdmissionTimeout,
    PromptTooLong,
    ReplicaUnavailable,
    SessionRelocated,
)
from kvgate.gate.metrics import GateMetrics
from kvgate.gate.pins import PinReleases, pin_session, pin_ttl, wants_pin
from kvgate.gate.policies.registry import Policy, get_policy
from kvgate.gate.policies.vocabulary import (
    PREFIX_UNAVAILABLE,
    AdmissionReason,
    Admit,
    Decision,
    ProbeFirst,
    Reject,
    Wait,
)
from kvgate.gate.probe import Probe
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.relocation import CLAIM_SEC, Elsewhere, relocation_due_sec
from kvgate.gate.repricing import Repricer, RepriceRequest, TurnNote
from kvgate.gate.request_body import (
    TEMPLATE_MARGIN_TOKENS,
    body_bytes,
    body_holds_prompt,
    output_allowance,
    over_long,
    prompt_token_bound,
    turn_key,
    turn_media,
    user_text_bytes,
)
from kvgate.gate.settings import GateSettings
from kvgate.gate.turn_facts import TurnFacts
from kvgate.wire.kv_pins import Pin
from kvgate.wire.routes import PRIORITY_FIELD_KINDS, PROMPT_KINDS

Clock = Callable[[], float]
MODES = ("enforce", "shadow", "off")
MIN_WAIT_SEC = 0.001  # a waiter never spins, whatever the settings or the clock say
# How long a held turn re-decides on its last prefix reading instead of a new probe. Its
# hits only fall while it waits (its blocks are evicted; another session computing a
# shared prefix is the exception), and fewer hits never turn a Wait into an Admit in
# either policy, so a reading that holds it still does; one that would admit it is
# confirmed by a fresh probe. Otherwise each wake costs a probe, rendered and tokenized
# on the API server the turns share, several per turn. The age bound notices a shared prefix that became resident.
HELD_READING_MAX_AGE_SEC = 1.0


class Attempt:
    """One acquire call in progress. `abort` set means: raise it at the next checkpoint.

    `event` (what wakes it) is made on its first wait: most attempts never wait.
    """

    __slots__ = ("event", "abort", "queued", "named", "queued_at", "held", "session_order")

    def __init__(self, named: bool = True) -> None:
        self.event: asyncio.Event | None = None
        self.abort: AdmissionError | None = None
        self.queued = False
        self.named = named
        self.queued_at = 0.0  # when it joined the queue (clock seconds): the oldest waiter's age
        self.held: Wait | None = None  # the last Wait decided for it: /admin/state shows why it waits
        self.session_order = 0  # its session's `SessionRecord.started`: its place in the queue (`Gate._enqueue`)

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()

    def checkpoint(self) -> None:
        if self.abort is not None:
            raise self.abort


def _queues_behind(waiter: Attempt, attempt: Attempt) -> bool:
    """`waiter` belongs behind `attempt` in the queue: its session was booked later."""
    return waiter.session_order > attempt.session_order


def _held_state(attempt: object) -> dict[str, str] | None:
    """Why a session's turn waits now (its last `Wait`), for /admin/state; None if it does not."""
    if not isinstance(attempt, Attempt) or attempt.held is None:
        return None
    return {"cause": attempt.held.cause.value, "why": attempt.held.why}


class Lease:
    """The right to have one request in flight on the replica, until `release()`.

    `priority`: the vLLM `priority` the admission asks the request to be forwarded with
    (`Admit.priority`); None: as sent. `pin`: the KV pin to forward it with (`gate.pins`);
    None: unpinned.
    """

    __slots__ = (
        "reason",
        "wait_ms",
        "replica",
        "priority",
        "pin",
        "_gate",
        "_record",
        "_attempt",
        "_released",
        "_turn",
    )

    def __init__(
        self,
        gate: Gate,
        record: SessionRecord | None,
        reason: str,
        wait_ms: float,
        attempt: Attempt | None = None,
        turn: TurnNote | None = None,
        priority: int | None = None,
    ) -> None:
        self.reason = reason
        self.priority = priority  # the vLLM `priority` to forward the request with (None: the body's own)
        self.pin: Pin | None = None  # the KV pin to forward it with (gate/pins.py)
        self.wait_ms = wait_ms
        self.replica = gate.name
        self._gate = gate
        self._record = record
        self._attempt = attempt
        self._released = False
        self._turn = turn

    def learn(self, prompt_tokens: int, cached_tokens: int | None, output_tokens: int | None = None) -> None:
        """The served turn's usage, as the replica reported it (before `release()`): its
        exact prompt size, the prompt tokens its prefix cache held and the tokens it
        generated (None: not reported). No-op after release and for a turn without a session."""
        if not self._released and self._record is not None and self._turn is not None:
            self._gate._repricer.learn(self._record, self._turn, prompt_tokens, cached_tokens, output_tokens)

    def end_run(self) -> None:
        """The turn's reply ended its agent's run (it called no tool where it could have:
        proxy/reply_end.py): the session's window ends (cause `final_reply`; `SessionBook.end_run`).
        No-op after release and for a turn without a session."""
        if not self._released and self._record is not None:
            self._gate.end_run(self._record)

    @property
    def released(self) -> bool:
        return self._released

    def release(self, served: bool = True) -> None:
        """End the lease (response fully relayed, client gone or upstream failed). Idempotent.

        served False: no prompt was served (the upstream could not be reached, failed
        before answering, or answered an error status): a window this turn's admission
        opened ends (`revoked`), so a failed turn leaves no new window behind.
        """
        if self._released:
            return
        self._released = True
        self._gate._release(self._record, self._attempt, served)

    def __repr__(self) -> str:
        return f"Lease({self.replica!r}, {self.reason!r}, released={self._released})"


def _prompt_bound(
    record: SessionRecord, route_kind: str, body: Mapping[str, object], body_size: int | None
) -> int | None:
    """The turn's prompt bound (`prompt_token_bound`): its body's bytes (`body_size`, the
    JSON the caller forwards; else one compact encoding of `body`) plus the template's
    margin, None if the body carries media. Media is looked for in the history items the
    earlier turns of its session's thread did not show (`turn_media`), so an agent's turn
    costs the same whatever its history's length; a body of another shape has its bytes
    read whole."""
    read = turn_media(route_kind, body, record.history_media)
    if read is None:
        return prompt_token_bound(orjson.dumps(body))
    media, record.history_media = read
    if media:
        return None
    return (body_size if body_size is not None else len(orjson.dumps(body))) + TEMPLATE_MARGIN_TOKENS


@dataclass(slots=True)
class _Turn:
    """One `Gate.acquire`'s state across its re-evaluations: what the body said (read
    once), the booked attempt, and the prefix reading of its last decision with when it was
    read (a held turn decides again on it first while it is recent)."""

    attempt: Attempt
    record: SessionRecord | None
    route_kind: str
    body: Mapping[str, object]
    allowance: int
    bound: int | None
    priority_field: bool
    start: float
    held_on: PrefixReading | None = None
    held_on_at: float = 0.0
    kept_bytes: int | None = None  # the user text every rendering keeps, counted when first needed

    def refusal(self, usage: UsageReading) -> Reject | None:
        """The `prompt_too_long` refusal the body alone proves (`over_long`), else None. The
        user's text is part of the body's bytes: a body whose encoding (`bound`) is short
        enough is never refused, and its text is not counted."""
        if usage.max_model_len is None or not usage.max_token_bytes:
            return None
        if self.kept_bytes is None:
            if (
                self.bound is not None
                and over_long(body_bytes(self.bound), usage.max_model_len, usage.max_token_bytes) is None
            ):
                return None
            self.kept_bytes = user_text_bytes(self.route_kind, self.body)
        return over_long(self.kept_bytes, usage.max_model_len, usage.max_token_bytes)


class Gate:
    def __init__(
        self,
        name: str,
        probe: Probe,
        settings: GateSettings,
        metrics: GateMetrics,
        clock: Clock = time.monotonic,
        policy: Policy | None = None,
        on_idle: Callable[[str], None] | None = None,
    ) -> None:
        if settings.mode not in MODES:
            raise ValueError(f"unknown gate.mode {settings.mode!r}; choose one of: {', '.join(MODES)}")
        self.name = name
        self.probe = probe
        self.settings = settings
        self.policy = policy or get_policy(settings.policy)
        self._prices_bodies = self.policy.reads_prompt_bound
        self._usage: UsageReading | None = None  # the last usage reading a decision was made on
        self._now = clock
        self._book = SessionBook(
            settings.idle_grace_sec, settings.quiet_factor, settings.quiet_floor_sec, settings.late_floor_sec
        )
        self._window_ends = {cause: metrics.window_ends.labels(name, cause) for cause in WindowEnd}
        self._queue: OrderedDict[Attempt, None] = OrderedDict()  # waiters, the oldest session's first
        # ordered (a dict, not a set): close() fails them in queue order, the same every run
        self._attempts: dict[Attempt, None] = {}
        self._closed: AdmissionError | None = None
        self._bind_metrics(metrics, name)
        # gate/relocation.py: called when a release leaves no lease out and no waiter; a moving turn's claim
        self._on_idle, self._claimed_until = on_idle, float("-inf")
        self._changed_at = float("-inf")  # last release, finish or expiry that may free blocks
        self._retry_after = max(1, math.ceil(settings.wait_poll_sec))
        self._max_wait = settings.max_wait_sec if settings.max_wait_sec > 0 else None
        self._repricer = Repricer(
            self._book,
            self.policy,
            settings,
            probe,
            clock,
            lambda: self._usage,
            metrics.reprefill_tokens.labels(name),
            self._window_shrank,
        )
        self._pins = PinReleases(self._send_pin_releases)  # KV pins this gate holds (gate/pins.py)
        # A probe that can tell its usage reading without waiting gives the calm path
        # (`_calm_lease`); one that cannot (the tests' fakes may not) leaves every turn to the full one.
        self._ready_usage: Callable[[], UsageReading | None] | None = getattr(probe, "ready_usage", None)
        # A probe that refreshes its reading in the background is asked to at each release, so
        # the next turn finds a reading it may use at once (`UsageCache.revalidate`).
        self._revalidate_usage: Callable[[], None] | None = getattr(probe, "revalidate_usage", None)

    def _bind_metrics(self, metrics: GateMetrics, name: str) -> None:
        """The replica's series of the gate's metric families, bound once."""
        self._metrics = metrics
        self._waiters_gauge = metrics.waiters.labels(name)
        # The window gauges read the book when scraped: no gauge (and its lock) on a turn's path.
        self._window_gauges = (metrics.windows.labels(name, "in_flight"), metrics.windows.labels(name, "idle"))
        self._window_gauges[0].set_function(lambda: self._book.windows_in_flight)
        self._window_gauges[1].set_function(lambda: self._book.windows_idle)
        self._superseded = metrics.superseded_attempts.labels(name)
        self._relocated = metrics.relocated_turns.labels(name)
        held = metrics.held_turns
        self._held_turns = {True: held.labels(name, "window"), False: held.labels(name, "no_window")}
        # Operator metrics (docs/observability.md): wait by reason, oldest waiter, re-prefill.
        self._reason_wait_metric = metrics.admission_reason_wait
        self._reason_waits: dict[str, Histogram] = {}
        self._oldest_waiter = metrics.oldest_waiter_seconds.labels(name)
        self._oldest_waiter.set_function(self.oldest_waiter_age)

    # ------------------------------------------------------------------ acquire

    async def acquire(
        self,
        session_key: str | None,
        route_kind: str,
        body: Mapping[str, object],
        elsewhere: Elsewhere | None = None,
        body_size: int | None = None,
    ) -> Lease:
        """Admit one request of `session_key` (None: anonymous) or raise an AdmissionError;
        `elsewhere`: the other replicas a held turn may move to (`SessionRelocated`);
        `body_size`: the bytes of the JSON `body` is forwarded as, when the caller has them
        (the prompt's bound reads them instead of encoding `body` again)."""
        if self._closed is not None:
            raise self._closed
        # A route without a prompt (GET /v1/models) never touches the session books: it
        # neither opens nor renews a window.
        if self.settings.mode == "off" or route_kind not in PROMPT_KINDS:
            return self._grant_unbooked()
        start = self._now()
        self._purge(start)
        turn = self._new_turn(session_key, route_kind, body, start, body_size)
        lease = self._calm_lease(turn)
        if lease is not None:
            return lease
        self._book_turn(turn)
        deadline = start + self._max_wait if self._max_wait is not None else None
        newer_than: float | None = None  # a re-evaluation needs usage read after the last release
        try:
            while True:  # read -> decide -> act, until admitted, refused or timed out
                turn.attempt.checkpoint()
                usage = await self.probe.usage(newer_than)
                turn.attempt.checkpoint()
                if usage is not None:
                    self._usage = usage
                decision, prefix = self._calm_decision(turn, usage), None
                if decision is None:
                    decision, prefix = await self._decide_turn(turn, usage)
                outcome = self._act(turn, decision, prefix, usage)
                if isinstance(outcome, Lease):
                    return outcome
                recheck = outcome.recheck_sec
                if elsewhere is not None:
                    due = self._relocate(turn, elsewhere)
                    recheck = recheck if due is None else due if recheck is None else min(recheck, due)
                await self._wait(turn.attempt, deadline, recheck)
                newer_than = self._changed_at
        finally:
            self._close_turn(turn)

    def _new_turn(
        self,
        session_key: str | None,
        route_kind: str,
        body: Mapping[str, object],
        start: float,
        body_size: int | None = None,
    ) -> _Turn:
        """Read what the body says once; nothing is booked yet. A named turn carries its
        session's record, or a new one if the gate has none (booked when the turn is)."""
        allowance = self._book.output_price(output_allowance(body))
        record = None if session_key is None else self._book.records.get(session_key) or SessionRecord(session_key)
        # Only named turns are priced. A body that does not hold its whole prompt (a
        # Responses continuation) has no bound.
        bound = (
            _prompt_bound(record, route_kind, body, body_size)
            if record is not None and self._prices_bodies and body_holds_prompt(route_kind, body)
            else None
        )
        return _Turn(
            attempt=Attempt(named=session_key is not None),
            record=record,
            route_kind=route_kind,
            body=body,
            allowance=allowance,
            bound=bound,
            priority_field=route_kind in PRIORITY_FIELD_KINDS,
            start=start,
        )

    def _book_turn(self, turn: _Turn) -> None:
        """Book the turn's attempt as acquiring (superseding its session's older one of the
        same turn); a new session's record is the book's from then on."""
        if turn.record is not None:
            route_kind, body = turn.route_kind, turn.body
            # the turn's key (a digest of its prompt) is computed only if another attempt of the session acquires
            turn.record, previous = self._book.begin_attempt(
                turn.record.key, turn.attempt, turn.start, lambda: turn_key(route_kind, body), new=turn.record
            )
            if isinstance(previous, Attempt):  # the book keeps this gate's attempts
                self._supersede(previous)
        self._attempts[turn.attempt] = None
        # an anonymous turn queues behind the sessions seen so far, ahead of those seen later
        turn.attempt.session_order = turn.record.started if turn.record is not None else self._book.sessions_started

    def _calm_lease(self, turn: _Turn) -> Lease | None:
        """The calm path: the lease of a named turn the policy's calm rule admits the moment
        it arrives, or None (book the attempt and decide in full). Taken only with a usage
        reading the probe has at once (`ready_usage`: no probe is awaited) and when no other
        attempt of the session acquires (they are ordered by the full path); the books end
        as the full path's admission leaves them (`SessionBook.admit`, `arriving`)."""
        ready_usage = self._ready_usage
        record = turn.record
        if ready_usage is None or record is None or record.attempts:
            return None
        usage = ready_usage()
        decision = self._calm_decision(turn, usage)
        if decision is None:
            return None
        self._usage = usage
        outcome = self._act(turn, decision, None, usage)
        assert isinstance(outcome, Lease), "the calm rule only admits"
        return outcome

    def _turn_view(self, turn: _Turn, usage: UsageReading | None) -> Any:
        return self._view(turn.record, turn.attempt, turn.allowance, turn.bound, usage, turn.start, turn.priority_field)

    def _calm_decision(self, turn: _Turn, usage: UsageReading | None) -> Decision | None:
        """The policy's calm rule (`Policy.calm`) on a named turn with no waiter at the gate
        (so none ahead of it): the decision the full one would be, read off a few O(1)
        facts, or None to decide in full (also for a prompt the body proves too long: the
        full decision refuses it)."""
        calm = self.policy.calm
        if calm is None or self._queue or turn.record is None or usage is None:
            return None
        if turn.refusal(usage) is not None:
            return None
        facts = TurnFacts(
            self._book,
            turn.record,
            turn.allowance,
            turn.bound,
            lambda: 0,
            usage,
            self._now(),
            turn.start,
            turn.priority_field,
        )
        return calm((self.policy.calm_view or self.policy.view)(facts), usage, self.settings)

    async def _decide_turn(self, turn: _Turn, usage: UsageReading | None) -> tuple[Decision, PrefixReading | None]:
        """The policy's decision on this reading, probing the prefix only when it asks to;
        returns the decision and the prefix read for it (None: not probed or unavailable)."""
        view = self._turn_view(turn, usage)
        # A prompt the body alone proves too long is refused before any probe.
        refusal = turn.refusal(usage) if usage else None
        first = refusal or self.policy.decide(view, usage, None, self.settings)
        if not isinstance(first, ProbeFirst):
            return first, None
        if turn.held_on is not None and self._now() - turn.held_on_at < HELD_READING_MAX_AGE_SEC:
            # a held turn decides again on its recent reading first (see HELD_READING_MAX_AGE_SEC)
            decision = self.policy.decide_read(view, usage, turn.held_on, self.settings)
            if isinstance(decision, Wait):
                return decision, None
        probed_at = self._now()
        try:
            prefix = await self.probe.prefix(turn.route_kind, turn.body)
        except PromptTooLong:  # the replica refused to render it: longer than it serves
            self._drop_window(turn.record, WindowEnd.REVOKED)
            raise
        self._book.observe_prefix_probe(self._now() - probed_at)  # what the next probe may cost
        turn.attempt.checkpoint()
        view = self._turn_view(turn, usage)  # windows may have changed during the probe
        answer = PREFIX_UNAVAILABLE if prefix is None else prefix
        decision = self.policy.decide_read(view, usage, answer, self.settings)
        turn.held_on, turn.held_on_at = prefix, self._now()
        return decision, prefix

    def _act(
        self, turn: _Turn, decision: Decision, prefix: PrefixReading | None, usage: UsageReading | None
    ) -> Lease | Wait:
        """Carry out the decision: a lease (admitted, or shadow mode), PromptTooLong, or the
        Wait the attempt now holds on (its window dropped first if the decision says so)."""
        record, attempt = turn.record, turn.attempt
        tokens = prefix.total_tokens if prefix is not None else None
        if (
            prefix is not None
            and record is not None
            and (self.settings.mode == "shadow" or isinstance(decision, Admit))
        ):
            self._repricer.count_reprefill(record.prompt_tokens, prefix, usage)
        previous_tokens, previous_window = (record.prompt_tokens, record.admitted_window) if record else (None, None)
        hit_blocks = prefix.hit_blocks if prefix is not None else None
        note = TurnNote(turn.allowance, turn.bound, prefix is not None, previous_tokens, previous_window, hit_blocks)
        if self.settings.mode == "shadow":
            return self._grant_shadow(turn, decision, tokens, note)
        if isinstance(decision, Admit):
            lease = self._admit(turn, decision, tokens, note)
            lease.pin = self._pin_for(turn, decision)
            if decision.reprice_above is not None and self._book.window_blocks > decision.reprice_above:
                request = RepriceRequest(turn.route_kind, turn.body, turn.allowance, usage, turn.bound)
                self._repricer.admitted_at_bound(record, request, turns_wait=bool(self._queue))
            return lease
        # A window that another turn of the session is using stays (it ends with its turns).
        shared = record is not None and record.in_flight > 0
        if isinstance(decision, Reject):
            if not shared:
                self._drop_window(record, WindowEnd.REVOKED)
            raise PromptTooLong(decision.message)
        if decision.drop_window and not shared:
            self._drop_window(record)
        attempt.held = decision
        return decision

    def _relocate(self, turn: _Turn, elsewhere: Elsewhere) -> float | None:
        """Move the held turn to a replica with nothing to do once it is due (`gate/relocation.py`):
        its window here ends and `SessionRelocated` names the replica. Else the seconds until it
        is due, where one is idle now (None: it waits as decided)."""
        record = turn.record
        usage = self._usage
        if record is None or record.in_flight or len(record.attempts) > 1:  # not its session's only turn here
            return None
        if self.settings.mode != "enforce" or not self.settings.relocate_held:
            return None
        tokens = (turn.held_on.total_tokens if turn.held_on is not None else 0) or record.prompt_tokens
        due = relocation_due_sec(tokens, usage.prefill_tokens_per_sec if usage else None, self._now() - turn.start)
        peer = None if due is None else elsewhere.idle_replica()
        if due is None or peer is None:
            return None
        if due > MIN_WAIT_SEC:  # (a shorter wait than the shortest is none)
            return due
        elsewhere.claim(peer)
        self._drop_window(record, WindowEnd.REVOKED)
        self._relocated.inc()
        raise SessionRelocated(peer)

    @property
    def idle(self) -> bool:
        """Enforcing, with no lease out, no waiter, and no moved turn on its way (`claim`)."""
        return (
            self.settings.mode == "enforce"
            and not self._book.leases
            and not self._queue
            and self._now() >= self._claimed_until
        )

    def claim(self) -> None:
        """A held turn of another replica moves here: not idle until it arrives (CLAIM_SEC at most)."""
        self._claimed_until = self._now() + CLAIM_SEC

    def wake_waiters(self) -> None:
        """Every waiter decides again now (this replica or another went idle)."""
        for waiter in self._queue:
            waiter.wake()

    def _close_turn(self, turn: _Turn) -> None:
        """The attempt leaves the gate's books, whatever ended it."""
        attempt, record = turn.attempt, turn.record
        self._attempts.pop(attempt, None)
        if attempt.queued:
            self._leave_queue(attempt)
        if record is not None:
            ended = self._book.end_attempt(record, attempt, self._now())
            if ended is not None:
                self._session_ended(ended)
            self._publish_windows()

    def _view(
        self,
        record: SessionRecord | None,
        attempt: Attempt,
        allowance: int,
        bound: int | None,
        usage: UsageReading | None,
        start: float,
        priority_field: bool,
    ) -> Any:
        """The view the policy reads, built from this turn's facts (`TurnFacts`)."""
        facts = TurnFacts(
            self._book,
            record,
            allowance,
            bound,
            lambda: self._waiters_ahead(attempt),
            usage,
            self._now(),
            start,
            priority_field,
        )
        return self.policy.view(facts)

    def _waiters_ahead(self, attempt: Attempt) -> int:
        """Named waiters queued before `attempt`, or that would be if it queued now. O(queue)."""
        ahead = 0
        for waiter in self._queue:
            if waiter is attempt or (not attempt.queued and _queues_behind(waiter, attempt)):
                break
            ahead += waiter.named
        return ahead

    def _grant_shadow(self, turn: _Turn, decision: Decision, tokens: int | None, note: TurnNote) -> Lease:
        """Admit whatever was decided, recorded as `shadow_<reason>`: an Admit is booked as
        enforce would book it (its window and footprint), a Wait or Reject as an admission
        without a window. A shadow admission wakes no waiter of its own accord and is
        forwarded as sent (no priority)."""
        if isinstance(decision, Admit):
            booked = Admit(decision.reason, window=decision.window, footprint=decision.footprint)
            return self._grant(turn, f"shadow_{decision.reason}", booked, tokens, note)
        label = "shadow_wait" if isinstance(decision, Wait) else f"shadow_{decision.code}"
        return self._grant(turn, label, None, tokens, note)

    def _admit(self, turn: _Turn, decision: Admit, tokens: int | None, note: TurnNote) -> Lease:
        """Grant the lease the policy's Admit asks for, as it asks (idle windows it ends,
        window, footprint, wake-up, priority)."""
        record = turn.record
        if record is not None and turn.attempt.held is not None and not record.has_window:
            self._observe_held(turn.attempt, decision)
        if decision.reclaim_blocks and record is not None:
            self._book.reclaim_late_windows(record, decision.reclaim_blocks, self._now())
            self._publish_windows()
        return self._grant(turn, decision.reason.value, decision, tokens, note)  # plain str: a JSON key in /admin/state

    def _observe_held(self, attempt: Attempt, decision: Admit) -> None:
        """A held newcomer is admitted: did the wait give it a window
        (`HoldingValue.held_got_window`)? One let in without a window while named waiters
        were still ahead of it says nothing of that: the policy chose not to wait for its
        turn at a window (counted, each such admission would lower the value of holding
        measured here, which lets more turns in without a window, which lowers it again)."""
        if not decision.window and self._waiters_ahead(attempt):
            return
        self._book.holding.observe_held(decision.window)
        self._held_turns[decision.window].inc()

    def _grant(self, turn: _Turn, label: str, admit: Admit | None, tokens: int | None, note: TurnNote) -> Lease:
        """Book `turn`'s admission under `label` (its `x-kvgate-admission` value) and hand out its lease.

        admit: what is booked with it (None: nothing but the admission): the session's
        window for the turn (`Admit.window`, `Admit.footprint`), whether to wake the next
        waiter too (`Admit.wake_next`; a queued attempt that is admitted always does, since
        the head of the queue moved), the vLLM priority to forward it with (`Admit.priority`).
        tokens: the prompt size of the turn's prefix reading, recorded as the session's size
        (with `note.bound`, the turn's body-length bound, which later turns' bounds are measured
        from); `note` stays with the lease, for what the turn's usage teaches (`Lease.learn`).
        """
        record, attempt = turn.record, turn.attempt
        window, footprint = (admit.window, admit.footprint) if admit is not None else (False, None)
        now = self._now()
        wait = max(0.0, now - turn.start)
        committed = self._book.window_blocks if record is not None else 0
        arriving = attempt not in self._attempts  # the calm path: the attempt is booked with its admission
        self._book.admit(record, attempt, label, now, window, footprint, tokens, note.bound, arriving)
        if record is not None and self._book.window_blocks < committed:
            self._blocks_freed(now)  # a window shrank or ended: a waiter may fit now
        self._count_admission(label, wait)
        if record is not None:
            self._publish_windows()
        if self._queue and (attempt.queued or (admit is not None and admit.wake_next)):
            if attempt.queued:
                self._dequeue(attempt)
            self._wake_one()
        priority = admit.priority if admit is not None else None
        return Lease(self, record, label, wait * 1000.0, attempt, note, priority)

    def _pin_for(self, turn: _Turn, decision: Admit) -> Pin | None:
        """The KV pin an admitted turn goes out with (`gate/pins.py`), None: unpinned."""
        record = turn.record
        if record is None or not wants_pin(self.settings.pins, self._usage, turn.route_kind, decision.window):
            return None
        make_pin = getattr(self.probe, "pin", None)  # the probe holds the replica key that proves it
        if make_pin is None:
            return None
        self._pins.pinned_turn(record.key)
        ttl = pin_ttl(self._book.late_after_sec(record), self.settings.idle_grace_sec)
        return make_pin(pin_session(record.key), ttl)

    def _unpin_ended_windows(self) -> None:
        """Release the pins of windows that ended, unless a turn of the session is in flight
        (it pins when it ends: `_release` releases after it)."""
        for key in self._book.take_ended_window_keys():
            record = self._book.records.get(key)
            if record is None or not (record.in_flight or record.has_window):
                self._pins.end(key)

    async def _send_pin_releases(self, sessions: tuple[str, ...]) -> None:
        release = getattr(self.probe, "release_pins", None)
        if release is not None:
            await release(sessions)
            # Only now are the pins' blocks free in the engine: the waiters woken when
            # their windows ended decided on readings that still counted them pinned.
            self._blocks_freed(self._now())

    def _grant_unbooked(self) -> Lease:
        """Admit `open` with nothing booked but the lease (mode off, or a route without a
        prompt): no probe, no session, no window, no waiter woken."""
        self._book.leases += 1
        self._count_admission(AdmissionReason.OPEN.value, 0.0)
        return Lease(self, None, AdmissionReason.OPEN.value, 0.0)

    def _count_admission(self, label: str, wait: float) -> None:
        """One observation per admission (`kvgate_admissions_total` and the wait histogram by
        replica are summed from it when scraped: `metrics.AdmissionTotals`)."""
        reason_wait = self._reason_waits.get(label)
        if reason_wait is None:
            reason_wait = self._reason_waits[label] = self._reason_wait_metric.labels(self.name, label)
        reason_wait.observe(wait)

    # --------------------------------------------------------------------- wait

    async def _wait(self, attempt: Attempt, deadline: float | None, recheck: float | None = None) -> None:
        if attempt.event is None:
            attempt.event = asyncio.Event()
        if not attempt.queued:
            self._enqueue(attempt)
            attempt.queued = True
            attempt.queued_at = self._now()
            self._waiters_gauge.set(len(self._queue))
            self._repricer.reprice_unpriced()
        now = self._now()
        timeout: float | None = None
        # The head polls (liveness: see the module docstring); behind it, a waiter whose
        # Wait says nothing unseen can change its decision waits to be woken.
        if attempt.held is None or attempt.held.poll or next(iter(self._queue)) is attempt:
            timeout = self.settings.wait_poll_sec
            expiry = self._book.next_expiry(now)
            if expiry is not None and expiry > now:
                timeout = min(timeout, expiry - now)
        if deadline is not None:
            if now >= deadline:
                raise AdmissionTimeout(
                    f"not admitted to replica {self.name} within gate.max_wait_sec="
                    f"{self.settings.max_wait_sec}s (its KV cache is under pressure); retry later",
                    retry_after=self._retry_after,
                )
            timeout = deadline - now if timeout is None else min(timeout, deadline - now)
        if recheck is not None:
            timeout = recheck if timeout is None else min(timeout, recheck)
        try:
            async with asyncio.timeout(None if timeout is None else max(timeout, MIN_WAIT_SEC)):
                await attempt.event.wait()
        except TimeoutError:
            pass
        # purge first: a window it ends wakes waiters, this one included, which is awake already
        self._purge(self._now())
        attempt.event.clear()
        attempt.checkpoint()

    def _enqueue(self, attempt: Attempt) -> None:
        """Queue `attempt` behind every waiter whose session started no later than its own,
        ahead of the rest (their order kept). O(queue)."""
        younger = [w for w in self._queue if _queues_behind(w, attempt)]
        self._queue[attempt] = None
        for waiter in younger:
            self._queue.move_to_end(waiter)

    def _leave_queue(self, attempt: Attempt) -> None:
        """A waiter leaves without a lease (cancelled, superseded, timed out, rejected)."""
        was_head = next(iter(self._queue), None) is attempt
        self._dequeue(attempt)
        if was_head and self._queue:
            self._wake_one()  # the next waiter heads the queue: it must not wait for a poll

    def _dequeue(self, attempt: Attempt) -> None:
        if self._queue.pop(attempt, False) is None:
            self._waiters_gauge.set(len(self._queue))
        attempt.queued = False

    def _wake_one(self) -> None:
        """Wake the first waiter not awake already, in queue order. One behind the head
        whose last Wait said `poll=False` is passed over: nothing but its place, which this
        wake-up does not give it, can change its decision. The head is never passed over."""
        head = True
        for waiter in self._queue:
            event = waiter.event  # queued waiters always have one (made before queueing)
            if event is not None and not event.is_set():
                if head or waiter.held is None or waiter.held.poll:
                    event.set()
                    return
            head = False

    def _supersede(self, previous: Attempt) -> None:
        previous.abort = AdmissionSuperseded(
            "a newer request of the same session arrived while this one waited for admission; "
            "only the newest attempt of a session is served"
        )
        if previous.queued:
            self._leave_queue(previous)
        previous.wake()
        self._superseded.inc()

    # ------------------------------------------------------------- windows/leases

    def _release(self, record: SessionRecord | None, attempt: Attempt | None = None, served: bool = True) -> None:
        if record is not None:
            self._repricer.forget(record)
        now = self._changed_at = self._now()
        if attempt is not None and self._revalidate_usage is not None:  # a booked turn ended: blocks changed
            self._revalidate_usage()
        ended = self._book.release(record, now, attempt, served)
        if ended is not None:
            self._session_ended(ended)
        if record is not None and not (record.in_flight or record.has_window):
            self._pins.end(record.key)  # its window ended while a turn of it was in flight
        self._purge(now)
        if record is not None:
            self._publish_windows()
        if self._queue:
            if self._book.leases:
                self._wake_on_change()
            else:  # the replica went idle: every held turn's economics changed
                self.wake_waiters()
        elif not self._book.leases and self._on_idle is not None:
            self._on_idle(self.name)  # other replicas' held turns may move here

    def _window_shrank(self) -> None:
        """A window's price went down (`Repricer.apply_price`): its blocks may let a waiter in."""
        self._blocks_freed(self._now())
        self._publish_windows()

    def _blocks_freed(self, now: float) -> None:
        """Fewer blocks are committed (or live): let the head waiter re-decide on a fresh reading."""
        self._changed_at = now
        if self._queue:
            self._wake_on_change()

    def _wake_on_change(self) -> None:
        """Blocks were freed: wake the head waiter, and every waiter whose last Wait asked to
        re-decide on any such change (`Wait.wake_on_release`), not at its next poll."""
        self._wake_one()
        for waiter in self._queue:
            if waiter.held is not None and waiter.held.wake_on_release:
                waiter.wake()

    def _drop_window(self, record: SessionRecord | None, cause: WindowEnd = WindowEnd.LOST) -> None:
        """Take a session's window back (working_set: it no longer fits, or its prompt never will)."""
        if record is None:
            return
        now = self._now()
        if self._book.drop_window(record, now, cause):
            self._publish_windows()
            self._blocks_freed(now)

    def end_run(self, record: SessionRecord) -> None:
        """A reply ended the session's agent run: its window ends, unless the session goes on after such replies."""
        now = self._now()
        if self._book.end_run(record, now):
            self._publish_windows()
            self._blocks_freed(now)

    def finish_session(self, session_key: str, cause: WindowEnd = WindowEnd.FINISH) -> None:
        """End the session's window here; no-op for a session this gate does not know."""
        had_window, ended = self._book.finish(session_key, self._now(), cause)
        if ended is not None:
            self._session_ended(ended)
        self._publish_windows()
        if had_window:
            self._blocks_freed(self._now())

    def _purge(self, now: float) -> None:
        if not self._book.idle:
            return
        ended, windows_ended = self._book.purge(now)
        if not ended and not windows_ended:
            return
        for record in ended:
            self._session_ended(record)
        self._publish_windows()
        if windows_ended:
            self._blocks_freed(now)

    def _session_ended(self, record: SessionRecord) -> None:
        self._metrics.session_supersessions.observe(record.num_superseded)

    def _publish_windows(self) -> None:
        """Count the windows ended since the last call (`kvgate_window_ends_total`); the
        window gauges (`kvgate_windows`) read the book when scraped."""
        if self._book._new_window_ends:
            for cause in self._book.take_window_ends():
                self._window_ends[cause].inc()
            self._unpin_ended_windows()

    # -------------------------------------------------------------------- close

    def close(self, message: str) -> None:
        """The replica is gone: fail every acquiring attempt with ReplicaUnavailable.

        Leases still out keep working (release is still required); from now on every
        record ends as soon as it is idle.
        """
        self._closed = ReplicaUnavailable(message, retry_after=1)
        for attempt in list(self._attempts):
            attempt.abort = ReplicaUnavailable(message, retry_after=1)
            if attempt.queued:
                self._dequeue(attempt)
            attempt.wake()
        self._book.grace = 0.0
        for key in list(self._book.records):
            self.finish_session(key, WindowEnd.REVOKED)
        self._purge(self._now())
        self._waiters_gauge.set(0)
        self._oldest_waiter.set_function(lambda: 0.0)  # let go of this gate
        self._repricer.close()
        self._pins.close()
        for gauge in self._window_gauges:  # every window ended above
            gauge.set_function(lambda: 0.0)
        close_probe = getattr(self.probe, "close", None)
        if close_probe is not None:
            close_probe()

    # ------------------------------------------------------------ operator metrics

    def oldest_waiter_age(self) -> float:
        """Seconds the longest-queued waiter has waited (0 when none); read at scrape time."""
        # O(queue): the head is the oldest session's turn, not always the longest queued
        oldest = min((waiter.queued_at for waiter in self._queue), default=None)
        return max(0.0, self._now() - oldest) if oldest is not None else 0.0

    # ------------------------------------------------------------ introspection

    def live_sessions(self) -> int:
        """The named sessions booked on this replica: acquiring, in flight, or idle for less than
        `idle_grace_sec` and not finished (expired ones purged first)."""
        self._purge(self._now())
        return len(self._book.records)

    def counts(self) -> dict[str, int]:
        """Live objects, for leak checks: all zero when nothing is in flight or held."""
        self._purge(self._now())
        return {
            "leases": self._book.leases,
            "windows": self._book.windows_in_flight + self._book.windows_idle,
            "waiters": len(self._queue),
            "attempts": len(self._attempts),
            "sessions": len(self._book.records),
        }

    def state(self) -> dict[str, Any]:
        """This gate's part of /admin/state."""
        self._purge(self._now())
        now = self._now()
        in_flight: list[str] = []
        idle: list[str] = []
        for key, rec in self._book.windows.items():  # oldest window first
            (in_flight if rec.in_flight else idle).append(key)
        sessions = {key: self._session_state(rec, now) for key, rec in self._book.records.items()}
        waiters = [k for k, rec in self._book.records.items() if any(a in self._queue for a in rec.attempts.values())]
        anonymous_waiting = sum(1 for waiter in self._queue if not waiter.named)
        return {
            "mode": self.settings.mode,
            "policy": self.policy.name,
            "closed": self._closed is not None,
            "leases": self._book.leases,
            "windows": {"in_flight": in_flight, "idle": idle},
            "window_blocks": self._book.window_blocks,
            "repricing": self._repricer.probes_in_flight,
            "waiters": waiters,
            "waiters_anonymous": anonymous_waiting,
            "sessions": sessions,
            "window_ends": dict(self._book.window_ends),
            "replica_gap_sec": None if self._book.replica_gap_ewma is None else round(self._book.replica_gap_ewma, 3),
            "empty_share": round(self._book.empty_share(now), 3),
            "reply_tokens": self._book.reply_tokens,
            "holding": self._book.holding.state(),
        }

    def _session_state(self, rec: SessionRecord, now: float) -> dict[str, Any]:
        """One session's entry in /admin/state (and the status page's session rows)."""
        return {
            "reasons": dict(rec.reasons),
            "num_superseded": rec.num_superseded,
            "windows_lost": rec.windows_lost,
            "in_flight": rec.in_flight,
            "has_window": rec.has_window,
            "footprint_blocks": rec.footprint,
            "idle_sec": round(now - rec.idle_since, 3) if rec.is_idle else None,
            "gap_sec": None if rec.gap_ewma is None else round(rec.gap_ewma, 3),
            "quiet_in_sec": (
                round(rec.quiet_deadline - now, 3)
                if rec.is_idle and rec.has_window and rec.quiet_deadline is not None
                else None
            ),
            "quiet_lifetime_sec": round(self._book.quiet_lifetime(rec), 3),
            "last_window_end": rec.last_window_end,
            "goes_on_after_reply": rec.goes_on_after_reply,
            "threads": len(rec.history_media),
            "held": next((h for h in map(_held_state, rec.attempts.values()) if h is not None), None),
            "attempts": len(rec.attempts),
        }

    # The status page's reads (proxy/status_page.py): read-only, and each costs what it
    # returns, not the number of sessions (but `waiters`: one pass over the records that
    # have an attempt in progress), so a page polling every second stays cheap at 10,000.

    def session_state(self, key: str) -> dict[str, Any] | None:
        """The session's /admin/state entry, or None if this gate does not book it."""
        rec = self._book.records.get(key)
        return None if rec is None else self._session_state(rec, self._now())

    def session_keys(self, windows_only: bool = False) -> Iterator[str]:
        """The booked session keys (oldest first), or only those holding a window (oldest window first)."""
        return iter(self._book.windows if windows_only else self._book.records)

    def overview(self) -> dict[str, Any]:
        """Counts and the last usage reading, without walking the sessions."""
        book = self._book
        return {
            "mode": self.settings.mode,
            "policy": self.policy.name,
            "closed": self._closed is not None,
            "leases": book.leases,
            "windows_in_flight": book.windows_in_flight,
            "windows_idle": book.windows_idle,
            "window_blocks": book.window_blocks,
            "waiters": len(self._queue),
            "sessions": len(book.records),
            "usage": self._usage,
            "window_ends": dict(book.window_ends),
        }

    def waiters(self) -> list[dict[str, Any]]:
        """Every queued attempt, in queue order: its session key (None: anonymous),
        seconds waited, and why it waits (its last Wait), if decided."""
        now = self._now()
        keys = {attempt: key for key, rec in self._book.records.items() for attempt in rec.attempts.values()}
        out = [
            {
                "session": keys.get(waiter),
                "waited_sec": round(max(0.0, now - waiter.queued_at), 3),
                "held": _held_state(waiter),
            }
            for waiter in self._queue  # queue order: the oldest session's turn first
        ]
        return out
