"""A turn's price in KV-cache blocks: exact from a prefix reading, or bounded and
estimated from its body, and the blocks the working_set policy may hand out.

Windows are priced at bounds or exact sizes (an under-priced window would over-commit
the cache); `estimated_prompt_tokens` is the one estimate, for the work-conserving
rule, whose admissions hold no window.
"""

from __future__ import annotations

import math

from kvgate.gate.pins import pins_pay
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.request_body import body_bytes
from kvgate.gate.settings import GateSettings
from kvgate.wire.blocks import cdiv

# Tokens a session's prompt may have gained since its last exact size beyond its body's
# byte growth: the template markers of appended messages are fewer than the bytes of
# their JSON wrappers, so this only covers small rewrites of earlier messages.
HISTORY_MARGIN_TOKENS = 64


def history_bound(view: WorkingSetView) -> int | None:
    """The tightest upper bound on the prompt's tokens: the body-length bound, or, for a
    session with an exact size on record, that size plus the body's growth since
    (+ HISTORY_MARGIN_TOKENS), whichever is smaller. None: no bound (media)."""
    bound = view.prompt_bound_tokens
    if bound is None or view.last_prompt_tokens is None or view.last_prompt_bound is None:
        return bound
    grown = view.last_prompt_tokens + max(0, bound - view.last_prompt_bound) + HISTORY_MARGIN_TOKENS
    return min(bound, grown)


def estimated_prompt_tokens(view: WorkingSetView) -> int | None:
    """The prompt's expected tokens, for the work-conserving rule's price: never above
    `history_bound`, and at the replica's observed `tokens_per_byte` (the highest of its
    recent probed turns) when there is one: the session's exact size on record plus its
    body's growth since at that ratio, or, without history, its whole body at that ratio.

    An estimate, not a bound: windows are priced at bounds (an under-priced window would
    over-commit the cache), but a `work_conserving` admission holds no window, and its
    rule is an economic judgment that a bound 2-5x the real prompt (a token per byte,
    plus a template margin that a short prompt does not use) would turn into a hold or
    a probe it did not need.
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


def footprint_blocks(prefix: PrefixReading, usage: UsageReading, max_output_tokens: int) -> int:
    """Blocks a turn occupies by the end of its generation: ceil((prompt + output) / block_size),
    what its window keeps through the session's next tool call. Needs `prefix.total_tokens`
    and `usage.block_size`; without the first it is the prompt's full blocks plus the
    output's, without the block size only the prompt's full blocks (the probe API always
    reports both).
    """
    block_size = usage.block_size
    if not block_size:
        return prefix.total_blocks
    if prefix.total_tokens:
        return cdiv(prefix.total_tokens + max_output_tokens, block_size)
    return prefix.total_blocks + cdiv(max_output_tokens, block_size)


def usable_blocks(usage: UsageReading, settings: GateSettings) -> int:
    """The blocks windows may hold: the replica's total less `headroom_blocks`."""
    assert usage.num_total_blocks is not None
    return usage.num_total_blocks - settings.headroom_blocks


def windows_pinned(usage: UsageReading, settings: GateSettings) -> bool:
    """The gate pins the windows it admits for on this replica (`gate.pins: auto`, and the
    replica keeps KV pins and has no CPU tier that holds its evictions: `pins_pay`): an
    idle window's blocks stay resident unless a request the engine could not otherwise
    fit needs them (gate/pins.py)."""
    return settings.pins == "auto" and pins_pay(usage)


def free_budget(view: WorkingSetView, usage: UsageReading, settings: GateSettings) -> int:
    """vLLM's free blocks a newcomer may take: outside other sessions' idle windows and
    the headroom (may be negative). On a replica that keeps KV pins, the pinned blocks
    (the idle windows the gate pinned) are already outside vLLM's free blocks: only the
    idle windows' footprints beyond them are taken off again."""
    assert usage.num_free_blocks is not None
    pinned = usage.num_pinned_blocks or 0 if windows_pinned(usage, settings) else 0
    idle_unpinned = max(0, view.idle_window_blocks - pinned)
    return usage.num_free_blocks - idle_unpinned - settings.headroom_blocks


def bounded_footprint(view: WorkingSetView, usage: UsageReading, settings: GateSettings) -> int | None:
    """The footprint to admit a turn at without a prefix probe, or None to probe.

    The turn is priced at its upper bound (`history_bound` + output allowance, in
    blocks). If even that fits beside every other window (`other_window_blocks`), and,
    for a newcomer, fits vLLM's free blocks outside idle windows and headroom, the
    exact price cannot change the answer, so the probe (a round trip into the engine
    core, up to one scheduler step) is skipped: when caches are not full a turn
    costs one shared usage reading. Windows priced this way are over-priced until
    their holder's next probed turn re-prices them; that only makes the policy probe
    sooner.

    Beside every other window, not only behind the older ones: windows rank by when
    they opened, so an over-priced holder's window would crowd the younger sessions'
    windows out of the books, and each would lose its window at its next turn (a
    bound is often several times the prompt) before the repricing set it right.
    """
    bound = history_bound(view)
    if bound is None or not usage.block_size:
        return None
    assert usage.num_total_blocks is not None and usage.num_free_blocks is not None
    footprint = cdiv(bound + view.max_output_tokens, usage.block_size)
    if footprint + view.other_window_blocks > usable_blocks(usage, settings):
        return None
    if not view.has_window:
        prompt_blocks = bound // usage.block_size
        if prompt_blocks > free_budget(view, usage, settings):
            return None
    return footprint


def reprice_threshold(usage: UsageReading, settings: GateSettings) -> int:
    """Window blocks above which a window priced at its upper bound gets its exact price
    (`Admit.reprice_above`): half the usable blocks. Below that, over-priced windows
    cannot hold anyone back (a bound that fits skips the probe), so no probe is spent."""
    return usable_blocks(usage, settings) // 2


def window_footprint(view: WorkingSetView, usage: UsageReading, prefix: PrefixReading, settings: GateSettings) -> int:
    """The exact price of the deciding session's window: its footprint (prompt + output
    allowance, `footprint_blocks`), capped at the usable blocks so that a large allowance
    alone never strands a turn. Needs block counts. The session's growth before its next
    turn is not priced (docs/decisions/windows-at-their-size.md)."""
    assert usage.num_total_blocks is not None
    return min(footprint_blocks(prefix, usage, view.max_output_tokens), usable_blocks(usage, settings))


def reclaim_window(
    view: WorkingSetView, usage: UsageReading, prefix: PrefixReading, settings: GateSettings
) -> tuple[int, int] | None:
    """A window for a newcomer made of late idle windows (`late_window_blocks`: other
    sessions idle longer than their usual gap): (its footprint, the blocks of late
    windows that must end for it to fit), or None if ending every late window would not
    make room.

    It fits when its footprint plus every window left stays within usable, and its
    new blocks within vLLM's free blocks outside the idle windows left and headroom:
    each block of an idle window that ends counts once in both (an idle window's
    blocks are cached but free in vLLM's count). Needs block counts.
    """
    usable = usable_blocks(usage, settings)
    footprint = window_footprint(view, usage, prefix, settings)
    over_books = footprint + view.older_window_blocks - usable
    over_engine = prefix.new_blocks - free_budget(view, usage, settings)
    blocks = max(0, over_books, over_engine)
    return (footprint, blocks) if blocks <= view.late_window_blocks else None
