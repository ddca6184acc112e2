"""The working_set policy: a working-set admission control priced by the gate's own books,
made work-conserving, with windows that end when their session goes quiet.

Every window has a footprint in blocks (the prompt and the output allowance), windows
rank by when they opened, and a turn fits
if its footprint plus the footprints of the windows older than its own fits the usable
blocks. The decision table, row by row, is docs/gate.md's (`working_set`).

Terms: usable = num_total_blocks - headroom_blocks; a turn's footprint is its
window price (`window_footprint`, capped at usable), or its upper bound
(`bounded_footprint`) when the prefix probe is skipped; a holder is a session with a
window, a newcomer one without.

Invariants (each has a table test):
- Every window admitted or renewed here fits behind the older windows: its
  footprint plus `older_window_blocks` <= usable. So the windows' footprints,
  summed oldest first, stay within usable, and the oldest holder always fits.
  `work_conserving` admissions hold no window, so they never break this.
- A newcomer also fits vLLM's own view (new_blocks <= free blocks outside idle
  windows and headroom), which sees traffic the gate does not.
- A newcomer with named waiters ahead gets no window before them (windows go in
  queue order: the oldest session's turn first); it goes in `work_conserving` or waits (without a probe where the rule
  cannot admit it). A holder is decided on its merits, whatever waits.
- A turn whose upper bound fits beside every other window gets its window without a
  probe (`bounded_footprint`); a newcomer that the work-conserving rule admits at its
  estimated price goes in without one (`unprobed_work_conserving`). Every other named turn is priced from its
  prefix reading (ProbeFirst), holders included: the price is the prompt, at any usage
  (idle windows hold no live blocks, so usage reads low while their prefixes are about
  to be evicted).
- A holder that no longer fits waits as a newcomer (`Wait.drop_window`) unless
  it goes in `work_conserving`; a prompt that can never fit (its full blocks >
  usable) is rejected, never held.
- A named turn that has waited its cap (`wait_cap_left`) and heads the queue goes in
  `wait_capped` as soon as a window can be made for it of late idle windows
  (`reclaim_window`: sessions idle longer than their usual gap; they end, the longest
  idle first, and the books stay within usable); until then it re-decides whenever
  blocks are freed. Behind other waiters it keeps its place (the oldest first). A holder
  that no longer fits, or a turn without block counts or a prefix reading, goes in at
  its cap without a window.
- With `held_priority` > 0 on a replica that schedules by priority, the named turns
  without a window go at that vLLM priority, and a turn that would wait whose new
  blocks fit vLLM's free blocks outside idle windows and headroom goes in
  `low_priority` instead, without a window (`low_priority.py`).
- A price read off the body (no prefix reading) is marked `Admit.reprice_above`;
  a holder whose probe gave no reading keeps its window at its last price.
Without usage, for anonymous turns and without block counts (the /metrics fallback)
it decides as the watermark policy does.
"""

from __future__ import annotations

from dataclasses import replace

from kvgate.gate.policies.economics import (
    at_risk_blocks,
    can_work_conserve,
    could_work_conserve,
    due_by,
    unpriced_admission,
    unprobed_work_conserving,
    wait_cap_left,
    work_conserving,
)
from kvgate.gate.policies.low_priority import at_low_priority
from kvgate.gate.policies.pricing import (
    bounded_footprint,
    free_budget,
    reclaim_window,
    reprice_threshold,
    usable_blocks,
    window_footprint,
)
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.vocabulary import (
    PROBE_FIRST,
    AdmissionReason,
    Admit,
    Decision,
    PrefixUnavailable,
    ProbedPrefix,
    ProbeFirst,
    Reject,
    RejectCode,
    Wait,
    WaitCause,
)
from kvgate.gate.policies.watermark import admit_open, watermark_decide
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.settings import GateSettings


def working_set_decide(
    view: WorkingSetView, usage: UsageReading | None, prefix: ProbedPrefix | None, settings: GateSettings
) -> Decision | ProbeFirst:
    """The module's policy: `_decide`, with every Wait of a named turn bounded by its cap
    (`_capped`); where the replica schedules by priority and `held_priority` says so, the
    turns without a window go at that priority (`at_low_priority`)."""
    decision = _decide(view, usage, prefix, settings)
    if isinstance(decision, Wait) and not view.anonymous:
        decision = _capped(decision, view, usage, prefix, settings)
    if isinstance(decision, ProbeFirst):
        return decision
    return at_low_priority(decision, view, usage, prefix, settings)


def _capped(
    wait: Wait, view: WorkingSetView, usage: UsageReading | None, prefix: ProbedPrefix | None, settings: GateSettings
) -> Decision | ProbeFirst:
    """`wait`, due again when its cap runs out (`wait_cap_left`); past its cap, the turn
    goes in `wait_capped` with a window made of late idle windows (`reclaim_window`):
    sessions sitting in a tool call longer than their usual gap (or gone quietly) give
    their place to a turn that waited long enough; the windows in flight, and those of
    sessions due back soon, keep theirs. Only the head of the queue takes them (the
    oldest session's turn first: a turn behind others past its cap keeps its place). If the
    late windows would not make room, it waits on, woken whenever blocks are freed and
    when the next idle window turns late.
    Where no window can be priced (a holder that no longer fits behind the older
    windows, no block counts, no prefix reading) it goes in without one."""
    left = wait_cap_left(view, settings)
    if left is None:
        return wait
    if left > 0:
        return due_by(wait, left)
    if view.has_window or usage is None or not usage.has_blocks or isinstance(prefix, PrefixUnavailable):
        return Admit(AdmissionReason.WAIT_CAPPED)
    if view.waiters_ahead > 0:  # late windows go to the head of the queue
        return wait
    assert prefix is not None, "a newcomer at the head of the queue is held only on a prefix reading"
    reclaim = reclaim_window(view, usage, prefix, settings)
    if reclaim is None:
        why = f"waited its cap, for late idle windows to make room; {wait.why}"
        waiting = replace(wait, why=why, wake_on_release=True, poll=True)
        return waiting if view.next_late_sec is None else due_by(waiting, view.next_late_sec)
    footprint, blocks = reclaim
    return Admit(
        AdmissionReason.WAIT_CAPPED, window=settings.retain_session, footprint=footprint, reclaim_blocks=blocks
    )


def working_set_calm(view: WorkingSetView, usage: UsageReading | None, settings: GateSettings) -> Decision | None:
    """The policy's calm rule (`Policy.calm`): the decision `working_set_decide` reaches for a
    named turn with no waiter at the gate whose upper bound fits (no pressure), or None
    (decide in full). `view` is `WorkingSetView.read_calm`'s: `bounded_footprint` reads
    the same facts there as in the full view, so where the bound fits the full decision
    is this admission, and where it does not, the full decision is made. O(1): no
    prefix, no queue, no ranking of windows."""
    if usage is None or view.anonymous or not usage.has_blocks:
        return None
    bounded = bounded_footprint(view, usage, settings)
    if bounded is None:
        return None
    return at_low_priority(_bounded_admit(view, usage, settings, bounded), view, usage, None, settings)


def _bounded_admit(view: WorkingSetView, usage: UsageReading, settings: GateSettings, bounded: int) -> Admit:
    """The admission of a turn whose upper bound fits (`bounded_footprint`): its window at
    that price, repriced once the windows hold more than half the usable blocks."""
    return Admit(
        AdmissionReason.HOLDS_WINDOW if view.has_window else AdmissionReason.WINDOW_FITS,
        window=settings.retain_session,
        footprint=bounded,
        reprice_above=reprice_threshold(usage, settings),
    )


def _decide(
    view: WorkingSetView, usage: UsageReading | None, prefix: ProbedPrefix | None, settings: GateSettings
) -> Decision | ProbeFirst:
    """The decision table without the cap. Every branch before `PROBE_FIRST` reads no
    prefix, so a decision reached without a reading is the one any reading would give."""
    if usage is None:
        return admit_open(view.watermark, settings)
    if view.anonymous or not usage.has_blocks:
        return watermark_decide(view.watermark, usage, prefix, settings)
    behind = not view.has_window and view.waiters_ahead > 0  # a newcomer with named waiters ahead
    bounded = None if behind else bounded_footprint(view, usage, settings)
    if bounded is not None:
        return _bounded_admit(view, usage, settings, bounded)
    if unprobed_work_conserving(view, usage, settings):
        return Admit(AdmissionReason.WORK_CONSERVING)
    behind_why = f"behind {view.waiters_ahead} waiting sessions (first come, first served)"
    if behind and not can_work_conserve(usage, settings):
        return Wait(WaitCause.BEHIND_WAITERS, behind_why, poll=False)  # nothing but its place can change
    if prefix is None:
        return PROBE_FIRST
    if isinstance(prefix, PrefixUnavailable):
        if behind:
            return Wait(WaitCause.BEHIND_WAITERS, behind_why)
        if view.has_window:  # cannot re-price it: keep the window at its last footprint
            return Admit(AdmissionReason.HOLDS_WINDOW, window=settings.retain_session)
        return watermark_decide(view.watermark, usage, prefix, settings)
    return _decide_read(view, usage, prefix, settings, behind, behind_why)


def _held_without_window(
    view: WorkingSetView, usage: UsageReading, prefix: PrefixReading, settings: GateSettings, budget: int, usable: int
) -> Wait | None:
    """The work-conserving rule's answer for a turn no window fits: None to admit it without
    one, unpriced where the engine has measured no prefill yet (`unpriced_admission`), else
    at the re-prefill of the blocks at risk (`at_risk_blocks`; the blocks the prefix probe
    saw on the CPU tier come back by a reload, not a re-prefill)."""
    if unpriced_admission(prefix, usage, settings, budget):
        return None
    at_risk = at_risk_blocks(view, usage, prefix, settings, budget, usable)
    return work_conserving(view, usage, at_risk, settings, prefix.hit_blocks_cpu)


def _decide_read(
    view: WorkingSetView,
    usage: UsageReading,
    prefix: PrefixReading,
    settings: GateSettings,
    behind: bool,
    behind_why: str,
) -> Decision:
    """The decision table's rows that read the session's probed prefix (`_decide` has
    ruled out every row that needs none). `behind`: a newcomer with named waiters ahead."""
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
    held = _held_without_window(view, usage, prefix, settings, budget, usable)
    if held is None:
        return Admit(AdmissionReason.WORK_CONSERVING)  # without a window: the windows' books stay within usable
    if view.has_window:
        return Wait(
            WaitCause.WINDOW_LOST,
            f"window lost: footprint {footprint} blocks + {view.older_window_blocks} in older windows "
            f"exceeds {usable} usable blocks; {held.why}",
            drop_window=True,
            recheck_sec=held.recheck_sec,
        )
    if behind:  # no window before the waiters ahead; the rule decides again when blocks are freed ...
        # ... unless its own prompt's re-prefill alone outweighs holding it: then no freed
        # block can let it in, and it waits for its place (or an idle replica) unpolled.
        freeable = could_work_conserve(view, usage, prefix.total_blocks, settings, prefix.hit_blocks_cpu)
        return Wait(
            WaitCause.BEHIND_WAITERS,
            f"{behind_why}; {held.why}",
            recheck_sec=held.recheck_sec,
            wake_on_release=freeable,
            poll=freeable,
        )
    if working_set > usable:
        cause = WaitCause.WINDOWS_FULL
        why = f"footprint {footprint} blocks + {view.older_window_blocks} in windows exceeds {usable} usable blocks"
    else:
        cause = WaitCause.NO_FREE_BLOCKS
        why = f"needs {prefix.new_blocks} new blocks, {budget} free outside idle windows and headroom"
    return Wait(cause, f"{why}; {held.why}", recheck_sec=held.recheck_sec)
