"""What a policy can answer, and why: the decision types and their reasons and causes.

A policy's `decide` returns one of `Admit`, `Wait`, `Reject` (a `Decision`) or
`ProbeFirst`. `ProbeFirst` is an answer only to a call without a prefix reading
(`prefix=None`): the shell then asks the prefix probe and decides again with what it
got, a `PrefixReading` or `PREFIX_UNAVAILABLE`, and that second call always returns a
`Decision` (`registry.Policy.decide_read` enforces it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum

from kvgate.gate.readings import PrefixReading


class AdmissionReason(StrEnum):
    """Why a turn was admitted. The values are part of the contract (docs/reference.md):
    the `x-kvgate-admission` header and the `reason` label of `kvgate_admissions_total`."""

    OPEN = "open"
    ANONYMOUS = "anonymous"
    HOLDS_WINDOW = "holds_window"
    PREFIX_PROBE_UNAVAILABLE = "prefix_probe_unavailable"
    RESIDENT_PREFIX = "resident_prefix"
    WINDOW_FITS = "window_fits"
    WORK_CONSERVING = "work_conserving"
    WAIT_CAPPED = "wait_capped"
    LOW_PRIORITY = "low_priority"


class WaitCause(StrEnum):
    """Why a turn is held (`Wait.cause`; `Wait.why` adds the figures)."""

    ANONYMOUS_ABOVE_WATERMARK = "anonymous_above_watermark"  # anonymous turns see the watermark only
    COLD_PREFIX = "cold_prefix"  # watermark: above the watermark, its prefix not resident
    BEHIND_WAITERS = "behind_waiters"  # working_set: a newcomer with named waiters ahead (windows in queue order)
    WINDOW_LOST = "window_lost"  # working_set: a holder that no longer fits behind the older windows
    WINDOWS_FULL = "windows_full"  # working_set: its footprint does not fit beside the windows
    NO_FREE_BLOCKS = "no_free_blocks"  # working_set: vLLM lacks free blocks outside idle windows and headroom
    WORTH_HOLDING = "worth_holding"  # work-conserving rule: the re-prefill costs more than holding (or unmeasured)


class RejectCode(StrEnum):
    """Why a turn was refused for good: the error `code` the client gets (docs/reference.md, Errors)."""

    PROMPT_TOO_LONG = "prompt_too_long"


@dataclass(frozen=True, slots=True)
class Admit:
    """Forward the request now. The shell obeys every field; it infers nothing.

    window: the session holds a window for this turn: every Admit with window=True
    opens or renews exactly one window (on release it becomes idle); with False the
    turn goes without one, and a window the session held ends (cause `revoked`).
    footprint: the window's price in blocks (None keeps its last price).
    reprice_above: the price is an upper bound read off the body (no prefix probe):
    once the windows hold more than this many blocks, the shell gets the exact price
    from a prefix probe run beside the forwarded turn (`Policy.price`). None: the
    price is exact.
    wake_next: the replica has room beyond this turn (no pressure read): the shell
    wakes the next waiter too, as it does whenever a queued attempt is admitted.
    reclaim_blocks: before booking the turn, the shell ends other sessions' late idle
    windows (`late_after`; cause `reclaimed`), the longest idle first, until at least this
    many of their blocks are uncommitted: the turn's window is made of them.
    priority: forward the request with this vLLM `priority` (lower is served first;
    the replica schedules by priority); None: the body's own, as sent.
    """

    reason: AdmissionReason
    window: bool = False
    footprint: int | None = None
    reprice_above: int | None = None
    wake_next: bool = False
    reclaim_blocks: int = 0
    priority: int | None = None


@dataclass(frozen=True, slots=True)
class Wait:
    """Hold the request and decide again when woken.

    cause: why it waits (`WaitCause`); why: the same for people, with the figures.
    drop_window: the session loses its window before it waits (a holder that no longer
    fits behind the older windows; cause `lost`); it then waits as a newcomer.
    A Reject likewise ends the session's window (cause `revoked`): a session never
    holds a window while it waits or after it was refused.
    wake_on_release: the shell wakes it whenever blocks are freed (a release, a window
    that ended or shrank), not only when it heads the queue: a newcomer behind others
    that the work-conserving rule may let in once the cache has more room.
    poll: the shell re-decides it every `wait_poll_sec` as well. False: only what the
    shell sees change can change this decision (it heads the queue, blocks are freed
    with `wake_on_release`, the replica goes idle, `recheck_sec`), so it is not polled
    while another waiter heads the queue: a turn that waits behind others and that no
    freed block can let in.
    """

    cause: WaitCause
    why: str = ""
    drop_window: bool = False
    recheck_sec: float | None = None  # decide again no later than this (the decision may change by then)
    wake_on_release: bool = False
    poll: bool = True


@dataclass(frozen=True, slots=True)
class Reject:
    """Refuse the request for good (it can never be admitted on this replica)."""

    code: RejectCode
    message: str


@dataclass(frozen=True, slots=True)
class ProbeFirst:
    """Ask the prefix probe, then decide again with its answer: the reading would change
    the decision. Returned only to a call made without one (`prefix=None`)."""


PROBE_FIRST = ProbeFirst()

Decision = Admit | Wait | Reject


class PrefixUnavailable(Enum):
    """The prefix probe was asked and gave no reading (unsupported route, a replica
    without the probe API, or a failed probe)."""

    PREFIX_UNAVAILABLE = "prefix_unavailable"


PREFIX_UNAVAILABLE = PrefixUnavailable.PREFIX_UNAVAILABLE

# What the prefix probe gave, as `decide` is told: a reading or PREFIX_UNAVAILABLE. A call
# with None instead (not read yet) may answer ProbeFirst.
ProbedPrefix = PrefixReading | PrefixUnavailable
