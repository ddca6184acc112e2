"""The economics of holding: what a window's idle life and a held turn cost the replica.

- An idle window lives a few of its session's usual gaps between turns
  (`gate.window_lifetime`).
- The work-conserving rule (`work_conserving`): a held turn goes in, without a window,
  when holding it back leaves more of the replica's compute unused
  (`holding_cost_sec`: its decode slack, the idle time ahead on an idle replica, and
  the time it has waited at the engine's idle share with turns in flight, `busy_rent_sec`) than its
  admission makes the replica spend bringing back the windows' blocks it pushes out
  (`lost_blocks_sec` of `evicted_window_blocks`: their re-prefill, or, from a CPU tier
  that holds them, their reload over PCIe).
Without a measured prefill throughput there is no price: the turn goes in where vLLM
has its new blocks free outside idle windows (`unpriced_admission`), and is held otherwise.
- The cap on a held turn's wait (`wait_cap_left`, when `wait_cap_factor` > 0): once a
  turn has waited `wait_cap_factor` times its session's recent turn time
  (`wait_cap_sec`), the policy lets it in however the rule weighs (`working_set`:
  into a window made of idle windows, `reclaim_window`; docs/decisions/wait-cap.md).
"""

from __future__ import annotations

from dataclasses import replace

from kvgate.gate.policies.pricing import estimated_prompt_tokens, free_budget, usable_blocks, windows_pinned
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.vocabulary import Wait, WaitCause
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.settings import GateSettings
from kvgate.wire.blocks import cdiv


def reprefill_sec(evicted_blocks: int, usage: UsageReading) -> float | None:
    """Seconds the replica will spend computing again `evicted_blocks` of other sessions'
    windows, at its measured prefill throughput; None without a measurement."""
    if not usage.prefill_tokens_per_sec or not usage.block_size:
        return None
    return max(0, evicted_blocks) * usage.block_size / usage.prefill_tokens_per_sec


def lost_blocks_sec(blocks: int, usage: UsageReading, reloadable: int = 0) -> float | None:
    """Seconds the replica will spend bringing back `blocks` pushed out of GPU memory: a
    reload (`cpu_load_sec_per_block` each) of those its CPU tier holds (all of them where
    `UsageReading.tier_holds_evictions`, else the `reloadable` ones, seen on the CPU by a prefix probe),
    a re-prefill (`reprefill_sec`) of the rest. None without a prefill measurement."""
    blocks = max(0, blocks)
    load = usage.cpu_load_sec_per_block if usage.num_cpu_blocks else None
    reloaded = 0 if not load else blocks if usage.tier_holds_evictions else min(blocks, max(0, reloadable))
    recompute = reprefill_sec(blocks - reloaded, usage)
    return None if recompute is None else recompute + reloaded * (load or 0.0)


# A busy replica's decode slack must exceed the re-prefill twice over (see holding_cost_sec):
# the slack is a forecast and the re-prefill a certainty. At 1, sessions go in
# work-conserving while their contexts are short and come back cold.
DECODE_SLACK_MARGIN = 2.0


def idle_in_flight_share(view: WorkingSetView, usage: UsageReading) -> float | None:
    """The share of the replica's recent wall time that its engine idled while turns were
    in flight: the engine's idle share (`1 - busy_share`) less the share the replica had
    no turn in flight at all (`view.replica_empty_share`, metered by the gate as the
    engine meters its steps). An engine idles with turns in flight while they are
    rendered, queued in its API server or streamed; with none in flight it idles because
    its sessions are in tool calls, and the idle-replica terms of `holding_cost_sec`
    charge that when it happens. None without a busy-share measurement."""
    if usage.busy_share is None:
        return None
    return max(0.0, 1.0 - usage.busy_share - view.replica_empty_share)


def busy_rent_sec(view: WorkingSetView, usage: UsageReading) -> float:
    """Engine time a held turn's wait has left unused while the replica was not idle:
    the time it waited, at the engine's measured idle share with turns in flight
    (`idle_in_flight_share`), split with the named waiters ahead of it. A replica with
    turns in flight is not always computing: its engine idles while they are rendered,
    queued in its API server or streamed. Counted at that share, a wait on an engine that
    steps back to back whenever turns are in flight costs nothing (it computes for others),
    and one on an engine that mostly idles costs nearly its length. The idle capacity is
    one for all the held turns, and the oldest would take it first: a turn with
    `waiters_ahead` named waiters before it is charged 1 / (1 + waiters_ahead) of it.
    0 on an idle replica (the ski-rental term of `holding_cost_sec` counts that), without
    a busy-share measurement, and while the engine has requests waiting
    (`usage.num_waiting`): it has more work than it can schedule, so the turn admitted
    would join that queue, not fill the idle time, which is its requests' own time between
    steps (rendered, in transit, streamed)."""
    idle = idle_in_flight_share(view, usage)
    if view.replica_idle_sec is not None or idle is None or usage.num_waiting:
        return 0.0
    return view.waited_sec * idle / (1 + view.waiters_ahead)


def holding_cost_sec(view: WorkingSetView, usage: UsageReading) -> float:
    """Engine time that holding the turn back leaves unused.

    - on a busy replica: the part of its decode (`max_output_tokens` x the measured
      decode step) that batching would give for free, i.e. outside the engine's
      measured prefill share (a decode-bound engine takes another sequence into its
      batch at almost no cost, a prefill-bound one has no such slack), counted at
      1 / DECODE_SLACK_MARGIN: the slack is a forecast, the re-prefill a certainty, and
      a session admitted without a window grows into dearer turns; or, if larger, the
      time it waited at the engine's idle share with turns in flight (`busy_rent_sec`);
    - on an idle replica, also the idle time ahead (the replica's expected gap before
      a holder in a tool call returns) and the idle time it already waited (the
      ski-rental rule: never wait, idle, longer than the re-prefill it would cause).
    """
    slack = 1.0 - (usage.prefill_share or 0.0)
    cost = view.max_output_tokens * (usage.decode_step_sec or 0.0) * slack / DECODE_SLACK_MARGIN
    cost = max(cost, busy_rent_sec(view, usage))
    if view.replica_idle_sec is not None:
        cost = max(cost, view.expected_gap_sec or 0.0, min(view.replica_idle_sec, view.waited_sec))
    return cost


def recheck_sec(view: WorkingSetView, usage: UsageReading, reprefill: float, holding: float) -> float | None:
    """When the waiting turn's holding cost will have grown to `reprefill` if nothing else
    changes (so the gate decides again then, not at its next poll): on an idle replica
    the idle time it still has to wait; on a busy one whose engine idles with turns in
    flight (`idle_in_flight_share` above 0), the rest of the re-prefill at the rate its
    rent grows (`busy_rent_sec`; while the engine has requests waiting it grows only once
    they are scheduled, so this is the earliest moment). None: the cost does not grow
    with the wait."""
    if view.replica_idle_sec is not None:
        return reprefill - min(view.replica_idle_sec, view.waited_sec)
    idle = idle_in_flight_share(view, usage)
    if idle:
        return (reprefill - holding) * (1 + view.waiters_ahead) / idle
    return None


def work_conserving(
    view: WorkingSetView, usage: UsageReading, evicted_blocks: int, settings: GateSettings, reloadable: int = 0
) -> Wait | None:
    """None: admit the held turn `work_conserving`, its admission costs less to undo
    (`lost_blocks_sec` of the `evicted_blocks` it pushes out of GPU memory, `reloadable`
    of them known to be on the CPU tier: a reload where the tier holds them, else a
    re-prefill) than the compute holding it leaves unused (`holding_cost_sec`). Else the
    Wait to return, with a recheck time when waiting on an idle replica will tip the
    balance. No prefill measurement yet: hold (but see `unpriced_admission`)."""
    if not settings.work_conserving:
        return Wait(WaitCause.WORTH_HOLDING, "gate.work_conserving is off: holding")
    reprefill = lost_blocks_sec(evicted_blocks, usage, reloadable)
    if reprefill is None:
        missing = "block size" if usage.prefill_tokens_per_sec else "prefill-throughput measurement"
        return Wait(WaitCause.WORTH_HOLDING, f"no {missing}: holding")
    holding = holding_cost_sec(view, usage)
    if reprefill <= holding:
        return None
    recheck = recheck_sec(view, usage, reprefill, holding)
    return Wait(
        WaitCause.WORTH_HOLDING, f"re-prefill {reprefill:.3f}s > holding cost {holding:.3f}s", recheck_sec=recheck
    )


def own_at_risk(view: WorkingSetView, usage: UsageReading, own_blocks: int) -> int:
    """Of a held turn's own prefix (`own_blocks`), the blocks its admission without a window
    is expected to cost its next turn: the share that holding it keeps on this replica
    (`view.own_prefix_share`, measured: `gate.holding_value`; all of them before a
    measurement). Where the free cache keeps most sessions' prefixes between turns
    anyway, or held turns seldom get a window, holding keeps little of it.
    While the engine has requests waiting (`usage.num_waiting`), at least the share of
    held turns that get a window in the end (`view.held_got_window`): a turn admitted then
    joins the engine's queue, where the prefixes of queued requests are evicted before
    they run, so what unqueued turns kept says nothing of it, and holding it at the gate
    costs the saturated engine no compute; but a held turn that goes in without a window
    after all kept nothing by waiting."""
    share = view.own_prefix_share
    if usage.num_waiting:
        share = max(share, view.held_got_window)
    return round(own_blocks * min(1.0, max(0.0, share)))


def could_work_conserve(
    view: WorkingSetView, usage: UsageReading, own_blocks: int, settings: GateSettings, reloadable: int = 0
) -> bool:
    """Whether freeing blocks could let a held turn of `own_blocks` in `work_conserving`:
    the re-prefill its admission causes counts its own prompt whatever is freed
    (`evicted_window_blocks` + `own_at_risk` of its blocks; `reloadable` of them priced as a reload, as
    `work_conserving` prices them), so once that alone costs more than holding it, only a
    higher holding cost (an idle replica, a slower decode) can."""
    own = own_at_risk(view, usage, own_blocks)
    reprefill = lost_blocks_sec(own, usage, reloadable) if settings.work_conserving else None
    return reprefill is not None and reprefill <= holding_cost_sec(view, usage)


def evicted_window_blocks(
    view: WorkingSetView, usage: UsageReading, prefix: PrefixReading, budget: int, usable: int, pinned: bool = False
) -> int:
    """Blocks of other sessions' windows that admitting this turn (without a window)
    pushes out of the cache, now or when they go idle.

    The turn allocates its prompt's new blocks and its output's (`need`). In the gate's
    books the windows older than it (all of them for a newcomer) own their footprints;
    what `need` takes beyond the rest of the `usable` blocks comes out of theirs. In
    vLLM's view, what it takes beyond `budget` (the free blocks outside idle windows
    and headroom) comes out of idle windows' cached blocks now. The larger of the two,
    at most the windows' blocks. With the windows `pinned` (`windows_pinned`) the books'
    count goes: an idle window's blocks leave only when the engine cannot fit a request
    otherwise (its pin yields), which is vLLM's view.
    """
    block_size = usage.block_size or 1
    need = prefix.new_blocks + cdiv(view.max_output_tokens, block_size)
    windows = view.older_window_blocks
    spare = usable - windows
    by_books = 0 if pinned else min(windows, need - max(0, spare))
    by_engine = min(view.idle_window_blocks, need - max(0, budget))
    return max(0, by_books, by_engine)


def unpriced_admission(prefix: PrefixReading, usage: UsageReading, settings: GateSettings, budget: int) -> bool:
    """Whether a held turn goes in `work_conserving` unpriced: the engine has not measured
    its prefill throughput yet (it has computed no prompt since it started: a cold start,
    such as a rollout whose sessions all begin at once), so no hold can be priced, and
    vLLM has the turn's new blocks free outside idle windows and headroom (`budget`), so
    it starts at once and pushes no idle window out. Holding it would only wait, with the
    engine's cache free, for the first measurement (the next usage reading); from then
    on the rule prices it."""
    return settings.work_conserving and not usage.prefill_tokens_per_sec and prefix.new_blocks <= budget


def at_risk_blocks(
    view: WorkingSetView, usage: UsageReading, prefix: PrefixReading, settings: GateSettings, budget: int, usable: int
) -> int:
    """The blocks whose re-prefill admitting the turn without a window causes, and holding
    it is expected to save:
    - the windows' blocks it pushes out (`evicted_window_blocks`; where the windows are
      pinned, only the pins its blocks would make yield), at the share of held turns
      that get a window in the end (`view.held_got_window`): one that waits and then goes
      in without a window pushes them out all the same, only later, so holding saves
      them only where it ends in a window;
    - its own prefix, pinned windows or not: admitted without a window, its blocks are
      the first the engine evicts, so its next turn is expected to compute them again,
      where waiting for a window keeps them; of it, the share holding has been measured
      to keep on this replica (`own_at_risk`)."""
    pinned = windows_pinned(usage, settings)
    evicted = evicted_window_blocks(view, usage, prefix, budget, usable, pinned)
    return round(evicted * min(1.0, max(0.0, view.held_got_window))) + own_at_risk(view, usage, prefix.total_blocks)


def can_work_conserve(usage: UsageReading, settings: GateSettings) -> bool:
    """The work-conserving rule is on and has the replica's prefill throughput to price with."""
    return settings.work_conserving and reprefill_sec(0, usage) is not None


def unprobed_work_conserving(view: WorkingSetView, usage: UsageReading, settings: GateSettings) -> bool:
    """Whether a newcomer goes in `work_conserving` without a prefix probe: the rule
    admits it at its estimated price (its prompt at `estimated_prompt_tokens`, none of
    it cached). Asking would only make it wait for the probe, which a CPU engine answers
    between two scheduler steps, and load the server's API process, which renders and
    tokenizes the whole chat for it. A window the exact price might have given it is
    not worth that: it would protect a prefix whose re-prefill costs less than holding
    the turn. (A turn whose upper bound fits a window gets one first: `bounded_footprint`.)
    The holding cost is weighed as if the turn had already waited for the probe (the
    replica's recent prefix-probe latency, `prefix_probe_sec`): a probe whose own wait
    costs more than the estimated re-prefill cannot pay for itself, so it is not asked.
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
    at_risk = at_risk_blocks(view, usage, cold, settings, budget, usable)
    if view.prefix_probe_sec:  # (a copy only where the probe's wait adds something: this runs at every decision)
        view = replace(view, waited_sec=view.waited_sec + view.prefix_probe_sec)
    return work_conserving(view, usage, at_risk, settings) is None


# The shortest cap: a session of very short turns still waits for a release or two.
WAIT_CAP_FLOOR_SEC = 0.1


def wait_cap_sec(view: WorkingSetView, settings: GateSettings) -> float | None:
    """How long a held turn may wait: `wait_cap_factor` x its session's recent turn time
    (else the replica's), at least WAIT_CAP_FLOOR_SEC. None: no cap (factor 0, or no
    turn has ended on the replica yet)."""
    if settings.wait_cap_factor <= 0 or view.recent_turn_sec is None:
        return None
    return max(WAIT_CAP_FLOOR_SEC, settings.wait_cap_factor * view.recent_turn_sec)


def wait_cap_left(view: WorkingSetView, settings: GateSettings) -> float | None:
    """Seconds the held turn may still wait before its cap runs out (<= 0: it ran out);
    None: no cap (`wait_cap_sec`)."""
    cap = wait_cap_sec(view, settings)
    return None if cap is None else cap - view.waited_sec


def due_by(wait: Wait, left: float) -> Wait:
    """`wait`, re-decided no later than `left` seconds from now (its own recheck if sooner)."""
    return replace(wait, recheck_sec=left if wait.recheck_sec is None else min(wait.recheck_sec, left))
