"""What a served turn's usage teaches the gate, and the repricing of windows admitted at
their bound: the gate's second concern, beside admission.

A window the working_set policy admits at its prompt's upper bound (no probe on the
turn's path) is over-priced until its exact size is known. Two sources give it:

- the turn's usage (`Lease.learn` -> `Repricer.learn`): the replica's answer reports the
  prompt's tokens and its prefix-cache hit; the session's size goes into its history and
  its window is priced at it (`apply_price`), as a probe would;
- a prefix probe beside the forwarded turn (`reprice_later`): used before the gate has
  seen the replica report usage, and for every window still unpriced once a turn waits
  (`reprice_unpriced`: over-priced windows may be what holds it).

Invariants: `_unpriced` holds only records with a turn in flight whose window waits for
its usage (`forget` drops a record when its turn ends); each repricing task is in
`_repricing` until it ends, and `close` cancels them all. Learning touches one session's
record and the book's running sums (`SessionBook.reprice`, `record_size`), never a walk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import Counter

from kvgate.gate.book import SessionBook, SessionRecord
from kvgate.gate.errors import PromptTooLong
from kvgate.gate.holding_value import kept_share
from kvgate.gate.observations import reprefill_tokens
from kvgate.gate.policies.registry import Policy
from kvgate.gate.probe import Probe
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.settings import GateSettings
from kvgate.gate.turn_facts import TurnFacts

# The most prompt tokens learned from a replica that states neither its max_model_len nor
# its cache size, for a turn without a body bound: far above any model's context.
LEARNED_TOKENS_CEILING = 1 << 24


def learned_tokens_cap(bound: int | None, usage: UsageReading | None) -> int:
    """The most prompt tokens a served turn's reported usage may claim: no more than its
    body's bound, the replica's max_model_len or its whole cache (a prompt that long was
    not served), so a replica reporting 2^63-1 cannot poison the session's history."""
    caps = [LEARNED_TOKENS_CEILING]
    if bound is not None:
        caps.append(bound)
    if usage is not None:
        if usage.max_model_len:
            caps.append(usage.max_model_len)
        if usage.num_total_blocks and usage.block_size:
            caps.append(usage.num_total_blocks * usage.block_size)
    return min(caps)


@dataclass(frozen=True, slots=True)
class TurnNote:
    """What the gate keeps of an admitted named turn to learn from its usage: its output
    allowance, its body-length bound, whether a prefix reading priced it, and the session's
    prompt size before this turn (what its usage shows re-prefilled is measured against
    that, not against a size this turn's own repricing probe recorded), and whether the
    session's previous turn here went in with a window (None: it had none here): what its
    usage shows kept of that prompt is what holding is worth (`HoldingValue`)."""

    allowance: int
    bound: int | None
    probed: bool
    previous_tokens: int | None = None
    previous_window: bool | None = None
    probed_hit_blocks: int | None = None  # the resident blocks its admission's prefix reading saw


@dataclass(frozen=True, slots=True)
class RepriceRequest:
    """What re-pricing a window admitted at its upper bound needs: the turn's body to probe
    its prefix, and the allowance, usage and bound it was admitted with."""

    route_kind: str
    body: Mapping[str, object]
    allowance: int
    usage: UsageReading | None
    bound: int | None


class Repricer:
    """Learning from usage and repricing windows for one replica's gate (module docstring).

    Its dependencies are explicit: the gate's book, policy, settings and probe; `clock`;
    `usage`, the last usage reading the gate decided on; `reprefill`, the counter of
    re-prefilled tokens; `window_shrank`, what the gate does when a window's price went
    down (wake a waiter, publish the gauges)."""

    def __init__(
        self,
        book: SessionBook,
        policy: Policy,
        settings: GateSettings,
        probe: Probe,
        clock: Callable[[], float],
        usage: Callable[[], UsageReading | None],
        reprefill: Counter,
        window_shrank: Callable[[], None],
    ) -> None:
        self._book = book
        self._policy = policy
        self._settings = settings
        self._probe = probe
        self._now = clock
        self._usage = usage
        self._reprefill = reprefill
        self._window_shrank = window_shrank
        # The replica reports each turn's prompt usage (`Lease.learn`): a window priced at
        # its bound gets its exact price when its turn ends, without a probe.
        self.learns_usage = False
        # Windows in flight priced at their bound whose repricing probe was left to their
        # turn's usage: probed as soon as a turn waits (over-priced windows may hold it).
        self._unpriced: dict[SessionRecord, RepriceRequest] = {}
        self._repricing: set[asyncio.Future[None]] = set()

    def admitted_at_bound(self, record: SessionRecord | None, request: RepriceRequest, turns_wait: bool) -> None:
        """A window was admitted at its bound past the policy's repricing threshold: its
        usage prices it, unless usage was never reported or a turn waits (`turns_wait`),
        in which case a probe does now."""
        if not self.learns_usage or turns_wait:
            self.reprice_later(record, request)
        elif record is not None:
            self._unpriced[record] = request

    @property
    def probes_in_flight(self) -> int:
        """Repricing probes started and not yet answered."""
        return len(self._repricing)

    def forget(self, record: SessionRecord) -> None:
        """The record's turn ended: its window no longer waits for its usage."""
        self._unpriced.pop(record, None)

    def close(self) -> None:
        self._unpriced.clear()
        for task in list(self._repricing):
            task.cancel()

    def learn(
        self,
        record: SessionRecord,
        turn: TurnNote,
        prompt_tokens: int,
        cached_tokens: int | None,
        output_tokens: int | None = None,
    ) -> None:
        """A served turn's usage: its exact size goes into the session's history, prices its
        window (as a repricing probe would; at the reply's length where the usage gives it:
        the turn's generation is over, so that is what its window holds), tells the
        replica's `HoldingValue` how much of the session's previous prompt it kept and, for
        a turn no prefix reading priced, counts its re-prefill. The reply's length goes
        into the replica's recent replies (`SessionBook.output_price`)."""
        self._unpriced.pop(record, None)
        usage = self._usage()
        if output_tokens is not None:
            output_tokens = min(output_tokens, learned_tokens_cap(None, usage))  # a replica's word, bounded
            self._book.record_reply(output_tokens)
        if self._book.records.get(record.key) is not record:
            return
        self.learns_usage = True
        if turn.bound is not None and prompt_tokens > turn.bound:
            # Its body's bytes did not bound its prompt: media `turn_media` did not see (put into an
            # item of a history it had read). The session's next turns read their histories whole.
            record.history_media = ()
        prompt_tokens = min(prompt_tokens, learned_tokens_cap(turn.bound, usage))  # a replica's word, bounded
        cached_tokens = None if cached_tokens is None else min(cached_tokens, prompt_tokens)
        block_size = usage.block_size if usage is not None else None
        hit_blocks = cached_tokens // block_size if cached_tokens is not None and block_size else 0
        if not block_size:
            self._book.record_size(record, prompt_tokens, turn.bound)
            return
        learned = PrefixReading(prompt_tokens // block_size, hit_blocks, 0.0, prompt_tokens)
        if turn.previous_window is not None and cached_tokens is not None:
            kept = kept_share(turn.previous_tokens, prompt_tokens, cached_tokens, block_size)
            if kept is not None:
                self._book.holding.observe_next_turn(turn.previous_window, kept)
        if turn.probed_hit_blocks and cached_tokens is not None:
            self._book.holding.observe_engine(turn.probed_hit_blocks, hit_blocks)
        if not turn.probed and cached_tokens is not None:
            self.count_reprefill(turn.previous_tokens, learned, usage)
        self.apply_price(record, learned, turn.allowance if output_tokens is None else output_tokens, usage, turn.bound)

    def apply_price(
        self,
        record: SessionRecord,
        prefix: PrefixReading,
        allowance: int,
        usage: UsageReading | None,
        bound: int | None,
    ) -> None:
        """Price the session's window in flight at `prefix`'s exact size (a policy that prices
        windows), and record the size; wake a waiter if the window shrank."""
        price = self._policy.price
        if price is None or usage is None or not usage.has_blocks or not record.has_window or record.in_flight != 1:
            # no window to price, or one shared by concurrent turns priced together: the next turn prices it
            self._book.record_size(record, prefix.total_tokens, bound)
            return
        now = self._now()
        facts = TurnFacts(self._book, record, allowance, bound, lambda: 0, usage, now, now)
        view = (self._policy.price_view or self._policy.view)(facts)  # what the price reads: O(1)
        footprint = max(price(view, usage, prefix, self._settings), 0)
        if self._book.reprice(record, footprint, prefix.total_tokens, bound):
            self._window_shrank()

    def reprice_unpriced(self) -> None:
        """A turn waits: the windows in flight still priced at their bound get their exact
        price from a probe now, not when their turns end."""
        unpriced, self._unpriced = self._unpriced, {}
        for record, request in unpriced.items():
            if record.in_flight:
                self.reprice_later(record, request)

    def reprice_later(self, record: SessionRecord | None, request: RepriceRequest) -> None:
        """Get the exact price of a window admitted at its upper bound (no probe on the turn's
        path) from a prefix probe that runs beside the forwarded turn."""
        usage = request.usage
        if record is None or usage is None:  # never both with a bound price: anonymous or unknown usage
            return
        task = asyncio.ensure_future(self._reprice(record, request, usage))
        self._repricing.add(task)
        task.add_done_callback(self._repricing.discard)

    async def _reprice(self, record: SessionRecord, request: RepriceRequest, usage: UsageReading) -> None:
        try:
            prefix = await self._probe.prefix(request.route_kind, request.body)
        except PromptTooLong:  # the turn itself is refused by the replica; nothing to re-price
            return
        if prefix is None or not prefix.total_tokens:
            return
        assert self._policy.price is not None, (
            f"policy {self._policy.name} priced a window at a bound but cannot reprice it"
        )
        self.apply_price(record, prefix, request.allowance, usage, request.bound)

    def count_reprefill(self, previous_tokens: int | None, prefix: PrefixReading, usage: UsageReading | None) -> None:
        """Count the tokens an admitted turn prefills again: of the session's prompt before
        this turn (`previous_tokens`), what `prefix` (its reading or its usage) found evicted."""
        block_size = usage.block_size if usage is not None else None
        tokens = reprefill_tokens(previous_tokens, prefix.total_tokens, prefix.hit_blocks, block_size)
        if tokens:
            self._reprefill.inc(tokens)
