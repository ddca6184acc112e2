"""What the gate shell knows about a deciding turn, offered to policies as `GateFacts`.

`TurnFacts` reads the session book, the session's record and the attempt's figures
when a policy's view asks for them, so a policy that reads little costs little: the
watermark policy never queries the windows or walks the queue. The book answers the
window queries in O(log n) (`SessionBook`); `waiters_ahead` walks the queue.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgate.gate.book import SessionBook, SessionRecord
from kvgate.gate.readings import UsageReading


class TurnFacts:
    """The `GateFacts` (`gate.policies.views`) of one decision of one attempt.

    record None: an anonymous turn; it has only `anonymous` and `max_output_tokens`,
    everything else reads as its default. `waiters_ahead` is counted when read (O(queue)).
    priority_field: the turn's route carries vLLM's `priority` field.
    """

    __slots__ = (
        "_book",
        "_rec",
        "max_output_tokens",
        "prompt_bound_tokens",
        "_waiters_ahead",
        "_usage",
        "_now",
        "_start",
        "priority_field",
        "_late",
    )

    def __init__(
        self,
        book: SessionBook,
        record: SessionRecord | None,
        max_output_tokens: int,
        prompt_bound_tokens: int | None,
        waiters_ahead: Callable[[], int],
        usage: UsageReading | None,
        now: float,
        start: float,
        priority_field: bool = False,
    ) -> None:
        self._book = book
        self._rec = record
        self.max_output_tokens = max_output_tokens
        self.prompt_bound_tokens = prompt_bound_tokens if record is not None else None
        self._waiters_ahead = waiters_ahead
        self._usage = usage
        self._now = now
        self._start = start
        self.priority_field = priority_field and record is not None
        self._late: tuple[int, float | None] | None = None  # (late_window_blocks, next_late_sec): one query

    def late_windows(self) -> tuple[int, float | None]:
        """(late_window_blocks, next_late_sec), queried once, when first called."""
        if self._rec is None:
            return 0, None
        if self._late is None:
            self._late = self._book.late_window_blocks(self._rec, self._now)
        return self._late

    @property
    def anonymous(self) -> bool:
        return self._rec is None

    @property
    def has_window(self) -> bool:
        return self._rec is not None and self._rec.has_window

    def _own_idle_window(self) -> int:
        """The footprint of the session's own window while it is idle, else 0: in flight
        (another turn of the session is in it), it counts as a sibling's."""
        rec = self._rec
        return rec.footprint if rec is not None and rec.has_window and not rec.in_flight else 0

    @property
    def idle_window_blocks(self) -> int:
        return 0 if self._rec is None else self._book.idle_window_blocks - self._own_idle_window()

    @property
    def older_window_blocks(self) -> int:
        rec = self._rec
        if rec is None:
            return 0
        # Another turn of the session is in flight in its window (concurrent distinct
        # requests): this one is priced behind it, so the two are priced together.
        sibling = rec.footprint if rec.has_window and rec.in_flight else 0
        return self._book.older_window_blocks(rec) + sibling

    @property
    def other_window_blocks(self) -> int:
        return 0 if self._rec is None else self._book.window_blocks - self._own_idle_window()

    @property
    def waiters_ahead(self) -> int:
        return self._waiters_ahead() if self._rec is not None else 0

    @property
    def last_prompt_tokens(self) -> int | None:
        return self._rec.prompt_tokens if self._rec is not None else None

    @property
    def last_prompt_bound(self) -> int | None:
        return self._rec.prompt_bound if self._rec is not None else None

    @property
    def tokens_per_byte(self) -> float | None:
        return self._book.tokens_per_byte if self._rec is not None else None

    @property
    def replica_idle_sec(self) -> float | None:
        """How long the replica has had no lease out, unless its engine says it is busy."""
        idle_since = self._book.idle_since_replica
        usage = self._usage
        engine_busy = usage is not None and bool(usage.num_running or usage.num_waiting)
        if self._rec is None or idle_since is None or engine_busy:
            return None
        return max(0.0, self._now - idle_since)

    @property
    def replica_empty_share(self) -> float:
        return self._book.empty_share(self._now) if self._rec is not None else 0.0

    @property
    def expected_gap_sec(self) -> float | None:
        return self._book.replica_gap_ewma if self._rec is not None else None

    @property
    def recent_turn_sec(self) -> float | None:
        return self._book.recent_turn_sec(self._rec) if self._rec is not None else None

    @property
    def prefix_probe_sec(self) -> float | None:
        return self._book.prefix_probe_ewma if self._rec is not None else None

    @property
    def own_prefix_share(self) -> float:
        return self._book.holding.own_share() if self._rec is not None else 1.0

    @property
    def held_got_window(self) -> float:
        return self._book.holding.held_got_window if self._rec is not None else 1.0

    @property
    def waited_sec(self) -> float:
        return max(0.0, self._now - self._start) if self._rec is not None else 0.0
