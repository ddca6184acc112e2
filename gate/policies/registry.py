"""The policies by `gate.policy` name, and what the shell needs of each.

Adding or comparing a policy is one entry in `POLICIES`. Nothing in this package touches
asyncio, clocks or I/O: the simulator can call the same functions in virtual time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvgate.gate.policies.pricing import window_footprint
from kvgate.gate.policies.views import GateFacts, WatermarkView, WorkingSetView
from kvgate.gate.policies.vocabulary import Decision, ProbedPrefix, ProbeFirst
from kvgate.gate.policies.watermark import watermark_decide
from kvgate.gate.policies.working_set import working_set_calm, working_set_decide
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.settings import GateSettings

V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Policy(Generic[V]):
    """One policy: `decide(view, usage, prefix, settings) -> Admit | Wait | Reject | ProbeFirst`.

    view: builds the view the policy reads from the gate's facts (`views`).
    decide: called first with `prefix=None`; it answers ProbeFirst exactly when the
      prefix reading would change its answer. The shell then probes and calls
      `decide_read` with the answer.
    price: the exact window price from a prefix reading, for an `Admit.reprice_above`
      (None: the policy never prices at a bound).
    price_view: builds the view `price` is called with (None: `view`); it must read every
      fact `price` reads as `view` reads it (a turn's usage reprices its window on it).
    reads_prompt_bound: the shell must fill `GateFacts.prompt_bound_tokens` (it costs
      one encoding of the body per turn).
    calm: the calm rule, for a named turn with no waiter at the gate, with usage read:
      called on `calm_view`'s view before anything else, it answers the decision `decide`
      would reach (never ProbeFirst), or None to decide in full. It must answer only where
      that is certain from the few facts its view reads in O(1); the shell then skips the
      full view (None: always decide in full).
    `usage is None` means the usage probe failed (usage unknown).
    """

    name: str
    view: Callable[[GateFacts], V]
    decide: Callable[[V, UsageReading | None, ProbedPrefix | None, GateSettings], Decision | ProbeFirst]
    price: Callable[[V, UsageReading, PrefixReading, GateSettings], int] | None = None
    reads_prompt_bound: bool = False
    price_view: Callable[[GateFacts], V] | None = None
    calm: Callable[[V, UsageReading | None, GateSettings], Decision | None] | None = None
    calm_view: Callable[[GateFacts], V] | None = None

    def decide_read(
        self, view: V, usage: UsageReading | None, prefix: ProbedPrefix, settings: GateSettings
    ) -> Decision:
        """Decide with the prefix probe's answer in hand: never ProbeFirst again."""
        decision = self.decide(view, usage, prefix, settings)
        assert not isinstance(decision, ProbeFirst), f"policy {self.name} asked for a prefix probe it was given"
        return decision


WATERMARK: Policy[WatermarkView] = Policy("watermark", WatermarkView.read, watermark_decide)
WORKING_SET: Policy[WorkingSetView] = Policy(
    "working_set",
    WorkingSetView.read,
    working_set_decide,
    price=window_footprint,
    reads_prompt_bound=True,
    price_view=WorkingSetView.read_price,
    calm=working_set_calm,
    calm_view=WorkingSetView.read_calm,
)

POLICIES: dict[str, Policy[Any]] = {p.name: p for p in (WATERMARK, WORKING_SET)}

# Policy names of earlier releases: refused, with the name to write instead (CHANGELOG.md).
RENAMED_POLICIES: dict[str, str] = {"seed": "watermark", "contract": "working_set"}


def policy_name_problem(name: object) -> str | None:
    """Why `name` is not a `gate.policy` (for the config's error), or None if it is one."""
    if name in POLICIES:
        return None
    if isinstance(name, str) and name in RENAMED_POLICIES:
        return f"renamed: write {RENAMED_POLICIES[name]!r} (CHANGELOG.md lists the renames)"
    return f"must be one of {', '.join(sorted(POLICIES))}"


def get_policy(name: str) -> Policy[Any]:
    if name in RENAMED_POLICIES:
        raise ValueError(f"gate.policy {name!r} was renamed {RENAMED_POLICIES[name]!r}; write that instead")
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown gate.policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}") from None
