"""Forwarding a held turn at low priority instead of holding it at the proxy.

vLLM's priority scheduling (`--scheduling-policy priority`) orders its waiting queue by
each request's `priority` (lower first, then arrival) and, when a running request needs
blocks that are not there, preempts the running request last in that order. A turn the
working_set policy would hold can so go in at a priority above 0 (`held_priority`): it
computes while the replica has room (the steps the window holders leave idle while
their sessions sit in tool calls), and it yields to them: a holder's turn waiting in
the engine goes before it, a running holder that needs its blocks preempts it.

Invariants:
- Only a named turn the policy holds (a `Wait`) is forwarded this way, only on a replica
  whose kv answer says it schedules by priority, only on a route whose body carries
  vLLM's `priority` field, and only with `held_priority` > 0. Otherwise the Wait stands.
- A turn forwarded this way holds no window (`Admit.window` False), like one admitted
  `work_conserving`: the windows' books stay within the usable blocks.
"""

from __future__ import annotations

from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.vocabulary import AdmissionReason, Admit, Wait
from kvgate.gate.readings import UsageReading
from kvgate.gate.settings import GateSettings


def forwarded_low(wait: Wait, view: WorkingSetView, usage: UsageReading | None, settings: GateSettings) -> Wait | Admit:
    """`wait`, or an Admit `low_priority` at `held_priority` where the replica can yield it
    to the window holders (the module's invariants)."""
    if (
        settings.held_priority > 0
        and view.priority_field
        and not view.anonymous
        and usage is not None
        and usage.schedules_by_priority
    ):
        return Admit(AdmissionReason.LOW_PRIORITY, priority=settings.held_priority)
    return wait
