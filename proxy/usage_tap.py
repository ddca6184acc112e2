"""A turn's prompt usage, read off the replica's answer as it is relayed.

vLLM reports after the fact how many prompt tokens a request had and how many of them
its prefix cache held: `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens`
(the latter when the server runs with `--enable-prompt-tokens-details`). The gate learns
a turn's exact size from it without a probe (`gate.gate.Lease.learn`).

Where the usage is, on the two OpenAI routes (`chat`, `completion`):
- a JSON answer: its `usage` member;
- an SSE stream: its usage event, the last before `data: [DONE]` (`"choices": []` and a
  `usage` object), sent only when the request asked for `stream_options.include_usage`.

kvgate adds that option to a streamed request without `stream_options` (`asks_for_usage`); `UsageTap` with
`strip=True` then takes the usage event out of the stream, so the client receives the
events it would have received from the replica without kvgate. Invariants:
- without `strip`, every chunk is passed on as it came, at once;
- with `strip`, the bytes passed on are the stream's bytes minus exactly the usage
  events (SSE events end with a blank line, `\\n\\n`, as vLLM writes them); an event
  is passed on once its end has arrived (vLLM writes whole events, so nothing waits);
- a malformed or missing usage is no usage (None), never an error: the answer is the
  client's, the usage only a hint to the gate.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import orjson

USAGE_KINDS = frozenset({"chat", "completion"})  # routes whose answers carry OpenAI `usage`
_USAGE_KEY = b'"usage"'
_EVENT_END = b"\n\n"
_TAIL_BYTES = 16384  # the stream's last bytes kept to find the usage event in (the last but [DONE])


@dataclass(frozen=True, slots=True)
class PromptUsage:
    """A served turn's prompt, as the replica counted it. Invariant: 0 <= cached_tokens <= prompt_tokens."""

    prompt_tokens: int
    cached_tokens: int | None  # None: the server does not report prompt_tokens_details


def usage_of(doc: object) -> PromptUsage | None:
    """The PromptUsage of an answer object (`{"usage": {...}}`), or None."""
    if not isinstance(doc, dict):
        return None
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    if not isinstance(prompt, int) or isinstance(prompt, bool) or prompt <= 0:
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(cached, int) or isinstance(cached, bool) or not 0 <= cached <= prompt:
        cached = None
    return PromptUsage(prompt, cached)


def json_usage(body: bytes) -> PromptUsage | None:
    """The usage of a whole JSON answer, or None."""
    if _USAGE_KEY not in body:
        return None
    try:
        return usage_of(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None


def _event_usage(event: bytes) -> tuple[PromptUsage | None, bool]:
    """The usage of one SSE event, and whether it is the usage event (`choices: []`, a
    usage object) rather than a content event that carries usage too (a server that
    reports usage on every event, vLLM's `--enable-force-include-usage`)."""
    start = event.find(b"data:")
    if start < 0 or _USAGE_KEY not in event:
        return None, False
    try:
        doc = orjson.loads(event[start + 5 :])
    except orjson.JSONDecodeError:
        return None, False
    usage = usage_of(doc)
    return usage, usage is not None and isinstance(doc, dict) and doc.get("choices") in ([], None)


def asks_for_usage(body: dict) -> bool:
    """Whether kvgate should ask for the usage of this request on the client's behalf:
    a streamed request without `stream_options` (one that has them is left as sent).
    The caller adds `USAGE_OPTION` and strips the usage event from the answer."""
    return body.get("stream") is True and "stream_options" not in body


USAGE_OPTION = {"include_usage": True}


class UsageTap:
    """Watches one answer for its usage: an SSE stream's chunks through `feed` (which
    returns the bytes to pass on) and `finish`, or a whole JSON body through `whole`."""

    __slots__ = ("strip", "usage", "_tail", "_recent", "_recent_bytes", "_unasked")

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.usage: PromptUsage | None = None
        self._tail = b""  # strip: the start of an event whose end has not arrived
        self._recent: deque[bytes] = deque()  # no strip: the last chunks, _TAIL_BYTES or a little more
        self._recent_bytes = 0
        # strip: a content event carried usage, so the server sends usage unasked
        # (`--enable-force-include-usage`): its usage event is the client's too, kept.
        self._unasked = False

    def feed(self, chunk: bytes) -> bytes:
        if not self.strip:
            recent = self._recent
            recent.append(chunk)
            self._recent_bytes += len(chunk)
            while self._recent_bytes - len(recent[0]) >= _TAIL_BYTES:
                self._recent_bytes -= len(recent.popleft())
            return chunk
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(_EVENT_END)
        if cut < 0:
            self._tail = data
            return b""
        cut += len(_EVENT_END)
        whole, self._tail = data[:cut], data[cut:]
        if _USAGE_KEY not in whole:
            return whole
        kept = []
        for event in whole.split(_EVENT_END)[:-1]:
            usage, usage_event = _event_usage(event)
            if usage is not None:
                self.usage = usage
                self._unasked |= not usage_event
            if not usage_event or self._unasked:
                kept.append(event + _EVENT_END)
        return b"".join(kept)

    def whole(self, body: bytes) -> None:
        """A JSON answer, whole."""
        self.usage = json_usage(body)

    def finish(self) -> bytes:
        """The stream ended: the bytes still to pass on; `usage` is final."""
        if not self.strip:
            tail = b"".join(self._recent)
            self._recent.clear()
            self._recent_bytes = 0
            for event in reversed(tail.split(_EVENT_END)):
                usage, _ = _event_usage(event)
                if usage is not None:
                    self.usage = usage
                    break
            return b""
        rest, self._tail = self._tail, b""
        return rest
