"""The gate's bookkeeping of sessions on one replica: synchronous, no I/O, no asyncio.

One `SessionRecord` per named session that is active on the replica (acquiring, in
flight) or was active within the last `idle_grace_sec`. A record carries the
session's window (its claim on the replica's KV cache between turns, priced at its
footprint in blocks), its admission reason counts and its
`num_superseded`. The async gate (`gate.gate`) is the shell that probes and waits; every
state change goes through a `SessionBook` method, which keeps these invariants:

- `records` holds exactly the live records; `idle` holds, in the order they became
  idle, exactly those with no lease in flight and no attempt acquiring.
- A record's `attempts` maps each turn it is acquiring (`request_body.turn_key`) to its
  newest attempt; an attempt begun alone with its turn unnamed (a function that names
  it) sits under `UNNAMED_TURN` until a second attempt of the session arrives, which
  names it first (so at most one attempt is unnamed, and a lone one never pays for it).
- A record is *ended* (removed, returned to the caller for metrics) when it is idle
  and either finished or idle for `grace` seconds. An idle window ends earlier, when
  its session has gone quiet: at `quiet_deadline`, `idle_since` + `quiet_lifetime`
  of the session's recent gaps between turns (its own, else the replica's mean),
  never later than `grace` (the record then lives on, without its window, until
  `grace`). Expired records and windows are purged lazily: `purge(now)` pops due
  deadlines from a heap, which holds at most one live entry per record
  (`deadline_seq`), due no later than the record's next deadline (its window's quiet
  end, else its grace): a record idle again before its entry is due keeps that entry,
  and `purge` moves it on to the deadline the record has then. So a session's turns
  push about one entry per quiet lifetime, not one per turn (O(log n) each); an entry
  that is no record's live one is stale and skipped.
- A session's *gap* is the time from the end of its last turn (its last lease
  released) to the start of its next attempt; `gap_ewma` / `last_gap` are the
  session's, `replica_gap_ewma` the replica's over every session. A turn's *service
  time* runs from its admission to the release of its lease (served); `turn_ewma` is
  the session's, `replica_turn_ewma` the replica's. `prefix_probe_ewma` is the
  replica's smoothed prefix-probe latency, as a turn waiting on the probe sees it.
- Every window that ends is counted under its cause in `window_ends` (finish, quiet,
  grace, lost, revoked, reclaimed, final_reply); `take_window_ends()` hands the new ones to the shell,
  `take_ended_window_keys()` their sessions.
- `leases` counts every lease not yet released, anonymous ones included;
  `idle_since_replica` is when it last dropped to 0 (None while a lease is out).
  `empty_meter` (a `BusyMeter`) meters those spells with no lease out, from the first
  lease on: `empty_share(now)` is the share of the replica's recent wall time they
  took, as the engine's `busy_share` is of its steps.
- `windows_in_flight`, `windows_idle` count records holding a window with / without a
  lease in flight; `idle_window_blocks` sums the footprints of the idle ones.
- `windows` holds exactly the records that hold a window, in the order their windows
  opened (a window that ends and opens again goes to the back). A record's
  `footprint` is its window's price in blocks. `_order` (`OrderedSums`) holds the same
  records in the same order with their footprints in a Fenwick tree: every change of
  a window holder's footprint goes through `_set_footprint`, so `window_blocks` (their
  running total) and `older_window_blocks(rec)` (those ranked before `rec`) are O(1)
  and O(log n).
- `_idle_windows` (`LateIndex`) holds exactly the records with a window that are idle
  (no lease in flight, no attempt acquiring), indexed by when their sessions turn late:
  `late_window_blocks` and `late_windows` answer in O(log n) (plus the late windows
  listed), for a `now` that never decreases (the gate's clock is monotonic).
- A record's `prompt_tokens` is the session's recorded size: the prompt of its last
  admitted turn with a prefix reading (with the body bound it was read for).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from kvgate.gate.holding_value import HoldingValue
from kvgate.gate.late_index import LateIndex
from kvgate.gate.ordered_sums import OrderedSums
from kvgate.gate.recent_max import RecentMax
from kvgate.gate.request_body import HistoryMedia, body_bytes
from kvgate.gate.window_lifetime import late_after, quiet_lifetime
from kvgate.wire.busy_share import BusyMeter


class WindowEnd(StrEnum):
    """Why a window ended: the `cause` label of `kvgate_window_ends_total` and the keys of
    /admin/state's `window_ends` (values are part of the contract: docs/gate.md)."""

    FINISH = "finish"  # x-session-finish or POST /admin/sessions/{id}/finish
    QUIET = "quiet"  # idle well past the session's usual gap between turns
    GRACE = "grace"  # idle for idle_grace_sec (the ceiling of the quiet lifetime)
    LOST = "lost"  # working_set policy: no longer fits behind the older windows
    REVOKED = (
        "revoked"  # its turn served no prompt, its prompt can never fit, it went work_conserving, or the replica left
    )
    RECLAIMED = "reclaimed"  # working_set policy: idle, its blocks made a window for a turn that waited its cap
    FINAL_REPLY = "final_reply"  # its turn's reply called no tool where it could have: the agent's run ended


# The key of a session's only attempt acquiring while its turn is not named
# (`SessionBook.begin_attempt`): never a turn key, which is hex.
UNNAMED_TURN = "\x00unnamed"
GAP_EWMA_WEIGHT = 0.5  # weight of the newest gap: a session's rhythm follows its recent turns
PROBE_EWMA_WEIGHT = 0.3  # weight of the newest prefix probe's latency: the API server's load drifts
TURN_EWMA_WEIGHT = 0.5  # weight of the newest turn's service time, likewise
# Recorded sizes the tokens-per-byte ratio is the highest of: recent enough to follow a
# change of workload, enough to cover its sessions' different templates and languages.
TOKENS_PER_BYTE_WINDOW = 64
# Served replies the output a turn is priced at is the longest of (`output_price`):
# as many, for the same reasons.
REPLY_TOKENS_WINDOW = 64


@dataclass(slots=True, eq=False)
class SessionRecord:
    key: str
    in_flight: int = 0
    has_window: bool = False
    footprint: int = 0  # the window's price in blocks (/admin/state: footprint_blocks)
    # The attempts still acquiring, by turn (`request_body.turn_key`): the newest attempt of
    # each distinct turn (the shell's tokens, compared by identity). A re-sent turn replaces
    # its older attempt; distinct turns of one session acquire side by side.
    attempts: dict[str, object] = field(default_factory=dict)
    finished: bool = False
    idle_since: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)
    num_superseded: int = 0
    windows_lost: int = 0  # windows the working_set policy took back (older sessions grew)
    prompt_tokens: int | None = None  # prompt tokens of the last admitted turn with a prefix reading
    prompt_bound: int | None = None  # the body-length bound of the turn `prompt_tokens` was read for
    # its threads' histories as their turns' bodies showed them, the latest first (`turn_media`)
    history_media: tuple[HistoryMedia, ...] = ()
    turn_ended_at: float | None = None  # when its last lease was released (a gap starts)
    gap_ewma: float | None = None  # its gaps between turns: smoothed, and the last one
    last_gap: float | None = None
    quiet_deadline: float | None = None  # while idle with a window: when the window ends
    # Its live entry in the book's deadline heap: the entry's sequence number (-1: none) and
    # when it is due (no later than the record's next deadline; see the module docstring).
    deadline_seq: int = -1
    deadline_at: float = 0.0
    opener: object | None = None  # the attempt whose admission opened the window, until a turn of it is served
    last_window_end: WindowEnd | None = None  # the cause its last window ended with
    # A reply ended its agent's run, and its window with it (`end_run`), until its next turn arrives.
    ended_by_reply: bool = False
    # A turn came back after a final reply within the quiet lifetime its window would have
    # had: its client goes on after such replies, so they no longer end its windows.
    goes_on_after_reply: bool = False
    admitted_at: float | None = None  # when its turn in flight was admitted
    turn_ewma: float | None = None  # its turns' service times (admission to release), smoothed
    admitted_window: bool | None = None  # its last admitted turn got a window (None: none admitted yet)
    # Names the turn of the lone attempt kept under UNNAMED_TURN, once another attempt arrives.
    unnamed_turn: Callable[[], str] | None = None
    # Its place among the sessions the book has seen, numbered as they are booked (one
    # forgotten and seen again gets a new number): its waiting turns queue behind those of
    # sessions with a lower number. A count, not a time: sessions that start at the same
    # instant still have an order.
    started: int = -1

    @property
    def is_idle(self) -> bool:
        return self.in_flight == 0 and not self.attempts

    def drop_attempt(self, attempt: object) -> bool:
        """Forget `attempt` (it stopped acquiring); False if it was not the newest of its turn."""
        for turn, held in self.attempts.items():
            if held is attempt:
                del self.attempts[turn]
                if turn == UNNAMED_TURN:
                    self.unnamed_turn = None  # lets go of what names it (the turn's body)
                return True
        return False

    def name_turns(self) -> None:
        """Key the lone attempt kept under UNNAMED_TURN by its turn (another attempt arrived)."""
        if self.unnamed_turn is not None:
            held = self.attempts.pop(UNNAMED_TURN)
            self.attempts[self.unnamed_turn()] = held
            self.unnamed_turn = None


class SessionBook:
    def __init__(
        self, grace: float, quiet_factor: float = 4.0, quiet_floor: float = 0.5, late_floor: float = 0.5
    ) -> None:
        self.grace = grace
        self.quiet_factor = quiet_factor
        self.quiet_floor = quiet_floor  # an idle window's shortest life (`quiet_lifetime`)
        self.late_floor = late_floor  # a session's shortest idle time before it is late (`late_after`)
        self._deadlines: list[tuple[float, int, str]] = []  # (when, seq, key)
        self._seq = 0
        self.sessions_started = 0  # records booked so far: the next one's `started`
        self.replica_gap_ewma: float | None = None
        self.replica_turn_ewma: float | None = None  # every session's turn service times, smoothed
        self.prefix_probe_ewma: float | None = None  # prefix probes on a turn's path, seconds, smoothed
        self.holding = HoldingValue()  # what holding a newcomer has kept of its own prefix here
        self.window_ends: dict[str, int] = {cause.value: 0 for cause in WindowEnd}  # plain keys: JSON
        self._new_window_ends: list[WindowEnd] = []
        self._ended_window_keys: list[str] = []  # the sessions of `_new_window_ends`, in order
        self.idle_since_replica: float | None = 0.0
        self.empty_meter = BusyMeter()
        self.records: dict[str, SessionRecord] = {}
        self.idle: OrderedDict[str, SessionRecord] = OrderedDict()
        self.windows_in_flight = 0
        self.windows_idle = 0
        self.idle_window_blocks = 0
        self.leases = 0
        self.windows: OrderedDict[str, SessionRecord] = OrderedDict()
        self._order: OrderedSums[SessionRecord] = OrderedSums()  # `windows`, with their footprints' sums
        self._idle_windows: LateIndex[SessionRecord] = LateIndex(late_floor)
        self._tokens_per_byte = RecentMax(TOKENS_PER_BYTE_WINDOW)
        self._reply_tokens = RecentMax(REPLY_TOKENS_WINDOW)

    # -- classification: every mutation is bracketed by _leave / _enter

    def _leave(self, rec: SessionRecord) -> None:
        if rec.has_window:
            if rec.in_flight:
                self.windows_in_flight -= 1
            else:
                self.windows_idle -= 1
                self.idle_window_blocks -= rec.footprint
            if rec.is_idle:
                self._idle_windows.remove(rec)
        self.idle.pop(rec.key, None)

    def _enter(self, rec: SessionRecord, now: float) -> None:
        if rec.has_window:
            if rec.in_flight:
                self.windows_in_flight += 1
            else:
                self.windows_idle += 1
                self.idle_window_blocks += rec.footprint
        if rec.is_idle:
            rec.idle_since = now
            self.idle[rec.key] = rec
            rec.quiet_deadline = None
            # Its next deadline: the window's quiet end, then (scheduled when that one is
            # purged) the record's grace; a record without a window, its grace. A live heap
            # entry due sooner (from an earlier idle period) stands for it (`_schedule`).
            if rec.has_window:
                rec.quiet_deadline = now + self.quiet_lifetime(rec)
                self._schedule(rec, rec.quiet_deadline)
                self._idle_windows.add(rec)
            else:
                self._schedule(rec, now + self.grace)

    def _schedule(self, rec: SessionRecord, when: float) -> None:
        """Make sure the record has a heap entry due by `when`: its live one if that is due no
        later (`purge` moves it on when it pops), else a new one (the old one goes stale)."""
        if rec.deadline_seq >= 0 and rec.deadline_at <= when:
            return
        self._seq += 1
        rec.deadline_seq, rec.deadline_at = self._seq, when
        heapq.heappush(self._deadlines, (when, self._seq, rec.key))

    def _next_deadline(self, rec: SessionRecord) -> float:
        """When an idle record is next due: its window's quiet end, else its grace."""
        if rec.has_window and rec.quiet_deadline is not None:
            return rec.quiet_deadline
        return rec.idle_since + self.grace

    def _live_entry(self, seq: int, key: str) -> SessionRecord | None:
        """The record whose live heap entry is (`seq`, `key`), taken off it (the entry is
        popped); None for a stale entry."""
        rec = self.records.get(key)
        if rec is None or rec.deadline_seq != seq:
            return None
        rec.deadline_seq = -1
        return rec

    def quiet_lifetime(self, rec: SessionRecord) -> float:
        """How long the record's window may stay idle (`window_lifetime.quiet_lifetime`)."""
        gap = rec.gap_ewma if rec.last_gap is None else max(rec.gap_ewma or 0.0, rec.last_gap)
        return quiet_lifetime(gap, self.replica_gap_ewma, self.quiet_factor, self.quiet_floor, self.grace)

    def late_after_sec(self, rec: SessionRecord) -> float:
        """How long the record's session may be idle before it is late (`policies.late_after`,
        as the late windows are indexed): after that its blocks are the least likely to be
        read again soon."""
        return late_after(rec.gap_ewma, self.replica_gap_ewma, self.late_floor)

    def _window_ended(self, cause: WindowEnd, rec: SessionRecord) -> None:
        rec.last_window_end = cause
        rec.opener = None
        self.window_ends[cause.value] += 1
        self._new_window_ends.append(cause)
        self._ended_window_keys.append(rec.key)

    def take_window_ends(self) -> list[WindowEnd]:
        """The causes of the windows ended since the last call (for the shell's metrics)."""
        ended, self._new_window_ends = self._new_window_ends, []
        return ended

    def take_ended_window_keys(self) -> list[str]:
        """The sessions whose windows ended since the last call (for the shell's KV pins)."""
        keys, self._ended_window_keys = self._ended_window_keys, []
        return keys

    def _end(self, rec: SessionRecord) -> SessionRecord:
        self._leave(rec)
        if self.windows.pop(rec.key, None) is not None:  # rec.has_window stays: the caller reads it
            self._order.remove(rec.key)
        if rec.has_window:
            self._window_ended(WindowEnd.GRACE, rec)
        del self.records[rec.key]
        if not self.records:
            self._deadlines.clear()
        return rec

    def _set_window(self, rec: SessionRecord, has_window: bool) -> None:
        """Begin or end the record's window (call between _leave and _enter)."""
        if has_window and not rec.has_window:
            self.windows[rec.key] = rec
            self._order.append(rec.key, rec, rec.footprint)
        elif rec.has_window and not has_window:
            if self.windows.pop(rec.key, None) is not None:
                self._order.remove(rec.key)
            self._idle_windows.remove(rec)  # ended while idle (quiet, reclaimed): outside _leave/_enter
        rec.has_window = has_window

    def _set_footprint(self, rec: SessionRecord, footprint: int) -> None:
        """Price the record's window (or its next one) at `footprint` blocks (never an idle
        window's: `_idle_windows` keeps the price it went idle with)."""
        if self.windows.get(rec.key) is rec:
            self._order.set_value(rec.key, footprint)
        rec.footprint = footprint

    # -- the working_set policy's books

    @property
    def window_blocks(self) -> int:
        """Footprints of every window, in flight or idle."""
        return self._order.total

    def older_window_blocks(self, rec: SessionRecord | None) -> int:
        """Footprints of the windows opened before `rec`'s; all of them if it holds none. O(log n)."""
        if rec is None or not rec.has_window:
            return self._order.total
        return self._order.sum_before(self._order.rank(rec.key))

    @property
    def tokens_per_byte(self) -> float | None:
        """The highest tokens-per-body-byte ratio of the recent recorded sizes; None before any."""
        return self._tokens_per_byte.value

    def record_reply(self, output_tokens: int) -> None:
        """A served turn generated `output_tokens` (its usage said so)."""
        self._reply_tokens.add(output_tokens)

    @property
    def reply_tokens(self) -> int | None:
        """The longest of the replica's recent replies (None before any was served)."""
        longest = self._reply_tokens.value
        return None if longest is None else int(longest)

    def output_price(self, allowance: int) -> int:
        """The output tokens a turn of output `allowance` (its max_tokens; 0: none given) is
        priced at: the longest of the replica's recent replies, never above the allowance
        given; the allowance itself before any reply was served. An agent's max_tokens is a
        cap (Claude Code sends 32,000 for replies of a few hundred tokens), and a window
        priced at it would fill the books at a fraction of the cache
        (docs/decisions/output-priced-at-recent-replies.md)."""
        longest = self.reply_tokens
        if longest is None:
            return allowance
        return longest if not allowance else min(allowance, longest)

    def record_size(self, rec: SessionRecord, prompt_tokens: int | None, prompt_bound: int | None = None) -> None:
        """Record an admitted turn's prompt size (and the replica's tokens-per-byte ratio)."""
        if not prompt_tokens:
            return
        size = body_bytes(prompt_bound) if prompt_bound is not None else 0
        if size > 0:
            self._tokens_per_byte.add(prompt_tokens / size)
        rec.prompt_tokens = prompt_tokens
        rec.prompt_bound = prompt_bound

    # -- operations

    def _number(self, rec: SessionRecord) -> None:
        """Give a newly booked record its place among the sessions (`SessionRecord.started`)."""
        rec.started = self.sessions_started
        self.sessions_started += 1

    def begin_attempt(
        self,
        key: str,
        attempt: object,
        now: float,
        turn: str | Callable[[], str] = "",
        new: SessionRecord | None = None,
    ) -> tuple[SessionRecord, object | None]:
        """Make `attempt` the newest of its `turn` (`request_body.turn_key`); return the record
        and the attempt of the same turn it replaces (a re-sent turn supersedes its waiting
        attempt; a distinct turn of the session replaces nothing).

        `turn` as a function names the turn only when it must be told from another: the
        session's only attempt acquiring is kept under UNNAMED_TURN, and named (with the
        newcomer) when a second one arrives, so a turn that is admitted alone never pays
        for its key (an encoding and a digest of its whole prompt).

        `new`: the record to book if the book has none for `key` (one its turn made before
        booking, holding what its body showed: `history_media`); else a fresh one."""
        rec = self.records.get(key)
        if rec is None:
            assert new is None or new.key == key, "a record of another session"
            rec = self.records[key] = new if new is not None else SessionRecord(key)
            self._number(rec)
        self._leave(rec)
        self._turn_arrives(rec, now)
        previous = None
        if callable(turn) and not rec.attempts:
            rec.attempts[UNNAMED_TURN], rec.unnamed_turn = attempt, turn
        else:
            rec.name_turns()
            name = turn() if callable(turn) else turn
            previous = rec.attempts.get(name)
            if previous is not None:
                rec.num_superseded += 1
            rec.attempts[name] = attempt
        self._enter(rec, now)
        return rec, previous

    def _turn_arrives(self, rec: SessionRecord, now: float) -> None:
        """A turn of the session starts acquiring (between _leave and _enter): the gap since
        its last turn ended is observed, and a finished session is live again. One that
        comes back from a final reply (`end_run`) before its window would have gone quiet
        goes on after such replies: they end its windows no more. One that comes back
        later was away for a person's next message, not a tool call: that gap is not its
        rhythm (its next windows' quiet lifetime), and is not observed."""
        persons_gap = False
        if rec.ended_by_reply:
            back_at = None if rec.turn_ended_at is None else now - rec.turn_ended_at
            if back_at is None or back_at <= self.quiet_lifetime(rec):
                rec.goes_on_after_reply = True
            else:
                persons_gap = True
            rec.ended_by_reply = False
        if rec.turn_ended_at is not None and rec.is_idle and not persons_gap:
            self._observe_gap(rec, max(0.0, now - rec.turn_ended_at))
        rec.turn_ended_at = None
        rec.finished = False

    def _observe_gap(self, rec: SessionRecord, gap: float) -> None:
        rec.last_gap = gap
        rec.gap_ewma = gap if rec.gap_ewma is None else rec.gap_ewma + GAP_EWMA_WEIGHT * (gap - rec.gap_ewma)
        replica = self.replica_gap_ewma
        self.replica_gap_ewma = gap if replica is None else replica + GAP_EWMA_WEIGHT * (gap - replica)

    def observe_prefix_probe(self, seconds: float) -> None:
        """A prefix probe a deciding turn waited for took `seconds`."""
        probe = self.prefix_probe_ewma
        self.prefix_probe_ewma = seconds if probe is None else probe + PROBE_EWMA_WEIGHT * (seconds - probe)

    def _observe_turn(self, rec: SessionRecord, service: float) -> None:
        rec.turn_ewma = (
            service if rec.turn_ewma is None else rec.turn_ewma + TURN_EWMA_WEIGHT * (service - rec.turn_ewma)
        )
        replica = self.replica_turn_ewma
        self.replica_turn_ewma = service if replica is None else replica + TURN_EWMA_WEIGHT * (service - replica)

    def recent_turn_sec(self, rec: SessionRecord) -> float | None:
        """The session's recent turn service time, else the replica's (None before any turn ended)."""
        return rec.turn_ewma if rec.turn_ewma is not None else self.replica_turn_ewma

    def end_attempt(self, rec: SessionRecord, attempt: object, now: float) -> SessionRecord | None:
        """The attempt stopped acquiring without a lease; returns the record if that ended it."""
        if self.records.get(rec.key) is not rec or attempt not in rec.attempts.values():
            return None
        self._leave(rec)
        rec.drop_attempt(attempt)
        self._enter(rec, now)
        return self._end(rec) if rec.finished and rec.is_idle else None

    def admit(
        self,
        rec: SessionRecord | None,
        attempt: object,
        label: str,
        now: float,
        window: bool = False,
        footprint: int | None = None,
        prompt_tokens: int | None = None,
        prompt_bound: int | None = None,
        arriving: bool = False,
    ) -> None:
        """Record an admission under `label` (the decision's reason, or its shadow_ form).

        window: the session holds a window for this turn: it opens one (this attempt is its
        opener) or renews the one it holds; False ends a window it held (`revoked`).
        footprint: the window's price in blocks (None keeps its last price).
        prompt_tokens: the turn's prompt size from its prefix reading (None: not probed).
        arriving: the turn is admitted the moment it arrives (the gate's calm path), its
        attempt never begun: this books the arrival too, and the books end as
        `begin_attempt` then `admit` leave them. `rec` is then the session's record, or a
        new one (`SessionRecord(key)`) that this books; no other attempt of it acquires.
        """
        self.leases += 1
        if self.idle_since_replica is not None:  # an empty spell ends (the first lease starts the meter)
            empty = now - self.idle_since_replica if self.empty_meter.started else 0.0
            self.empty_meter.observe(now, max(0.0, empty))
        self.idle_since_replica = None
        if rec is None:
            return
        if arriving:
            assert not rec.attempts, "a session with an attempt acquiring is admitted through begin_attempt"
            booked = self.records.setdefault(rec.key, rec)
            assert booked is rec, "one record per session"
            if rec.started < 0:
                self._number(rec)
        self._leave(rec)
        if arriving:
            self._turn_arrives(rec, now)
        else:
            rec.drop_attempt(attempt)
        # Another request of the session is in flight in its window (concurrent distinct
        # turns): the window covers both, priced together, and a windowless admission of
        # this one does not end the other's window.
        sharing = rec.in_flight > 0 and rec.has_window
        rec.in_flight += 1
        rec.admitted_at = now
        if window and not rec.has_window:
            rec.opener = attempt
        elif not window and rec.has_window and not sharing:
            self._window_ended(WindowEnd.REVOKED, rec)
        self._set_window(rec, window or sharing)
        rec.admitted_window = window
        if footprint is not None and window:
            self._set_footprint(rec, rec.footprint + footprint if sharing else footprint)
        elif footprint is not None and not sharing:
            self._set_footprint(rec, footprint)
        rec.reasons[label] = rec.reasons.get(label, 0) + 1
        self.record_size(rec, prompt_tokens, prompt_bound)
        self._enter(rec, now)

    def reprice(self, rec: SessionRecord, footprint: int, prompt_tokens: int, prompt_bound: int | None) -> bool:
        """Replace the price of an in-flight window admitted at an upper bound by its exact
        one (working_set policy, no-pressure path); True if the window shrank.

        Only while the turn is in flight: an idle window's price counts in
        `idle_window_blocks` and its place in `idle`, which this must not disturb (its
        next turn prices it again).
        """
        if self.records.get(rec.key) is not rec or not rec.has_window or rec.in_flight != 1:
            return False  # idle, or shared by concurrent turns priced together (the next turn reprices it)
        shrank = footprint < rec.footprint
        self._set_footprint(rec, footprint)
        self.record_size(rec, prompt_tokens, prompt_bound)
        return shrank

    def empty_share(self, now: float) -> float:
        """The share of the replica's recent wall time that it had no lease out, up to the
        last lease's start (`empty_meter`: what the rent on a held turn's wait reads while
        leases are out); 0 before the first lease."""
        return self.empty_meter.share(now) or 0.0

    def release(
        self, rec: SessionRecord | None, now: float, attempt: object | None = None, served: bool = True
    ) -> SessionRecord | None:
        """A lease ended; returns the record if that ended the session (it was finished).

        served False: the turn's prompt was never served (routing or the upstream
        failed, or it answered an error status); a window that this lease's admission
        opened (`attempt` is its opener) ends, cause `revoked`: a failed turn leaves no
        new window behind. A served turn confirms the window it opened.
        """
        self.leases -= 1
        if not self.leases:
            self.idle_since_replica = now
        if rec is None or self.records.get(rec.key) is not rec:
            return None
        self._leave(rec)
        rec.in_flight -= 1
        if attempt is not None and rec.opener is attempt:
            if served or rec.in_flight:  # a concurrent turn of the session still uses the window
                rec.opener = None
            elif rec.has_window:
                self._window_ended(WindowEnd.REVOKED, rec)
                self._set_window(rec, False)
        if served and not rec.in_flight:
            rec.turn_ended_at = now
            if rec.admitted_at is not None:
                self._observe_turn(rec, max(0.0, now - rec.admitted_at))
        self._enter(rec, now)
        return self._end(rec) if rec.finished and rec.is_idle else None

    def finish(self, key: str, now: float, cause: WindowEnd = WindowEnd.FINISH) -> tuple[bool, SessionRecord | None]:
        """End the session's window; returns (it held a window, the record if it ended now).

        A session with a lease in flight or an attempt acquiring ends when that stops.
        Unknown sessions are a no-op.
        """
        rec = self.records.get(key)
        if rec is None:
            return False, None
        self._leave(rec)
        had_window = rec.has_window
        if had_window:
            self._window_ended(cause, rec)
        self._set_window(rec, False)
        rec.finished = True
        self._enter(rec, now)
        return had_window, (self._end(rec) if rec.is_idle else None)

    def end_run(self, rec: SessionRecord, now: float) -> bool:
        """A reply ended the session's agent run: its window ends (`final_reply`), its record
        stays (its gaps, its place in the queue), unless the session went on after a final
        reply before (`goes_on_after_reply`). True if a window ended."""
        if rec.goes_on_after_reply:
            return False
        rec.ended_by_reply = self.drop_window(rec, now, WindowEnd.FINAL_REPLY)
        return rec.ended_by_reply

    def drop_window(self, rec: SessionRecord, now: float, cause: WindowEnd = WindowEnd.LOST) -> bool:
        """Take the session's window back (the session keeps its record); True if it had one."""
        if not rec.has_window or self.records.get(rec.key) is not rec:
            return False
        self._leave(rec)
        self._window_ended(cause, rec)
        self._set_window(rec, False)
        if cause == WindowEnd.LOST:
            rec.windows_lost += 1
        self._enter(rec, now)
        return True

    def late_window_blocks(self, rec: SessionRecord | None, now: float) -> tuple[int, float | None]:
        """The footprints of other sessions' idle windows whose sessions are late
        (`late_after`, at least the late floor), and the seconds until the next of the
        others turns late (None: no other idle window). O(log n) amortized."""
        if rec is not None and rec.key in self._idle_windows:  # never the gate's: a deciding turn is acquiring
            late, due = self._late_windows_walk(rec, now)
            return sum(other.footprint for other in late), due
        return self._idle_windows.late_blocks(self.replica_gap_ewma, now)

    def late_windows(self, rec: SessionRecord | None, now: float) -> list[SessionRecord]:
        """Other sessions' idle windows whose sessions are late, the longest idle first
        (equal idle times: the older window first). O(late windows x log + log n)."""
        if rec is not None and rec.key in self._idle_windows:
            return self._late_windows_walk(rec, now)[0]
        late = self._idle_windows.late(self.replica_gap_ewma, now)
        late.sort(key=lambda other: (other.idle_since, self._order.rank(other.key)))
        return late

    def _late_windows_walk(self, rec: SessionRecord | None, now: float) -> tuple[list[SessionRecord], float | None]:
        """`late_windows` and its due time by a walk over every window (O(windows)): for a
        `rec` whose own window is idle (the index counts it), and the tests' reference."""
        late: list[SessionRecord] = []
        due: float | None = None
        for other in self.windows.values():
            if other is rec or not other.is_idle:  # in flight, or its next turn is acquiring
                continue
            left = late_after(other.gap_ewma, self.replica_gap_ewma, self.late_floor) - (now - other.idle_since)
            if left < 0:
                late.append(other)
            else:
                due = left if due is None else min(due, left)
        late.sort(key=lambda other: other.idle_since)
        return late, due

    def reclaim_late_windows(self, rec: SessionRecord | None, blocks: int, now: float) -> int:
        """End other sessions' late idle windows (cause `reclaimed`), the longest idle first,
        until at least `blocks` of their footprints are uncommitted; returns the blocks
        uncommitted. The records stay idle (same period) until their grace, as after a
        quiet end."""
        freed = 0
        for other in self.late_windows(rec, now):
            if freed >= blocks:
                break
            freed += other.footprint
            self.windows_idle -= 1
            self.idle_window_blocks -= other.footprint
            self._window_ended(WindowEnd.RECLAIMED, other)
            self._set_window(other, False)
            other.quiet_deadline = None
        return freed

    def purge(self, now: float) -> tuple[list[SessionRecord], bool]:
        """End every window whose session went quiet, and every record idle for `grace`
        seconds or more, in deadline order. Returns the ended records and whether any
        window ended (blocks were uncommitted)."""
        ended: list[SessionRecord] = []
        windows_ended = False
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, seq, key = heapq.heappop(heap)
            rec = self._live_entry(seq, key)
            if rec is None or not rec.is_idle:
                continue  # stale, or active: its next idle period schedules its own deadline
            if rec.idle_since + self.grace <= now:  # the grace deadline's own sum: it is due
                windows_ended |= rec.has_window
                ended.append(self._end(rec))
                continue
            if rec.has_window and rec.quiet_deadline is not None and rec.quiet_deadline <= now:
                # The window ends; the record stays idle (same period) until its grace.
                self.windows_idle -= 1
                self.idle_window_blocks -= rec.footprint
                self._window_ended(WindowEnd.QUIET, rec)
                self._set_window(rec, False)
                rec.quiet_deadline = None
                windows_ended = True
            self._schedule(rec, self._next_deadline(rec))  # its grace, or a later quiet end
        return ended, windows_ended

    def next_expiry(self, now: float) -> float | None:
        """The earliest deadline after `now` that `purge` would act on, or None. Stale
        entries (their record ended or became active again) are dropped on the way;
        deadlines already due are left for `purge`."""
        heap = self._deadlines
        while heap:
            when, seq, key = heap[0]
            if when <= now:
                return when
            rec = self.records.get(key)
            if rec is not None and rec.deadline_seq == seq and rec.is_idle and self._next_deadline(rec) <= when:
                return when
            heapq.heappop(heap)
            rec = self._live_entry(seq, key)
            if rec is not None and rec.is_idle:  # due later than its entry: moved on
                self._schedule(rec, self._next_deadline(rec))
        return None
