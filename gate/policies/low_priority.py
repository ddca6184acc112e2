"""Turns without a window at low vLLM priority (`held_priority`), on a replica that
schedules by priority.

vLLM's priority scheduling (`--scheduling-policy priority`) orders its waiting queue by
each request's `priority` (lower first, then arrival) and, when a running request needs
blocks that are not there, preempts the running request last in that order. With
`held_priority` > 0 the working_set policy sends the turns that hold no window at that
priority, so that they yield to the window holders' turns (sent as the client sent them,
priority 0 by default): a holder's turn waiting in the engine goes before them, and a
running holder that needs blocks preempts them. Those turns are:

- a turn it would hold: it goes in `low_priority` instead, if its new blocks (its
  prompt's uncached blocks and its output allowance) fit vLLM's free blocks outside the
  idle windows and headroom (`free_budget`). vLLM's priorities do not reach the prefix
  cache: a new request allocates from the free blocks least recently freed first,
  whatever prefix they cache, and an idle window's prefix is such blocks. The fit keeps
  a turn let in this way from evicting a window's prefix when it is admitted;
- a turn admitted without a window (`work_conserving`, `wait_capped` where no window can be made).

Invariants:
- Only named turns, only on a replica whose kv answer says it schedules by priority,
  only on a route whose body carries vLLM's `priority` field, only with
  `held_priority` > 0. Otherwise the decision stands as it is.
- A turn holding a window is never lowered, and a turn let in `low_priority` holds no
  window (`Admit.window` False): the windows' books stay within the usable blocks.
"""

from __future__ import annotations

from dataclasses import replace

from kvgate.gate.policies.pricing import free_budget
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.vocabulary import AdmissionReason, Admit, Decision, ProbedPrefix, Wait
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.settings import GateSettings
from kvgate.wire.blocks import cdiv


def at_low_priority(
    decision: Decision,
    view: WorkingSetView,
    usage: UsageReading | None,
    prefix: ProbedPrefix | None,
    settings: GateSettings,
) -> Decision:
    """`decision`, with the turns that hold no window at `held_priority` (the module's rules)."""
    if (
        settings.held_priority <= 0
        or not view.priority_field
        or view.anonymous
        or usage is None
        or not usage.schedules_by_priority
    ):
        return decision
    if isinstance(decision, Admit):
        return decision if decision.window else replace(decision, priority=settings.held_priority)
    if isinstance(decision, Wait) and fits_free_room(view, usage, prefix, settings):
        return Admit(AdmissionReason.LOW_PRIORITY, priority=settings.held_priority)
    return decision


def fits_free_room(
    view: WorkingSetView, usage: UsageReading, prefix: ProbedPrefix | None, settings: GateSettings
) -> bool:
    """The turn's new blocks and output allowance fit vLLM's free blocks outside the idle
    windows and headroom, on a prefix reading (without one: no)."""
    if not isinstance(prefix, PrefixReading) or not usage.has_blocks or not usage.block_size:
        return False
    need = prefix.new_blocks + cdiv(view.max_output_tokens, usage.block_size)
    return need <= free_budget(view, usage, settings)
