"""Responses API chains: which session and replica a `previous_response_id` continues.

vLLM keeps a response's conversation (for `previous_response_id`) in the memory of the
one server that produced it, so a turn that continues a response must go to that
replica: stickiness is a matter of correctness here, not only of cache hits. And a
chain of responses is one agent session, whose ownership window it renews.

- `plan_turn` (pure) decides, for one `/v1/responses` body: the session the turn
  belongs to, the link it continues (if kvgate saw it), and the id its response will
  have. kvgate sets vLLM's `request_id` field when the client did not (vLLM answers
  with `id = request_id`), so the new response's id is known before forwarding and
  no response body or stream has to be parsed.
- `ResponseChains` remembers response id -> (session, replica), bounded (least
  recently used dropped first) and expiring with the session: an entry unused for the
  session idle TTL is gone, and finishing a session (finish header, admin call) or
  removing a replica drops its entries.

Which session a turn belongs to:
- continuing a response kvgate saw: that response's session (it names the exact
  conversation state the turn needs; an explicit id in the request does not move it);
- else the request's own id (path, header, body fields), if any;
- else none (anonymous, as any request without an id); if its response is stored, the
  chain it starts is the session named by that first response id from its next turn on.
A response that is not stored (`store: false`) cannot be continued: no link is kept.

Bounds and ownership: response ids are client-chosen (`request_id`), so they are bounded
as session ids are (`gate.session_key`: over 512 bytes, the SHA-256 hex digest) wherever
kvgate keeps or looks one up, and a session id taken from a response id is bounded the
same way. A link belongs to the session that first recorded it: a turn of another session
that reuses the id (a `request_id` equal to someone else's response id) never replaces it,
so no session can re-route another's chain: such a turn is refused (409) before it is
forwarded. With several tenants (`proxy.tenancy`) a link is visible to the tenant that
made it only: another's `previous_response_id`, and a route naming another's response
(`/v1/responses/{id}`), are answered as an unknown response.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgate.gate.session_key import session_key
from kvgate.proxy.errors import RequestRejected
from kvgate.proxy.session_id import bounded_session_id


@dataclass(slots=True)
class ChainLink:
    """The session a stored response belongs to and the replica that holds its state."""

    session_id: str
    replica: Any
    last_seen: float
    tenant: str | None = None  # the tenant that made it (proxy.tenancy): the only one it is visible to


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """What the proxy does with one Responses turn.

    `session_id`: the session to route and gate it as (None: anonymous).
    `link`: the stored response it continues, if kvgate produced it.
    `response_id`: the id its response will have (None: it will not be stored).
    `set_request_id`: kvgate must put `response_id` in the body as `request_id`.
    `chain_session`: the session a continuation of this turn's response belongs to.
    """

    session_id: str | None
    link: ChainLink | None
    response_id: str | None
    set_request_id: bool
    chain_session: str | None


def _optional_str(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise RequestRejected(400, f"field '{key}' must be a string, got {type(value).__name__}", "invalid_type")
    return value or None


def plan_turn(
    body: dict,
    resolved_session: str | None,
    lookup: Callable[[str], ChainLink | None],
    new_id: Callable[[], str] = lambda: f"resp_{uuid.uuid4().hex}",
    scope: Callable[[str], str] = lambda session_id: session_id,
) -> TurnPlan:
    """The plan of one `/v1/responses` turn (see the module doc); 400 for wrong types.
    `scope` puts a session id taken from a response id in the tenant's namespace."""
    previous_id = _optional_str(body, "previous_response_id")
    request_id = _optional_str(body, "request_id")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise RequestRejected(400, f"field 'store' must be a boolean, got {type(store).__name__}", "invalid_type")
    link = lookup(bounded_session_id(previous_id)) if previous_id else None
    session_id = link.session_id if link is not None else resolved_session
    if store is False:
        return TurnPlan(session_id, link, None, False, None)
    response_id = request_id or new_id()
    return TurnPlan(
        session_id, link, response_id, request_id is None, session_id or scope(bounded_session_id(response_id))
    )


class ResponseChains:
    """Response id -> ChainLink, bounded and expiring (module doc). Not thread-safe: one event loop."""

    def __init__(
        self, max_links: int = 100_000, idle_ttl_sec: float = 3600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_links < 1:
            raise ValueError("max_links must be >= 1")
        self._links: OrderedDict[str, ChainLink] = OrderedDict()
        self._by_session: dict[str, set[str]] = {}
        self._max = max_links
        self._ttl = idle_ttl_sec
        self._clock = clock

    def __len__(self) -> int:
        return len(self._links)

    def lookup(self, response_id: str) -> ChainLink | None:
        """The live link (touched, with its session's other links kept alive), or None."""
        response_id = session_key(response_id)
        link = self._links.get(response_id)
        if link is None:
            return None
        now = self._clock()
        if now - link.last_seen > self._ttl:
            self._drop(response_id)
            return None
        link.last_seen = now
        self._links.move_to_end(response_id)
        return link

    def taken(self, response_id: str, session_id: str | None, tenant: str | None) -> bool:
        """Whether a live link of another session (or tenant) has `response_id`: a turn that
        would store its response under that id is refused before it is forwarded."""
        existing = self.lookup(response_id)
        return existing is not None and (existing.session_id != session_id or existing.tenant != tenant)

    def record(self, response_id: str, session_id: str, replica: Any, tenant: str | None = None) -> bool:
        """Remember that `response_id` (produced on `replica` for `tenant`) continues
        `session_id`. False, and nothing changed, when a live link of another session has
        that id (module doc)."""
        response_id = session_key(response_id)
        existing = self.lookup(response_id)
        if existing is not None and (existing.session_id != session_id or existing.tenant != tenant):
            return False
        if response_id in self._links:
            self._drop(response_id)
        self._links[response_id] = ChainLink(session_id, replica, self._clock(), tenant)
        self._by_session.setdefault(session_id, set()).add(response_id)
        while len(self._links) > self._max:
            self._drop(next(iter(self._links)))
        return True

    def forget_session(self, session_id: str) -> None:
        for response_id in self._by_session.pop(session_id, ()):
            self._links.pop(response_id, None)

    def forget_replica(self, replica: Any) -> None:
        """A removed replica took its responses' state with it."""
        for response_id in [rid for rid, link in self._links.items() if link.replica is replica]:
            self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        link = self._links.pop(response_id, None)
        if link is None:
            return
        ids = self._by_session.get(link.session_id)
        if ids is not None:
            ids.discard(response_id)
            if not ids:
                del self._by_session[link.session_id]
