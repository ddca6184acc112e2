"""Admission policies: pure functions from (gate view, readings, settings) to a decision.

A policy is two functions (DESIGN.md sections 2-4):

- `needs_prefix_probe(view, usage, settings) -> bool`: whether the gate must ask the
  prefix probe before deciding. The gate asks only when this says so, so the common
  path (no pressure, or a session that holds a window) costs one shared usage reading.
- `decide(view, usage, prefix, settings) -> Admit | Wait | Reject`.

`usage is None` means the usage probe failed (usage unknown); `prefix is None` means
the prefix probe is unavailable (not asked, unsupported route, replica without the
probe API, or a failed probe). Invariant tested for every policy: whenever
`needs_prefix_probe` is False, `decide` gives the same answer for any `prefix`.

The working_set policy is a working-set admission control priced by the gate's own books
(docs/gate.md), made work-conserving (`work_conserving`: a held turn goes in when
holding it costs the replica more than the re-prefill its admission causes), with
windows that end when their session goes quiet (`quiet_lifetime`): every window has a
footprint in blocks (anticipated: the prompt, the output allowance and the session's
growth per turn), windows rank by when they opened, and a turn fits if its
footprint plus the footprints of the windows older than its own fits the usable blocks.
`footprint_blocks`, `turn_growth_tokens` and `output_allowance` are the pure helpers it
uses.

`POLICIES` maps `gate.policy` names to policies, so adding or comparing one is a
dict entry. Nothing here touches asyncio, clocks or I/O: the simulator can call the
same functions in virtual time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.settings import GateSettings
from kvgate.wire.blocks import cdiv


class AdmissionReason(StrEnum):
    """Why a turn was admitted. The values are part of the contract (SPEC.md, docs/gate.md):
    the `x-kvgate-admission` header and the `reason` label of `kvgate_admissions_total`."""

    OPEN = "open"
    ANONYMOUS = "anonymous"
    HOLDS_WINDOW = "holds_window"
    PREFIX_PROBE_UNAVAILABLE = "prefix_probe_unavailable"
    RESIDENT_PREFIX = "resident_prefix"
    WINDOW_FITS = "window_fits"
    WORK_CONSERVING = "work_conserving"


class WaitCause(StrEnum):
    """Why a turn is held (`Wait.cause`; `Wait.why` adds the figures)."""

    ANONYMOUS_ABOVE_WATERMARK = "anonymous_above_watermark"  # anonymous turns see the watermark only
    COLD_PREFIX = "cold_prefix"  # watermark: above the watermark, its prefix not resident
    BEHIND_WAITERS = "behind_waiters"  # working_set: a newcomer with named waiters ahead (windows in FIFO order)
    WINDOW_LOST = "window_lost"  # working_set: a holder that no longer fits behind the older windows
    WINDOWS_FULL = "windows_full"  # working_set: its footprint does not fit beside the windows
    NO_FREE_BLOCKS = "no_free_blocks"  # working_set: vLLM lacks free blocks outside idle windows and headroom
    WORTH_HOLDING = "worth_holding"  # work-conserving rule: the re-prefill costs more than holding (or unmeasured)


class RejectCode(StrEnum):
    """Why a turn was refused for good: the error `code` the client gets (SPEC.md)."""

    PROMPT_TOO_LONG = "prompt_too_long"


@dataclass(frozen=True, slots=True)
class GateView:
    """What the gate knows about the deciding request and its replica's sessions.

    anonymous: the request has no session id (it never holds a window).
    has_window: the session holds a live (unexpired) window on this replica.
    idle_window_blocks: the footprints of *other* sessions' idle windows.
    older_window_blocks: the footprints of the windows that rank before this session's
      own (opened earlier), in flight or idle; all windows when the session holds
      none. Only the working_set policy reads it.
    max_output_tokens: the request's output allowance (`output_allowance(body)`).
    last_prompt_tokens: the prompt tokens of the session's last admitted turn on this
      replica with a prefix reading (None: no history). Only the working_set policy reads it.
    last_growth_tokens: the growth per turn the session last showed (`turn_growth_tokens`),
      kept for a re-sent turn whose prompt did not change.
    mean_growth_tokens: the replica's mean observed growth per turn, the price of a
      session's growth before it has any history.
    waiters_ahead: named sessions queued at the gate ahead of this attempt (all of
      them for an attempt not queued yet). Only the working_set policy reads it: its
      newcomers get windows in strict FIFO order (one behind others can only go in
      `work_conserving`, without a window).
    prompt_bound_tokens: an upper bound on the prompt's tokens read off the body
      (`prompt_token_bound`), or None when the body admits no cheap bound. The
      working_set policy admits without a prefix probe when even the bound fits.
    last_prompt_bound: the body-length bound of the turn `last_prompt_tokens` was read
      for; a session with history is bounded by its exact size plus its body's growth
      since (`history_bound`).
    replica_idle_sec: how long the replica has had no turn in flight (through this gate,
      and none running or waiting in the engine where it says so); None while busy.
    expected_gap_sec: the replica's smoothed gap between a session's turns (the idle
      time before a holder in a tool call comes back); None before any gap was seen.
    waited_sec: how long this attempt has been held so far.
    Only the working_set policy's work-conserving rule reads the last three.
    tokens_per_byte: the replica's recent highest ratio of a probed prompt's tokens to
      its body's bytes (`SessionBook.tokens_per_byte`), None before any probe. The
      work-conserving rule prices an unprobed turn with it (`estimated_prompt_tokens`).
    """

    anonymous: bool = False
    has_window: bool = False
    idle_window_blocks: int = 0
    older_window_blocks: int = 0
    max_output_tokens: int = 0
    waiters_ahead: int = 0
    last_prompt_tokens: int | None = None
    last_growth_tokens: int = 0
    mean_growth_tokens: int = 0
    prompt_bound_tokens: int | None = None
    last_prompt_bound: int | None = None
    replica_idle_sec: float | None = None
    expected_gap_sec: float | None = None
    waited_sec: float = 0.0
    tokens_per_byte: float | None = None


@dataclass(frozen=True, slots=True)
class Admit:
    """Forward the request now. The shell obeys every field; it infers nothing.

    window: the session holds a window for this turn: every Admit with window=True
    opens or renews exactly one window (on release it becomes idle); with False the
    turn goes without one, and a window the session held ends (cause `revoked`).
    footprint: the window's price in blocks (None keeps its last price).
    reprice_above: the price is an upper bound read off the body (no prefix probe):
    once the windows hold more than this many blocks, the shell gets the exact price
    from a prefix probe run beside the forwarded turn. None: the price is exact.
    wake_next: the replica has room beyond this turn (no pressure read): the shell
    wakes the next waiter too, as it does whenever a queued attempt is admitted.
    """

    reason: AdmissionReason
    window: bool = False
    footprint: int | None = None
    reprice_above: int | None = None
    wake_next: bool = False


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
    """

    cause: WaitCause
    why: str = ""
    drop_window: bool = False
    recheck_sec: float | None = None  # decide again no later than this (the decision may change by then)
    wake_on_release: bool = False


@dataclass(frozen=True, slots=True)
class Reject:
    """Refuse the request for good (it can never be admitted on this replica)."""

    code: RejectCode
    message: str


Decision = Admit | Wait | Reject


@dataclass(frozen=True, slots=True)
class Policy:
    """A policy's two functions; `reads_prompt_bound`: the gate must fill
    `GateView.prompt_bound_tokens` (it costs one encoding of the body per turn)."""

    name: str
    needs_prefix_probe: Callable[[GateView, UsageReading | None, GateSettings], bool]
    decide: Callable[[GateView, UsageReading | None, PrefixReading | None, GateSettings], Decision]
    reads_prompt_bound: bool = False


def output_allowance(body: Mapping[str, object]) -> int:
    """Output tokens a request may generate: `max_completion_tokens`, else `max_tokens`
    (chat, completion, Anthropic messages), else `max_output_tokens` (Responses), else 0.

    vLLM reads the same fields (the first wins). Anything that is not a non-negative
    integer counts as absent (vLLM rejects such a request itself).
    """
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 0


# Tokens a chat template may add that are not in the request body (role markers, a
# default system prompt, tool-use instructions). Generous: a low bound would let the
# no-probe path under-price a turn, a high one only makes it probe sooner.
TEMPLATE_MARGIN_TOKENS = 512

# Content types whose tokens are not bounded by their bytes in the body (an image URL
# of 100 bytes renders to hundreds of tokens). orjson writes no spaces, and a quote
# inside a string is escaped, so these only match real JSON keys and values.
_MEDIA_MARKERS = (
    b'"type":"image',
    b'"type":"input_image',
    b'"type":"audio',
    b'"type":"input_audio',
    b'"type":"video',
    b'"type":"file',
    b'"type":"document',
    b'"image_url"',
    b'"prompt_embeds"',
)


def prompt_token_bound(body_json: bytes) -> int | None:
    """An upper bound on the tokens a text request renders to, from its JSON bytes.

    A token stands for at least one byte of the text it encodes, and the body holds
    every byte of the messages (JSON escaping only adds bytes), so the body's length
    plus TEMPLATE_MARGIN_TOKENS bounds the prompt. None when the body carries media,
    whose tokens its bytes do not bound.
    """
    if any(marker in body_json for marker in _MEDIA_MARKERS):
        return None
    return len(body_json) + TEMPLATE_MARGIN_TOKENS


def body_bytes(prompt_bound_tokens: int) -> int:
    """The body's JSON bytes behind a `prompt_token_bound` (its inverse)."""
    return max(0, prompt_bound_tokens - TEMPLATE_MARGIN_TOKENS)


# Tokens a session's prompt may have gained since its last exact size beyond its body's
# byte growth: the template markers of appended messages are fewer than the bytes of
# their JSON wrappers, so this only covers small rewrites of earlier messages.
HISTORY_MARGIN_TOKENS = 64


def history_bound(view: GateView) -> int | None:
    """The tightest upper bound on the prompt's tokens: the body-length bound, or, for a
    session with an exact size on record, that size plus the body's growth since
    (+ HISTORY_MARGIN_TOKENS), whichever is smaller. None: no bound (media)."""
    bound = view.prompt_bound_tokens
    if bound is None or view.last_prompt_tokens is None or view.last_prompt_bound is None:
        return bound
    grown = view.last_prompt_tokens + max(0, bound - view.last_prompt_bound) + HISTORY_MARGIN_TOKENS
    return min(bound, grown)


def estimated_prompt_tokens(view: GateView) -> int | None:
    """The prompt's expected tokens, for the work-conserving rule's price: never above
    `history_bound`, and at the replica's observed `tokens_per_byte` (the highest of its
    recent probed turns) when there is one: the session's exact size on record plus its
    body's growth since at that ratio, or, without history, its whole body at that ratio.

    An estimate, not a bound: windows are priced at bounds (an under-priced window would
    over-commit the cache), but a `work_conserving` admission holds no window, and its
    rule is an economic judgment that a bound 2-5x the real prompt (a token per byte,
    plus a template margin that a short prompt does not use) turns into a hold or a
    probe it did not need (issue 9: 56 of 91 probed turns on the tiny real-vLLM model
    went in work_conserving all the same).
    """
    bound = history_bound(view)
    ratio = view.tokens_per_byte
    if bound is None or ratio is None or view.prompt_bound_tokens is None:
        return bound
    if view.last_prompt_tokens is not None and view.last_prompt_bound is not None:
        grown_bytes = max(0, view.prompt_bound_tokens - view.last_prompt_bound)
        estimate = view.last_prompt_tokens + math.ceil(grown_bytes * ratio)
    else:
        estimate = math.ceil(body_bytes(view.prompt_bound_tokens) * ratio)
    return min(bound, estimate)


def footprint_blocks(prefix: PrefixReading, usage: UsageReading, max_output_tokens: int, growth_tokens: int = 0) -> int:
    """Blocks a turn occupies by the end of its generation: ceil((prompt + output) / block_size).

    With `growth_tokens` it is the *anticipated* footprint: ceil((prompt + output +
    growth) / block_size), what the session will need on its next turn if it grows as
    it did on its last (`turn_growth_tokens`). Needs `prefix.total_tokens` and
    `usage.block_size`; without the first it is the prompt's full blocks plus the
    output's and the growth's blocks, without the block size only the prompt's full
    blocks (the probe API always reports both).
    """
    block_size = usage.block_size
    if not block_size:
        return prefix.total_blocks
    if prefix.total_tokens:
        return cdiv(prefix.total_tokens + max_output_tokens + growth_tokens, block_size)
    return prefix.total_blocks + cdiv(max_output_tokens + growth_tokens, block_size)


def turn_growth_tokens(
    prompt_tokens: int | None, last_prompt_tokens: int | None, last_growth_tokens: int, mean_growth_tokens: int
) -> int:
    """Prompt tokens a session added per turn, from its recorded sizes; never negative.

    - no history (`last_prompt_tokens` None) or no token count: `mean_growth_tokens`
      (the replica's mean observed growth per turn; 0 before any observation).
    - a prompt larger than the last: the difference (tokens added since the last turn).
    - the same prompt (a re-sent turn): `last_growth_tokens`, the growth it last showed.
    - a smaller prompt (the context was compacted): 0.
    """
    if last_prompt_tokens is None or not prompt_tokens:
        return max(0, mean_growth_tokens)
    if prompt_tokens == last_prompt_tokens:
        return max(0, last_growth_tokens)
    return max(0, prompt_tokens - last_prompt_tokens)


def quiet_lifetime(
    session_gap: float | None, replica_gap: float | None, factor: float, floor: float, ceiling: float
) -> float:
    """How long an idle window lives: `factor` x the session's usual gap between turns
    (else the replica's, for a session with no gap yet), at least `floor`, at most
    `ceiling` (`idle_grace_sec`). A session that ends without saying so frees its
    window about `factor` tool calls after its last turn instead of after the grace.
    With no gap measured anywhere: the floor."""
    gap = session_gap if session_gap is not None else replica_gap
    lifetime = floor if gap is None else max(floor, factor * gap)
    return max(0.0, min(lifetime, ceiling))


def reprefill_sec(evicted_blocks: int, usage: UsageReading) -> float | None:
    """Seconds the replica will spend computing again `evicted_blocks` of other sessions'
    windows, at its measured prefill throughput; None without a measurement."""
    if not usage.prefill_tokens_per_sec or not usage.block_size:
        return None
    return max(0, evicted_blocks) * usage.block_size / usage.prefill_tokens_per_sec


# A busy replica's decode slack must exceed the re-prefill twice over (see holding_cost_sec).
# Measured on the simulated regimes: at 1, prefill-bound sessions went in work-conserving
# while their contexts were short and came back cold (0.73x sticky, 0.52 of the ceiling).
DECODE_SLACK_MARGIN = 2.0


def holding_cost_sec(view: GateView, usage: UsageReading) -> float:
    """Engine time that holding the turn back leaves unused.

    - on a busy replica: the part of its decode (`max_output_tokens` x the measured
      decode step) that batching would give for free, i.e. outside the engine's
      measured prefill share (a decode-bound engine takes another sequence into its
      batch at almost no cost, a prefill-bound one has no such slack), counted at
      1 / DECODE_SLACK_MARGIN: the slack is a forecast, the re-prefill a certainty, and
      a session admitted without a window grows into dearer turns;
    - on an idle replica, also the idle time ahead (the replica's expected gap before
      a holder in a tool call returns) and the idle time it already waited (the
      ski-rental rule: never wait, idle, longer than the re-prefill it would cause).
    """
    slack = 1.0 - (usage.prefill_share or 0.0)
    cost = view.max_output_tokens * (usage.decode_step_sec or 0.0) * slack / DECODE_SLACK_MARGIN
    if view.replica_idle_sec is not None:
        cost = max(cost, view.expected_gap_sec or 0.0, min(view.replica_idle_sec, view.waited_sec))
    return cost


def work_conserving(view: GateView, usage: UsageReading, evicted_blocks: int, settings: GateSettings) -> Wait | None:
    """None: admit the held turn `work_conserving`, its admission causes less re-prefill
    (`reprefill_sec` of the `evicted_blocks` it pushes out of other windows) than the
    compute holding it leaves unused (`holding_cost_sec`). Else the Wait to return,
    with a recheck time when waiting on an idle replica will tip the balance.
    No prefill measurement yet: hold (as the working_set policy always did)."""
    reprefill = reprefill_sec(evicted_blocks, usage) if settings.work_conserving else None
    if reprefill is None:
        return Wait(WaitCause.WORTH_HOLDING, "no prefill-throughput measurement: holding")
    holding = holding_cost_sec(view, usage)
    if reprefill <= holding:
        return None
    recheck = None
    if view.replica_idle_sec is not None:
        recheck = reprefill - min(view.replica_idle_sec, view.waited_sec)
    return Wait(
        WaitCause.WORTH_HOLDING, f"re-prefill {reprefill:.3f}s > holding cost {holding:.3f}s", recheck_sec=recheck
    )


def evicted_window_blocks(view: GateView, usage: UsageReading, prefix: PrefixReading, budget: int, usable: int) -> int:
    """Blocks of other sessions' windows that admitting this turn (without a window)
    pushes out of the cache, now or when they go idle.

    The turn allocates its prompt's new blocks and its output's (`need`). In the gate's
    books the windows older than it (all of them for a newcomer) own their footprints;
    what `need` takes beyond the rest of the `usable` blocks comes out of theirs. In
    vLLM's view, what it takes beyond `budget` (the free blocks outside idle windows
    and headroom) comes out of idle windows' cached blocks now. The larger of the two,
    at most the windows' blocks.
    """
    block_size = usage.block_size or 1
    need = prefix.new_blocks + cdiv(view.max_output_tokens, block_size)
    windows = view.older_window_blocks
    spare = usable - windows
    by_books = min(windows, need - max(0, spare))
    by_engine = min(view.idle_window_blocks, need - max(0, budget))
    return max(0, by_books, by_engine)


def can_work_conserve(usage: UsageReading, settings: GateSettings) -> bool:
    """The work-conserving rule is on and has the replica's prefill throughput to price with."""
    return settings.work_conserving and reprefill_sec(0, usage) is not None


def _behind(view: GateView) -> bool:
    """A newcomer (no window) with named waiters queued ahead of it."""
    return not view.has_window and view.waiters_ahead > 0


def _open(view: GateView, settings: GateSettings) -> Admit:
    """Admit `open` (no pressure read, or usage unknown): the next waiter may pass too, and
    a session that already owns a window keeps and renews it."""
    keep = settings.retain_session and view.has_window and not view.anonymous
    return Admit(AdmissionReason.OPEN, window=keep, wake_next=True)


# ---------------------------------------------------------------- watermark policy


def watermark_needs_prefix_probe(view: GateView, usage: UsageReading | None, settings: GateSettings) -> bool:
    """Only above the watermark, and only for named sessions without a window."""
    return (
        usage is not None
        and usage.kv_cache_usage >= settings.high_watermark
        and not view.anonymous
        and not view.has_window
    )


def watermark_decide(
    view: GateView, usage: UsageReading | None, prefix: PrefixReading | None, settings: GateSettings
) -> Decision:
    """DESIGN.md section 2's tree.

    - usage unknown (probe failed): admit `open` (the probe error metric says why).
    - anonymous: below the watermark `anonymous`, at or above it wait; never a window.
    - below the watermark: `open` (a session's existing window is kept and renewed).
    - at or above it: `holds_window` if the session owns a window; else
      `prefix_probe_unavailable` if there is no prefix reading; else `resident_prefix`
      if hit_ratio >= hit_threshold; else wait.
    With retain_session, `holds_window` and `resident_prefix` hold a window.
    """
    if usage is None:
        return _open(view, settings)
    pressure = usage.kv_cache_usage >= settings.high_watermark
    if view.anonymous:
        if pressure:
            return Wait(WaitCause.ANONYMOUS_ABOVE_WATERMARK, "anonymous request above the watermark")
        return Admit(AdmissionReason.ANONYMOUS, wake_next=True)
    if not pressure:
        return _open(view, settings)
    if view.has_window:
        return Admit(AdmissionReason.HOLDS_WINDOW, window=settings.retain_session)
    if prefix is None:
        return Admit(AdmissionReason.PREFIX_PROBE_UNAVAILABLE)
    if prefix.hit_ratio >= settings.hit_threshold:
        return Admit(AdmissionReason.RESIDENT_PREFIX, window=settings.retain_session, footprint=prefix.total_blocks)
    return Wait(WaitCause.COLD_PREFIX, "cold prefix above the watermark")


WATERMARK = Policy("watermark", watermark_needs_prefix_probe, watermark_decide)


# ------------------------------------------------------------ working_set policy


def usable_blocks(usage: UsageReading, settings: GateSettings) -> int:
    """The blocks windows may hold: the replica's total less `headroom_blocks`."""
    assert usage.num_total_blocks is not None
    return usage.num_total_blocks - settings.headroom_blocks


def free_budget(view: GateView, usage: UsageReading, settings: GateSettings) -> int:
    """vLLM's free blocks a newcomer may take: outside other sessions' idle windows and
    the headroom (may be negative)."""
    assert usage.num_free_blocks is not None
    return usage.num_free_blocks - view.idle_window_blocks - settings.headroom_blocks


def bounded_footprint(view: GateView, usage: UsageReading, settings: GateSettings) -> int | None:
    """The footprint to admit a turn at without a prefix probe, or None to probe.

    The turn is priced at its upper bound (`history_bound` + output allowance +
    growth, in blocks). If even that fits behind the older windows, and, for a
    newcomer, fits vLLM's free blocks outside idle windows and headroom, the exact
    price cannot change the answer, so the probe (a round trip into the engine
    core, up to one scheduler step) is skipped: when caches are not full a turn
    costs one shared usage reading. Windows priced this way are over-priced until
    their holder's next probed turn re-prices them; that only makes the policy probe
    sooner.
    """
    bound = history_bound(view)
    if bound is None or not usage.block_size:
        return None
    assert usage.num_total_blocks is not None and usage.num_free_blocks is not None
    growth = view.last_growth_tokens if view.last_prompt_tokens is not None else view.mean_growth_tokens
    tokens = bound + view.max_output_tokens + growth
    footprint = cdiv(tokens, usage.block_size)
    if footprint + view.older_window_blocks > usable_blocks(usage, settings):
        return None
    if not view.has_window:
        prompt_blocks = bound // usage.block_size
        if prompt_blocks > free_budget(view, usage, settings):
            return None
    return footprint


def unprobed_work_conserving(view: GateView, usage: UsageReading, settings: GateSettings) -> bool:
    """Whether a newcomer goes in `work_conserving` without a prefix probe: the rule
    admits it at its estimated price (its prompt at `estimated_prompt_tokens`, none of
    it cached). Asking would only make it wait for the probe, which a CPU engine answers
    between two scheduler steps (issue 9: 20-500 ms, 85% of the gate's added wait on
    the tiny real-vLLM model once holds were priced right), and load the server's API
    process, which renders and tokenizes the whole chat for it (on the tiny model a
    background prefix-probe load at the gate's rate cost sticky 1.10-1.28x). A window
    the exact price might have given it is not worth that: it would protect a prefix
    whose re-prefill costs less than holding the turn. (A turn whose upper bound fits a
    window gets one first: `bounded_footprint`.)
    """
    if view.has_window or not can_work_conserve(usage, settings) or not usage.has_blocks:
        return False
    tokens = estimated_prompt_tokens(view)
    if tokens is None:
        return False
    assert usage.block_size  # has_blocks
    blocks = cdiv(tokens, usage.block_size)
    cold = PrefixReading(total_blocks=blocks, hit_blocks=0, hit_ratio=0.0, total_tokens=tokens)
    budget, usable = free_budget(view, usage, settings), usable_blocks(usage, settings)
    at_risk = evicted_window_blocks(view, usage, cold, budget, usable) + blocks
    return work_conserving(view, usage, at_risk, settings) is None


def reprice_threshold(usage: UsageReading, settings: GateSettings) -> int:
    """Window blocks above which a window priced at its upper bound gets its exact price
    (`Admit.reprice_above`): half the usable blocks. Below that, over-priced windows
    cannot hold anyone back (a bound that fits skips the probe), so no probe is spent."""
    return usable_blocks(usage, settings) // 2


def window_footprint(view: GateView, usage: UsageReading, prefix: PrefixReading, settings: GateSettings) -> int:
    """The exact price of the deciding session's window: the anticipated footprint
    (prompt + output allowance + its growth per turn), capped at the usable blocks so
    that a large allowance alone never strands a turn. Needs block counts."""
    assert usage.num_total_blocks is not None
    growth = turn_growth_tokens(
        prefix.total_tokens, view.last_prompt_tokens, view.last_growth_tokens, view.mean_growth_tokens
    )
    return min(footprint_blocks(prefix, usage, view.max_output_tokens, growth), usable_blocks(usage, settings))


def working_set_needs_prefix_probe(view: GateView, usage: UsageReading | None, settings: GateSettings) -> bool:
    """For every named turn the working_set policy prices, holders included: the price is the prompt.

    At any usage: the watermark is exactly what this policy distrusts (idle windows
    hold no live blocks, so usage reads low while their prefixes are about to be
    evicted). Holders are probed too, so their footprint follows their growing prompt.
    A newcomer with named waiters ahead (it gets no window before them) only when the
    work-conserving rule could let it in (`can_work_conserve`). Not for a turn whose
    upper bound already fits (`bounded_footprint`: no pressure), nor for a newcomer
    the rule admits at its estimated price (`unprobed_work_conserving`), nor
    without block counts (the /metrics fallback: the watermark policy decides).
    """
    if usage is None or view.anonymous:
        return False
    if not usage.has_blocks:
        return watermark_needs_prefix_probe(view, usage, settings)
    if unprobed_work_conserving(view, usage, settings):
        return False
    if _behind(view):
        return can_work_conserve(usage, settings)
    return bounded_footprint(view, usage, settings) is None


def working_set_decide(
    view: GateView, usage: UsageReading | None, prefix: PrefixReading | None, settings: GateSettings
) -> Decision:
    """A working-set admission control priced by the gate's own books. The decision
    table, row by row, is docs/gate.md's (`working_set`); this states its invariants.

    Terms: usable = num_total_blocks - headroom_blocks; a turn's footprint is its
    anticipated window price (`window_footprint`: prompt + output allowance + growth
    per turn, capped at usable), or its upper bound (`bounded_footprint`) when the
    prefix probe is skipped; a holder is a session with a window, a newcomer one without.

    Invariants (each has a table test):
    - Every window admitted or renewed here fits behind the older windows: its
      footprint plus `older_window_blocks` <= usable. So the windows' footprints,
      summed oldest first, stay within usable, and the oldest holder always fits.
      `work_conserving` admissions hold no window, so they never break this.
    - A newcomer also fits vLLM's own view (new_blocks <= free blocks outside idle
      windows and headroom), which sees traffic the gate does not.
    - A newcomer with named waiters ahead gets no window before them (windows go in
      FIFO order); it goes in `work_conserving` or waits (unprobed where the rule
      cannot admit it). A holder is decided on its merits, whatever waits.
    - A newcomer that the work-conserving rule admits at its estimated price goes
      in unprobed (`unprobed_work_conserving`), unless its upper bound fits a
      window (`bounded_footprint`, checked first).
    - A holder that no longer fits waits as a newcomer (`Wait.drop_window`) unless
      it goes in `work_conserving`; a prompt that can never fit (its full blocks >
      usable) is rejected, never held.
    - A price read off the body (no prefix reading) is marked `Admit.reprice_above`;
      a holder without a prefix reading keeps its window at its last price.
    Without usage, for anonymous turns and without block counts it decides as the
    watermark policy does (`open` when usage is unknown).
    """
    if usage is None:
        return _open(view, settings)
    if view.anonymous or not usage.has_blocks:
        return watermark_decide(view, usage, prefix, settings)
    behind = _behind(view)
    bounded = None if behind else bounded_footprint(view, usage, settings)
    if bounded is not None:
        return Admit(
            AdmissionReason.HOLDS_WINDOW if view.has_window else AdmissionReason.WINDOW_FITS,
            window=settings.retain_session,
            footprint=bounded,
            reprice_above=reprice_threshold(usage, settings),
        )
    if unprobed_work_conserving(view, usage, settings):
        return Admit(AdmissionReason.WORK_CONSERVING)
    behind_why = f"behind {view.waiters_ahead} waiting sessions (first come, first served)"
    if behind and (prefix is None or not can_work_conserve(usage, settings)):
        return Wait(WaitCause.BEHIND_WAITERS, behind_why)
    if prefix is None:
        if view.has_window:  # cannot re-price it: keep the window at its last footprint
            return Admit(AdmissionReason.HOLDS_WINDOW, window=settings.retain_session)
        return watermark_decide(view, usage, prefix, settings)
    assert usage.num_total_blocks is not None and usage.num_free_blocks is not None
    usable = usable_blocks(usage, settings)
    if prefix.total_blocks > usable:
        return Reject(
            RejectCode.PROMPT_TOO_LONG,
            f"the prompt needs {prefix.total_blocks} KV-cache blocks but the replica has "
            f"{usage.num_total_blocks} (minus gate.headroom_blocks={settings.headroom_blocks}); "
            "shorten the prompt or serve it from a replica with a larger KV cache",
        )
    footprint = window_footprint(view, usage, prefix, settings)
    working_set = footprint + view.older_window_blocks
    budget = free_budget(view, usage, settings)
    if view.has_window and working_set <= usable:
        return Admit(AdmissionReason.HOLDS_WINDOW, window=settings.retain_session, footprint=footprint)
    if not view.has_window and not behind and working_set <= usable and prefix.new_blocks <= budget:
        return Admit(AdmissionReason.WINDOW_FITS, window=settings.retain_session, footprint=footprint)
    # Admitted without a window, its own prefix is unprotected: its next turn is expected
    # to compute it again, so it counts with the windows' blocks it pushes out.
    at_risk = evicted_window_blocks(view, usage, prefix, budget, usable) + prefix.total_blocks
    held = work_conserving(view, usage, at_risk, settings)
    if held is None:  # admitted without a window: the windows' books stay within usable
        return Admit(AdmissionReason.WORK_CONSERVING)
    if view.has_window:
        return Wait(
            WaitCause.WINDOW_LOST,
            f"window lost: footprint {footprint} blocks + {view.older_window_blocks} in older windows "
            f"exceeds {usable} usable blocks; {held.why}",
            drop_window=True,
            recheck_sec=held.recheck_sec,
        )
    if behind:  # no window before the waiters ahead; the rule decides again when blocks are freed
        return Wait(
            WaitCause.BEHIND_WAITERS, f"{behind_why}; {held.why}", recheck_sec=held.recheck_sec, wake_on_release=True
        )
    if working_set > usable:
        cause = WaitCause.WINDOWS_FULL
        why = f"footprint {footprint} blocks + {view.older_window_blocks} in windows exceeds {usable} usable blocks"
    else:
        cause = WaitCause.NO_FREE_BLOCKS
        why = f"needs {prefix.new_blocks} new blocks, {budget} free outside idle windows and headroom"
    return Wait(cause, f"{why}; {held.why}", recheck_sec=held.recheck_sec)


WORKING_SET = Policy("working_set", working_set_needs_prefix_probe, working_set_decide, reads_prompt_bound=True)


POLICIES: dict[str, Policy] = {p.name: p for p in (WATERMARK, WORKING_SET)}

# Policy names of earlier releases: refused, with the name to write instead (CHANGELOG.md).
RENAMED_POLICIES: dict[str, str] = {"seed": "watermark", "contract": "working_set"}


def policy_name_problem(name: object) -> str | None:
    """Why `name` is not a `gate.policy` (for the config's error), or None if it is one."""
    if name in POLICIES:
        return None
    if isinstance(name, str) and name in RENAMED_POLICIES:
        return f"renamed: write {RENAMED_POLICIES[name]!r} (CHANGELOG.md lists the renames)"
    return f"must be one of {', '.join(sorted(POLICIES))}"


def get_policy(name: str) -> Policy:
    if name in RENAMED_POLICIES:
        raise ValueError(f"gate.policy {name!r} was renamed {RENAMED_POLICIES[name]!r}; write that instead")
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown gate.policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}") from None
