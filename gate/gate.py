"""One replica's admission gate: the asyncio shell around a policy and a SessionBook.

`Gate.acquire(session_key, route_kind, body)` returns a `Lease` or raises an
`AdmissionError`. Per attempt it loops: read usage (shared, cached), build the view
the policy reads (`TurnFacts`), decide without a prefix reading; on `ProbeFirst` ask
the prefix probe and decide again with its answer (`Policy.decide_read`: never
ProbeFirst twice); then admit, reject, or wait in FIFO order until woken and decide
again. The shell carries out what the decision says (window,
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
- Waiters are woken in arrival order: one per released lease, finished, expired or
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
- The policy sees how many named waiters are ahead of the attempt (the working_set
  policy gives newcomers windows in strict FIFO order) and the request's output allowance,
  read once from the body.
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
  (`prompt_floor.over_long`, from the last usage reading) is refused before the policy
  decides: no prefix probe, never forwarded (in `shadow` mode it is recorded as
  `shadow_prompt_too_long`, unprobed, and forwarded).
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import Counter, Histogram

from kvgate.gate.book import SessionBook, SessionRecord, WindowEnd
from kvgate.gate.errors import AdmissionError, AdmissionSuperseded, AdmissionTimeout, PromptTooLong, ReplicaUnavailable
from kvgate.gate.metrics import GateMetrics
from kvgate.gate.observations import reprefill_tokens
from kvgate.gate.pins import PinReleases, pin_session, pin_ttl, wants_pin
from kvgate.gate.policies.registry import Policy, get_policy
from kvgate.gate.policies.request_body import output_allowance, prompt_token_bound
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
from kvgate.gate.prompt_floor import over_long, user_text_bytes
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.route_prompts import body_holds_prompt, turn_key
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

    __slots__ = ("event", "abort", "queued", "named", "queued_at", "held")

    def __init__(self, named: bool = True) -> None:
        self.event: asyncio.Event | None = None
        self.abort: AdmissionError | None = None
        self.queued = False
        self.named = named
        self.queued_at = 0.0  # when it joined the queue (clock seconds): the oldest waiter's age
        self.held: Wait | None = None  # the last Wait decided for it: /admin/state shows why it waits

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()

    def checkpoint(self) -> None:
        if self.abort is not None:
            raise self.abort


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

    def learn(self, prompt_tokens: int, cached_tokens: int | None) -> None:
        """The served turn's usage, as the replica reported it (before `release()`): its
        exact prompt size and the prompt tokens its prefix cache held. No-op after release
        and for a turn without a session."""
        if not self._released and self._record is not None and self._turn is not None:
            self._gate._learn(self._record, self._turn, prompt_tokens, cached_tokens)

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


# The most prompt tokens learned from a replica that states neither its max_model_len nor
# its cache size, for a turn without a body bound: far above any model's context.
LEARNED_TOKENS_CEILING = 1 << 24


def learned_tokens_cap(bound: int | None, usage: UsageReading | None) -> int:
    """The most prompt tokens a served turn's reported usage may claim: no more than its
    body's bound, the replica's max_model_len or its whole cache (a prompt that long was
    not served), so a replica reporting 2^63-1 cannot poison the session's history."""
    caps = [LEARNED_TOKENS_CEILING]
    if bound is not None:
        caps.append(bound)
    if usage is not None:
        if usage.max_model_len:
            caps.append(usage.max_model_len)
        if usage.num_total_blocks and usage.block_size:
            caps.append(usage.num_total_blocks * usage.block_size)
    return min(caps)


@dataclass(frozen=True, slots=True)
class TurnNote:
    """What the gate keeps of an admitted named turn to learn from its usage: its output
    allowance, its body-length bound, whether a prefix reading priced it, and the session's
    prompt size before this turn (what its usage shows re-prefilled is measured against
    that, not against a size this turn's own repricing probe recorded)."""

    allowance: int
    bound: int | None
    probed: bool
    previous_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class RepriceRequest:
    """What re-pricing a window admitted at its upper bound needs: the turn's body to probe
    its prefix, and the allowance, usage and bound it was admitted with."""

    route_kind: str
    body: Mapping[str, object]
    allowance: int
    usage: UsageReading | None
    bound: int | None


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
    kept_bytes: int
    priority_field: bool
    start: float
    held_on: PrefixReading | None = None
    held_on_at: float = 0.0


class Gate:
    def __init__(
        self,
        name: str,
        probe: Probe,
        settings: GateSettings,
        metrics: GateMetrics,
        clock: Clock = time.monotonic,
        policy: Policy | None = None,
    ) -> None:
        if settings.mode not in MODES:
            raise ValueError(f"unknown gate.mode {settings.mode!r}; choose one of: {', '.join(MODES)}")
        self.name = name
        self.probe = probe
        self.settings = settings
        self.policy = policy or get_policy(settings.policy)
        self._prices_bodies = self.policy.reads_prompt_bound
        self._repricing: set[asyncio.Future[None]] = set()
        # The replica reports each turn's prompt usage (`Lease.learn`): a window priced at
        # its bound gets its exact price when its turn ends, without a probe.
        self._learns_usage = False
        # Windows in flight priced at their bound whose repricing probe was left to their
        # turn's usage: probed as soon as a turn waits (over-priced windows may hold it).
        self._unpriced: dict[SessionRecord, RepriceRequest] = {}
        self._usage: UsageReading | None = None  # the last usage reading a decision was made on
        self._now = clock
        self._book = SessionBook(settings.idle_grace_sec, settings.quiet_factor, settings.quiet_floor_sec)
        self._window_ends = {cause: metrics.window_ends.labels(name, cause) for cause in WindowEnd}
        self._queue: OrderedDict[Attempt, None] = OrderedDict()  # waiters, arrival order
        # insertion-ordered (a dict, not a set): close() fails them in arrival order, the same every run
        self._attempts: dict[Attempt, None] = {}
        self._closed: AdmissionError | None = None
        self._metrics = metrics
        self._admissions: dict[str, Counter] = {}
        self._wait_hist = metrics.admission_wait.labels(name)
        self._pending_gauge = metrics.pending_sessions.labels(name)
        self._window_gauges = (
            metrics.windows.labels(name, "in_flight"),
            metrics.windows.labels(name, "idle"),
        )
        self._superseded = metrics.superseded_attempts.labels(name)
        self._published = (-1, -1)
        self._changed_at = float("-inf")  # last release, finish or expiry that may free blocks
        self._retry_after = max(1, math.ceil(settings.wait_poll_sec))
        self._max_wait = settings.max_wait_sec if settings.max_wait_sec > 0 else None
        # Operator metrics (docs/observability.md): wait by reason, oldest waiter, re-prefill.
        self._reason_wait_metric = metrics.admission_reason_wait
        self._reason_waits: dict[str, Histogram] = {}
        self._reprefill = metrics.reprefill_tokens.labels(name)
        self._oldest_waiter = metrics.oldest_waiter_seconds.labels(name)
        self._oldest_waiter.set_function(self.oldest_waiter_age)
        self._pins = PinReleases(self._send_pin_releases)  # KV pins this gate holds (gate/pins.py)

    # ------------------------------------------------------------------ acquire

    async def acquire(self, session_key: str | None, route_kind: str, body: Mapping[str, object]) -> Lease:
        """Admit one request of `session_key` (None: anonymous) or raise an AdmissionError."""
        if self._closed is not None:
            raise self._closed
        # A route without a prompt (GET /v1/models) never touches the session books: it
        # neither opens nor renews a window.
        if self.settings.mode == "off" or route_kind not in PROMPT_KINDS:
            return self._grant_unbooked()
        start = self._now()
        self._purge(start)
        turn = self._open_turn(session_key, route_kind, body, start)
        deadline = start + self._max_wait if self._max_wait is not None else None
        newer_than: float | None = None  # a re-evaluation needs usage read after the last release
        try:
            while True:  # read -> decide -> act, until admitted, refused or timed out
                turn.attempt.checkpoint()
                usage = await self.probe.usage(newer_than)
                turn.attempt.checkpoint()
                if usage is not None:
                    self._usage = usage
                decision, prefix = await self._decide_turn(turn, usage)
                outcome = self._act(turn, decision, prefix, usage)
                if isinstance(outcome, Lease):
                    return outcome
                await self._wait(turn.attempt, deadline, outcome.recheck_sec)
                newer_than = self._changed_at
        finally:
            self._close_turn(turn)

    def _open_turn(self, session_key: str | None, route_kind: str, body: Mapping[str, object], start: float) -> _Turn:
        """Read what the body says once and book the attempt (superseding its session's older one)."""
        attempt = Attempt(named=session_key is not None)
        allowance = output_allowance(body)
        kept_bytes = user_text_bytes(route_kind, body)  # the text every rendering keeps (`prompt_floor`)
        # Only named turns are priced; one compact encoding of the body bounds its prompt.
        # A body that does not hold its whole prompt (a Responses continuation) has no bound.
        bound = (
            prompt_token_bound(orjson.dumps(body))
            if session_key is not None and self._prices_bodies and body_holds_prompt(route_kind, body)
            else None
        )
        record: SessionRecord | None = None
        if session_key is not None:
            record, previous = self._book.begin_attempt(session_key, attempt, start, turn_key(route_kind, body))
            if isinstance(previous, Attempt):  # the book keeps this gate's attempts
                self._supersede(previous)
        self._attempts[attempt] = None
        return _Turn(
            attempt=attempt,
            record=record,
            route_kind=route_kind,
            body=body,
            allowance=allowance,
            bound=bound,
            kept_bytes=kept_bytes,
            priority_field=route_kind in PRIORITY_FIELD_KINDS,
            start=start,
        )

    def _turn_view(self, turn: _Turn, usage: UsageReading | None) -> Any:
        return self._view(turn.record, turn.attempt, turn.allowance, turn.bound, usage, turn.start, turn.priority_field)

    async def _decide_turn(self, turn: _Turn, usage: UsageReading | None) -> tuple[Decision, PrefixReading | None]:
        """The policy's decision on this reading, probing the prefix only when it asks to;
        returns the decision and the prefix read for it (None: not probed or unavailable)."""
        view = self._turn_view(turn, usage)
        # A prompt the body alone proves too long is refused before any probe.
        refusal = over_long(turn.kept_bytes, usage.max_model_len, usage.max_token_bytes) if usage else None
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
            self._count_reprefill(record.prompt_tokens, prefix, usage)
        previous_tokens = record.prompt_tokens if record is not None else None
        note = TurnNote(turn.allowance, turn.bound, prefix is not None, previous_tokens)
        if self.settings.mode == "shadow":
            return self._grant_shadow(record, attempt, decision, turn.start, tokens, note)
        if isinstance(decision, Admit):
            lease = self._admit(record, attempt, decision, turn.start, tokens, note)
            lease.pin = self._pin_for(turn, decision)
            if decision.reprice_above is not None and self._book.window_blocks > decision.reprice_above:
                request = RepriceRequest(turn.route_kind, turn.body, turn.allowance, usage, turn.bound)
                if not self._learns_usage or self._queue:
                    self._reprice_later(record, request)
                elif record is not None:  # its usage prices it, unless a turn must wait first
                    self._unpriced[record] = request
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

    def _learn(self, record: SessionRecord, turn: TurnNote, prompt_tokens: int, cached_tokens: int | None) -> None:
        """A served turn's usage: its exact size goes into the session's history, prices its
        window (as a repricing probe would) and, for a turn no prefix reading priced,
        counts its re-prefill."""
        self._unpriced.pop(record, None)
        if self._book.records.get(record.key) is not record:
            return
        self._learns_usage = True
        usage = self._usage
        prompt_tokens = min(prompt_tokens, learned_tokens_cap(turn.bound, usage))  # a replica's word, bounded
        cached_tokens = None if cached_tokens is None else min(cached_tokens, prompt_tokens)
        block_size = usage.block_size if usage is not None else None
        hit_blocks = cached_tokens // block_size if cached_tokens is not None and block_size else 0
        if not block_size:
            self._book.record_size(record, prompt_tokens, turn.bound)
            return
        learned = PrefixReading(prompt_tokens // block_size, hit_blocks, 0.0, prompt_tokens)
        if not turn.probed and cached_tokens is not None:
            self._count_reprefill(turn.previous_tokens, learned, usage)
        self._apply_price(record, learned, turn.allowance, usage, turn.bound)

    def _apply_price(
        self,
        record: SessionRecord,
        prefix: PrefixReading,
        allowance: int,
        usage: UsageReading | None,
        bound: int | None,
    ) -> None:
        """Price the session's window in flight at `prefix`'s exact size (a policy that prices
        windows), and record the size; wake a waiter if the window shrank."""
        price = self.policy.price
        if price is None or usage is None or not usage.has_blocks or not record.has_window or record.in_flight != 1:
            # no window to price, or one shared by concurrent turns priced together: the next turn prices it
            self._book.record_size(record, prefix.total_tokens, bound)
            return
        facts = TurnFacts(self._book, record, allowance, bound, lambda: 0, usage, self._now(), self._now())
        view = (self.policy.price_view or self.policy.view)(facts)  # what the price reads: O(1)
        footprint = max(price(view, usage, prefix, self.settings), 0)
        if self._book.reprice(record, footprint, prefix.total_tokens, bound):
            self._blocks_freed(self._now())
            self._publish_windows()

    def _reprice_unpriced(self) -> None:
        """A turn waits: the windows in flight still priced at their bound get their exact
        price from a probe now, not when their turns end."""
        unpriced, self._unpriced = self._unpriced, {}
        for record, request in unpriced.items():
            if record.in_flight:
                self._reprice_later(record, request)

    def _reprice_later(self, record: SessionRecord | None, request: RepriceRequest) -> None:
        """Get the exact price of a window admitted at its upper bound (no probe on the turn's
        path) from a prefix probe that runs beside the forwarded turn."""
        usage = request.usage
        if record is None or usage is None:  # never both with a bound price: anonymous or unknown usage
            return
        task = asyncio.ensure_future(self._reprice(record, request, usage))
        self._repricing.add(task)
        task.add_done_callback(self._repricing.discard)

    async def _reprice(self, record: SessionRecord, request: RepriceRequest, usage: UsageReading) -> None:
        try:
            prefix = await self.probe.prefix(request.route_kind, request.body)
        except PromptTooLong:  # the turn itself is refused by the replica; nothing to re-price
            return
        if prefix is None or not prefix.total_tokens:
            return
        assert self.policy.price is not None, (
            f"policy {self.policy.name} priced a window at a bound but cannot reprice it"
        )
        self._apply_price(record, prefix, request.allowance, usage, request.bound)

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
        """Named waiters queued before `attempt` (all of them if it is not queued). O(queue)."""
        ahead = 0
        for waiter in self._queue:
            if waiter is attempt:
                break
            ahead += waiter.named
        return ahead

    def _grant_shadow(
        self,
        record: SessionRecord | None,
        attempt: Attempt,
        decision: Decision,
        start: float,
        tokens: int | None,
        note: TurnNote,
    ) -> Lease:
        """Admit whatever was decided, recorded as `shadow_<reason>`: an Admit is booked as
        enforce would book it (its window included), a Wait or Reject as an admission
        without a window. A shadow admission wakes no waiter of its own accord."""
        if isinstance(decision, Admit):
            return self._grant(
                record,
                attempt,
                f"shadow_{decision.reason}",
                start,
                window=decision.window,
                footprint=decision.footprint,
                tokens=tokens,
                note=note,
            )
        label = "shadow_wait" if isinstance(decision, Wait) else f"shadow_{decision.code}"
        return self._grant(record, attempt, label, start, tokens=tokens, note=note)

    def _admit(
        self,
        record: SessionRecord | None,
        attempt: Attempt,
        decision: Admit,
        start: float,
        tokens: int | None,
        note: TurnNote,
    ) -> Lease:
        """Grant the lease the policy's Admit asks for, as it asks (idle windows it ends,
        window, footprint, wake-up)."""
        if decision.reclaim_blocks and record is not None:
            self._book.reclaim_late_windows(record, decision.reclaim_blocks, self._now())
            self._publish_windows()
        return self._grant(
            record,
            attempt,
            decision.reason.value,  # plain str: a JSON key in /admin/state
            start,
            window=decision.window,
            footprint=decision.footprint,
            wake_next=decision.wake_next,
            tokens=tokens,
            note=note,
            priority=decision.priority,
        )

    def _grant(
        self,
        record: SessionRecord | None,
        attempt: Attempt,
        label: str,
        start: float,
        *,
        window: bool = False,
        footprint: int | None = None,
        wake_next: bool = False,
        tokens: int | None = None,
        note: TurnNote | None = None,
        priority: int | None = None,
    ) -> Lease:
        """Book an admission under `label` (its `x-kvgate-admission` value) and hand out its lease.

        window, footprint: the session's window for the turn (`Admit.window`, `Admit.footprint`).
        wake_next: wake the next waiter too (`Admit.wake_next`); a queued attempt that is
        admitted always does, since the head of the queue moved.
        tokens: the prompt size of the turn's prefix reading, recorded for the session's growth
        (with `note.bound`, the turn's body-length bound, which later turns' bounds are measured
        from); `note` stays with the lease, for what the turn's usage teaches (`Lease.learn`).
        priority: the vLLM priority to forward the request with (`Admit.priority`).
        """
        bound = note.bound if note is not None else None
        now = self._now()
        wait = max(0.0, now - start)
        committed = self._book.window_blocks if record is not None else 0
        self._book.admit(record, attempt, label, now, window, footprint, tokens, bound)
        if record is not None and self._book.window_blocks < committed:
            self._blocks_freed(now)  # a window shrank or ended: a waiter may fit now
        self._count_admission(label, wait)
        if record is not None:
            self._publish_windows()
        if self._queue and (attempt.queued or wake_next):
            if attempt.queued:
                self._dequeue(attempt)
            self._wake_one()
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

    def _grant_unbooked(self) -> Lease:
        """Admit `open` with nothing booked but the lease (mode off, or a route without a
        prompt): no probe, no session, no window, no waiter woken."""
        self._book.leases += 1
        self._count_admission(AdmissionReason.OPEN.value, 0.0)
        return Lease(self, None, AdmissionReason.OPEN.value, 0.0)

    def _count_admission(self, label: str, wait: float) -> None:
        counter = self._admissions.get(label)
        if counter is None:
            counter = self._admissions[label] = self._metrics.admissions.labels(self.name, label)
        counter.inc()
        self._wait_hist.observe(wait)
        reason_wait = self._reason_waits.get(label)
        if reason_wait is None:
            reason_wait = self._reason_waits[label] = self._reason_wait_metric.labels(self.name, label)
        reason_wait.observe(wait)

    # --------------------------------------------------------------------- wait

    async def _wait(self, attempt: Attempt, deadline: float | None, recheck: float | None = None) -> None:
        if attempt.event is None:
            attempt.event = asyncio.Event()
        if not attempt.queued:
            self._queue[attempt] = None
            attempt.queued = True
            attempt.queued_at = self._now()
            self._pending_gauge.set(len(self._queue))
            self._reprice_unpriced()
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

    def _leave_queue(self, attempt: Attempt) -> None:
        """A waiter leaves without a lease (cancelled, superseded, timed out, rejected)."""
        was_head = next(iter(self._queue), None) is attempt
        self._dequeue(attempt)
        if was_head and self._queue:
            self._wake_one()  # strict FIFO: the next waiter must not wait for a poll

    def _dequeue(self, attempt: Attempt) -> None:
        if self._queue.pop(attempt, False) is None:
            self._pending_gauge.set(len(self._queue))
        attempt.queued = False

    def _wake_one(self) -> None:
        """Wake the first waiter not awake already, in arrival order. One behind the head
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
            self._unpriced.pop(record, None)
        now = self._changed_at = self._now()
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
                for waiter in self._queue:
                    waiter.wake()

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
        """Publish the window gauges (`kvgate_windows`) and count the windows ended since the last call."""
        if self._book._new_window_ends:
            for cause in self._book.take_window_ends():
                self._window_ends[cause].inc()
            self._unpin_ended_windows()
        counts = (self._book.windows_in_flight, self._book.windows_idle)
        if counts != self._published:  # most calls change nothing: skip the gauges' locks
            self._published = counts
            self._window_gauges[0].set(counts[0])
            self._window_gauges[1].set(counts[1])

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
        self._pending_gauge.set(0)
        self._oldest_waiter.set_function(lambda: 0.0)  # let go of this gate
        self._unpriced.clear()
        self._pins.close()
        for task in list(self._repricing):
            task.cancel()
        close_probe = getattr(self.probe, "close", None)
        if close_probe is not None:
            close_probe()

    # ------------------------------------------------------------ operator metrics

    def oldest_waiter_age(self) -> float:
        """Seconds the longest-queued waiter has waited (0 when none); read at scrape time."""
        oldest = next(iter(self._queue), None)  # the queue keeps arrival order
        return max(0.0, self._now() - oldest.queued_at) if oldest is not None else 0.0

    def _count_reprefill(self, previous_tokens: int | None, prefix: PrefixReading, usage: UsageReading | None) -> None:
        """Count the tokens an admitted turn prefills again: of the session's prompt before
        this turn (`previous_tokens`), what `prefix` (its reading or its usage) found evicted."""
        block_size = usage.block_size if usage is not None else None
        tokens = reprefill_tokens(previous_tokens, prefix.total_tokens, prefix.hit_blocks, block_size)
        if tokens:
            self._reprefill.inc(tokens)

    # ------------------------------------------------------------ introspection

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
        sessions: dict[str, dict[str, Any]] = {}
        for key, rec in self._book.windows.items():  # oldest window first
            (in_flight if rec.in_flight else idle).append(key)
        for key, rec in self._book.records.items():
            sessions[key] = {
                "reasons": dict(rec.reasons),
                "num_superseded": rec.num_superseded,
                "windows_lost": rec.windows_lost,
                "in_flight": rec.in_flight,
                "has_window": rec.has_window,
                "resident_blocks": rec.footprint,
                "growth_tokens": rec.growth_tokens,
                "idle_sec": round(now - rec.idle_since, 3) if rec.is_idle else None,
                "gap_sec": None if rec.gap_ewma is None else round(rec.gap_ewma, 3),
                "quiet_in_sec": (
                    round(rec.quiet_deadline - now, 3)
                    if rec.is_idle and rec.has_window and rec.quiet_deadline is not None
                    else None
                ),
                "quiet_lifetime_sec": round(self._book.quiet_lifetime(rec), 3),
                "last_window_end": rec.last_window_end,
                "held": next((h for h in map(_held_state, rec.attempts.values()) if h is not None), None),
                "attempts": len(rec.attempts),
            }
        pending = [k for k, rec in self._book.records.items() if any(a in self._queue for a in rec.attempts.values())]
        anonymous_waiting = sum(1 for waiter in self._queue if not waiter.named)
        return {
            "mode": self.settings.mode,
            "policy": self.policy.name,
            "closed": self._closed is not None,
            "leases": self._book.leases,
            "windows": {"in_flight": in_flight, "idle": idle},
            "window_blocks": self._book.window_blocks,
            "pending": pending,
            "pending_anonymous": anonymous_waiting,
            "sessions": sessions,
            "window_ends": dict(self._book.window_ends),
            "replica_gap_sec": None if self._book.replica_gap_ewma is None else round(self._book.replica_gap_ewma, 3),
        }
