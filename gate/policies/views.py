"""What each policy reads: one view type per policy, built from the gate's facts.

The shell offers every fact it knows about the deciding turn as a `GateFacts` (each
computed when read); a policy's view type reads the ones that policy decides on
(`Policy.view`), so a policy is handed nothing it does not read.

Views are values a policy only reads, one or two built on every turn's path: plain
slotted dataclasses, not frozen ones, whose constructor sets each field through
`object.__setattr__` and costs several times more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Protocol

# The late idle windows, read when called: (their footprints, seconds until the next
# other idle window turns late or None). An O(log n) query of the book, made only by a
# policy branch that needs it (`GateFacts.late_windows`).
LateWindows = Callable[[], tuple[int, float | None]]


def no_late_windows() -> tuple[int, float | None]:
    return 0, None


class GateFacts(Protocol):
    """Everything the gate can tell a policy about the deciding turn and its replica.

    anonymous: the request has no session id (it never holds a window).
    has_window: the session holds a live (unexpired) window on this replica.
    idle_window_blocks: the footprints of *other* sessions' idle windows.
    late_windows(): the footprints of other sessions' idle windows whose sessions are
      late (`late_after`: idle longer than their usual gap between turns), and the
      seconds until the next other idle window turns late (None: none); a method, so
      the book is queried only when a policy calls it.
    older_window_blocks: the footprints of the windows that rank before this session's
      own (opened earlier), in flight or idle; all windows when the session holds none.
    other_window_blocks: the footprints of every window but the session's own, older
      or younger, in flight or idle (O(1)); the own window counts while another turn of
      the session is in flight in it, as in `older_window_blocks`.
    max_output_tokens: the request's output allowance (`output_allowance(body)`).
    waiters_ahead: named sessions queued at the gate ahead of this attempt (all of
      them for an attempt not queued yet).
    last_prompt_tokens: the prompt tokens of the session's last admitted turn on this
      replica with a prefix reading (None: no history).
    prompt_bound_tokens: an upper bound on the prompt's tokens read off the body
      (`prompt_token_bound`), or None when the body admits no cheap bound.
    last_prompt_bound: the body-length bound of the turn `last_prompt_tokens` was read
      for; a session with history is bounded by its exact size plus its body's growth
      since (`history_bound`).
    replica_idle_sec: how long the replica has had no turn in flight (through this gate,
      and none running or waiting in the engine where it says so); None while busy.
    expected_gap_sec: the replica's smoothed gap between a session's turns (the idle
      time before a holder in a tool call comes back); None before any gap was seen.
    replica_empty_share: the share of the replica's recent wall time that it had no turn
      in flight through this gate (`SessionBook.empty_share`, metered as the engine's
      `busy_share`); 0 before its first turn.
    waited_sec: how long this attempt has been held so far.
    recent_turn_sec: the session's recent turn service time (admission to release,
      smoothed), else the replica's; None before any turn ended on the replica.
    tokens_per_byte: the replica's recent highest ratio of a probed prompt's tokens to
      its body's bytes (`SessionBook.tokens_per_byte`), None before any probe.
    prefix_probe_sec: how long a turn has recently waited for a prefix probe on this
      replica (smoothed), None before any.
    priority_field: the turn's route carries vLLM's `priority` field
      (`kvgate.wire.routes.PRIORITY_FIELD_KINDS`).
    own_prefix_share: the share of a held newcomer's own prefix that holding it keeps
      for its next turn on this replica, measured (`gate.holding_value.HoldingValue`);
      1 before any measurement.
    held_got_window: the share of the newcomers held on this replica that were admitted
      with a window in the end (of those let in from the head of the queue or with a
      window), measured likewise; 1 before any measurement.
    An anonymous turn has only `anonymous` and `max_output_tokens`; the rest read as
    their defaults (False, 0, None).
    """

    @property
    def anonymous(self) -> bool: ...
    @property
    def has_window(self) -> bool: ...
    @property
    def idle_window_blocks(self) -> int: ...
    def late_windows(self) -> tuple[int, float | None]: ...
    @property
    def older_window_blocks(self) -> int: ...
    @property
    def other_window_blocks(self) -> int: ...
    @property
    def max_output_tokens(self) -> int: ...
    @property
    def waiters_ahead(self) -> int: ...
    @property
    def last_prompt_tokens(self) -> int | None: ...
    @property
    def prompt_bound_tokens(self) -> int | None: ...
    @property
    def last_prompt_bound(self) -> int | None: ...
    @property
    def replica_idle_sec(self) -> float | None: ...
    @property
    def expected_gap_sec(self) -> float | None: ...
    @property
    def replica_empty_share(self) -> float: ...
    @property
    def waited_sec(self) -> float: ...
    @property
    def recent_turn_sec(self) -> float | None: ...
    @property
    def tokens_per_byte(self) -> float | None: ...
    @property
    def prefix_probe_sec(self) -> float | None: ...
    @property
    def priority_field(self) -> bool: ...
    @property
    def own_prefix_share(self) -> float: ...
    @property
    def held_got_window(self) -> float: ...


@dataclass(slots=True)
class WatermarkView:
    """What the watermark policy reads: whether the turn is anonymous and whether its
    session holds a window (`GateFacts` says what each means)."""

    anonymous: bool = False
    has_window: bool = False

    @classmethod
    def read(cls, facts: GateFacts) -> WatermarkView:
        return cls(anonymous=facts.anonymous, has_window=facts.has_window)


@dataclass(slots=True)
class WorkingSetView:
    """What the working_set policy reads (`GateFacts` says what each field means).

    The windows: `has_window`, `idle_window_blocks`, `older_window_blocks`,
    `other_window_blocks` (what a window priced at an upper bound must fit beside),
    `waiters_ahead` (its newcomers get windows in queue order: the oldest session first). The turn's price:
    `max_output_tokens`, the session's recorded sizes (`last_prompt_tokens`,
    `last_prompt_bound`), `prompt_bound_tokens` (a turn whose bound fits is admitted without a prefix probe)
    and `tokens_per_byte` (the work-conserving rule's estimate of an unprobed prompt).
    The work-conserving rule's holding cost: `replica_idle_sec`, `expected_gap_sec`,
    `replica_empty_share`, `waited_sec`, and `prefix_probe_sec` (the wait a probe would add); the share of the
    turn's own prefix its re-prefill counts: `own_prefix_share` (`held_got_window` while
    the engine queues). The cap on a
    held turn's wait: `waited_sec`, `recent_turn_sec`, and the late windows
    (`late_window_blocks`, `next_late_sec`), read from the facts only when the cap
    asks for them (`late_windows`, called at most once).
    Forwarding a held turn at low priority instead (`held_priority`): `priority_field`.
    Anonymous turns, and replicas without block counts, are decided by the watermark
    policy (`watermark`).
    """

    anonymous: bool = False
    has_window: bool = False
    idle_window_blocks: int = 0
    older_window_blocks: int = 0
    other_window_blocks: int = 0
    max_output_tokens: int = 0
    waiters_ahead: int = 0
    last_prompt_tokens: int | None = None
    prompt_bound_tokens: int | None = None
    last_prompt_bound: int | None = None
    replica_idle_sec: float | None = None
    expected_gap_sec: float | None = None
    replica_empty_share: float = 0.0
    waited_sec: float = 0.0
    tokens_per_byte: float | None = None
    recent_turn_sec: float | None = None
    prefix_probe_sec: float | None = None
    late_windows: LateWindows = field(default=no_late_windows, compare=False)
    priority_field: bool = False
    own_prefix_share: float = 1.0
    held_got_window: float = 1.0

    @property
    def late_window_blocks(self) -> int:
        return self.late_windows()[0]

    @property
    def next_late_sec(self) -> float | None:
        return self.late_windows()[1]

    @classmethod
    def read(cls, facts: GateFacts) -> WorkingSetView:
        """The view of `facts`: each field read off the fact of the same name (the late
        windows as the accessor itself, called only by the policy branch that needs them)."""
        return cls(**{name: getattr(facts, name) for name in _WORKING_SET_FIELDS})

    @classmethod
    def read_calm(cls, facts: GateFacts) -> WorkingSetView:
        """The part of the view the calm rule (`working_set_calm`) reads, in O(1): what
        `bounded_footprint` and `at_low_priority` read, the rest at its defaults. For a
        turn with no waiter at the gate (`waiters_ahead` 0) only."""
        return cls(
            anonymous=facts.anonymous,
            has_window=facts.has_window,
            idle_window_blocks=facts.idle_window_blocks,
            other_window_blocks=facts.other_window_blocks,
            max_output_tokens=facts.max_output_tokens,
            last_prompt_tokens=facts.last_prompt_tokens,
            prompt_bound_tokens=facts.prompt_bound_tokens,
            last_prompt_bound=facts.last_prompt_bound,
            priority_field=facts.priority_field,
        )

    @classmethod
    def read_price(cls, facts: GateFacts) -> WorkingSetView:
        """The part of the view `pricing.window_footprint` reads (the turn's output allowance),
        the rest at its defaults: what a window's repricing from a turn's usage builds, read
        off the facts as `read` does."""
        return cls(max_output_tokens=facts.max_output_tokens)

    @property
    def watermark(self) -> WatermarkView:
        """The same turn as the watermark policy sees it (this policy's fallback)."""
        return WatermarkView(anonymous=self.anonymous, has_window=self.has_window)


# Every field of the view is a fact of the same name: one list, read off the class.
_WORKING_SET_FIELDS = tuple(f.name for f in fields(WorkingSetView))
