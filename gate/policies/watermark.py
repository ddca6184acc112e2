"""The watermark policy: below `high_watermark` every turn goes in; above it, a named
turn goes in if its session holds a window or its prefix is resident.

Its decision tree (docs/gate.md, `watermark`), with `usage is None` meaning the usage
probe failed:
- usage unknown: admit `open` (the probe error metric says why).
- anonymous: below the watermark `anonymous`, at or above it wait; never a window.
- below the watermark: `open` (a session's existing window is kept and renewed).
- at or above it: `holds_window` if the session owns a window; otherwise the prefix
  decides, so without a reading it answers ProbeFirst: then
  `prefix_probe_unavailable` if there is none, `resident_prefix` if
  hit_ratio >= hit_threshold, else wait.
With retain_session, `holds_window` and `resident_prefix` hold a window.
"""

from __future__ import annotations

from kvgate.gate.policies.views import WatermarkView
from kvgate.gate.policies.vocabulary import (
    PROBE_FIRST,
    AdmissionReason,
    Admit,
    Decision,
    PrefixUnavailable,
    ProbedPrefix,
    ProbeFirst,
    Wait,
    WaitCause,
)
from kvgate.gate.readings import UsageReading
from kvgate.gate.settings import GateSettings


def admit_open(view: WatermarkView, settings: GateSettings) -> Admit:
    """Admit `open` (no pressure read, or usage unknown): the next waiter may pass too, and
    a session that already owns a window keeps and renews it."""
    keep = settings.retain_session and view.has_window and not view.anonymous
    return Admit(AdmissionReason.OPEN, window=keep, wake_next=True)


def watermark_decide(
    view: WatermarkView, usage: UsageReading | None, prefix: ProbedPrefix | None, settings: GateSettings
) -> Decision | ProbeFirst:
    """The module's tree; ProbeFirst only for a named turn without a window at or above
    the watermark (the one branch the prefix decides)."""
    if usage is None:
        return admit_open(view, settings)
    pressure = usage.kv_cache_usage >= settings.high_watermark
    if view.anonymous:
        if pressure:
            return Wait(WaitCause.ANONYMOUS_ABOVE_WATERMARK, "anonymous request above the watermark")
        return Admit(AdmissionReason.ANONYMOUS, wake_next=True)
    if not pressure:
        return admit_open(view, settings)
    if view.has_window:
        return Admit(AdmissionReason.HOLDS_WINDOW, window=settings.retain_session)
    if prefix is None:
        return PROBE_FIRST
    if isinstance(prefix, PrefixUnavailable):
        return Admit(AdmissionReason.PREFIX_PROBE_UNAVAILABLE)
    if prefix.hit_ratio >= settings.hit_threshold:
        return Admit(AdmissionReason.RESIDENT_PREFIX, window=settings.retain_session, footprint=prefix.total_blocks)
    return Wait(WaitCause.COLD_PREFIX, "cold prefix above the watermark")
