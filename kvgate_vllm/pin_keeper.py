"""One engine's KV pins (`kvgate.wire.kv_pins`), held as references in vLLM's block pool.

The retention connector (`retention_connector`) makes one ``PinKeeper`` per engine, in
the scheduler, and the engine core's utility methods (`engine_plugin`) read and release
it between scheduler steps. Everything runs on the engine core's main thread, so nothing
here locks. The books are `kvgate.wire.pin_book.PinBook`'s; this module only does what
the book returns to the pool. Imports no vLLM: the pool is duck-typed (``blocks``,
``touch``, ``free_blocks``; blocks with ``is_null``, ``block_hash``), so tests drive
vLLM's real ``BlockPool`` and a stand-in alike.

Invariants:

- every block a pin holds has one reference per pin that holds it (``BlockPool.touch``
  when pinned, ``BlockPool.free_blocks`` when the pin ends): a pinned block is never in
  the free queue, so nothing evicts it, and it counts as used in the kv answer;
- only full, prefix-cached blocks are pinned (a hash, not the null block): a next turn
  can hit exactly those;
- a pin is taken before the one it replaces is dropped, so a block both hold never
  reaches a reference count of zero in between;
- pins yield only when an allocation fails (`yielding`), least recently pinned first,
  one at a time, retrying the allocation after each: no pin ends that the request did
  not need, and no request is refused or preempted while a pin could make room.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvgate.wire.kv_pins import MAX_PIN_TTL_SEC, PinError, ReleaseAnswer, pin_of
from kvgate.wire.pin_book import PinBook

logger = logging.getLogger(__name__)

KEEPER_ATTR = "kvgate_pins"  # the connector's attribute holding its PinKeeper
CONNECTOR_CONFIG = (
    '{"kv_connector":"KvgateRetentionConnector",'
    '"kv_connector_module_path":"kvgate.vllm_plugin.retention_connector","kv_role":"kv_producer"}'
)
NOT_LOADED = (
    "this vLLM server keeps no KV pins: start it with --kv-transfer-config "
    f"'{CONNECTOR_CONFIG}' (and VLLM_PLUGINS=kvgate), see docs/vllm-plugin.md"
)


class PinKeeper:
    """Pins of one engine: a `PinBook` and the block pool it holds references in."""

    def __init__(
        self,
        block_pool: Any,
        replica_key: str | None,
        clock: Callable[[], float] = time.monotonic,
        max_ttl_sec: float = MAX_PIN_TTL_SEC,
    ):
        self.pool = block_pool
        self.replica_key = replica_key
        self.clock = clock
        self.book = PinBook(max_ttl_sec)
        self._warned_proof = False

    def finished(self, transfer_params: object, block_ids: Iterable[int]) -> bool:
        """A request finished with `block_ids` (its computed blocks, in order): pin its full,
        cached blocks when `transfer_params` names a valid pin. Whether it pinned."""
        try:
            pin = pin_of(transfer_params)
        except PinError as exc:
            logger.debug("kvgate: served a turn unpinned: %s", exc)
            return False
        if pin is None:
            return False
        if not pin.valid_for(self.replica_key):
            self._warn_invalid_proof()
            return False
        self.expire()
        held = [block_id for block_id in block_ids if self._pinnable(block_id)]
        take, drop = self.book.pin(pin.session, held, pin.ttl_sec, self.clock())
        self.pool.touch([self.pool.blocks[block_id] for block_id in take])
        self._free(drop)
        return True

    def release(self, sessions: Iterable[str]) -> ReleaseAnswer:
        """End the pins of `sessions` (each named once counts once); what they held."""
        self.expire()
        released_sessions = released_blocks = 0
        for session in dict.fromkeys(sessions):
            if self.book.pinned(session) is None:
                continue
            blocks = self.book.release(session)
            self._free(blocks)
            released_sessions += 1
            released_blocks += len(blocks)
        return ReleaseAnswer(released_sessions, released_blocks)

    def expire(self) -> None:
        """End every pin whose ttl has passed."""
        for blocks in self.book.expire(self.clock()):
            self._free(blocks)

    def yield_one(self) -> bool:
        """End the least recently taken pin because a request needs blocks; False when none is held."""
        blocks = self.book.yield_oldest()
        if blocks is None:
            return False
        self._free(blocks)
        return True

    def yielding(self, allocate: Callable[..., Any]) -> Callable[..., Any]:
        """`allocate` (``KVCacheManager.allocate_slots``: None when the blocks do not fit), retried
        after each pin yielded while it does not fit. A failed ``allocate_slots`` changes nothing
        a retry depends on (it only frees blocks outside a sliding window, idempotently)."""

        def allocate_or_yield(*args: Any, **kwargs: Any) -> Any:
            blocks = allocate(*args, **kwargs)
            while blocks is None and self.yield_one():
                blocks = allocate(*args, **kwargs)
            return blocks

        return allocate_or_yield

    def figures(self) -> dict[str, int]:
        """The kv answer's pin fields, after ending expired pins (so a ttl ends on an idle engine)."""
        self.expire()
        return {
            "num_pinned_blocks": self.book.num_pinned_blocks,
            "num_pinned_sessions": self.book.num_pinned_sessions,
            "num_pin_yields": self.book.num_yields,
        }

    def _pinnable(self, block_id: int) -> bool:
        block = self.pool.blocks[block_id]
        return not block.is_null and block.block_hash is not None

    def _free(self, block_ids: list[int]) -> None:
        # Tail first: a window's last blocks are evicted before its first, as vLLM frees a request's.
        if block_ids:
            self.pool.free_blocks([self.pool.blocks[block_id] for block_id in reversed(block_ids)])

    def _warn_invalid_proof(self) -> None:
        if not self._warned_proof:
            self._warned_proof = True
            logger.warning(
                "kvgate: a turn named a KV pin without the replica key's proof and was served unpinned; "
                "the gate and this server must share KVGATE_REPLICA_API_KEY (logged once)"
            )


def keeper_of(engine_core: Any) -> PinKeeper | None:
    """The engine's PinKeeper: its scheduler's connector's, or one of a ``MultiConnector``'s
    children; None when the retention connector is not loaded."""
    connector = getattr(getattr(engine_core, "scheduler", None), "connector", None)
    for candidate in (connector, *getattr(connector, "_connectors", ())):
        keeper = getattr(candidate, KEEPER_ATTR, None)
        if isinstance(keeper, PinKeeper):
            return keeper
    return None


def pin_figures(engine_core: Any) -> dict[str, int]:
    """The kv answer's pin fields of this engine; {} without the connector (the fields stay null)."""
    keeper = keeper_of(engine_core)
    return keeper.figures() if keeper is not None else {}


def release_answer(engine_core: Any, sessions: object) -> dict:
    """This engine's ``ReleaseAnswer`` (as JSON: it crosses the UTILITY channel)."""
    keeper = keeper_of(engine_core)
    if keeper is None:
        return {"error": NOT_LOADED}
    if not isinstance(sessions, list) or not all(isinstance(session, str) for session in sessions):
        return {"error": "sessions must be a list of session ids"}
    return keeper.release(sessions).to_json()
