"""A turn's prompt usage, read off the replica's answer as it is relayed.

vLLM reports after the fact how many prompt tokens a request had and how many of them
its prefix cache held (the latter when the server runs with
`--enable-prompt-tokens-details`). The gate learns a turn's exact size from it without
a probe (`gate.gate.Lease.learn`). Each API names them its own way:
- `chat`, `completion`: `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens`
  (the reply's tokens: `usage.completion_tokens`; `output_tokens` in the other two APIs);
- `messages` (Anthropic): the prompt is `input_tokens + cache_read_input_tokens +
  cache_creation_input_tokens` (vLLM reports the last two apart from `input_tokens`, as
  Anthropic does, and only with prompt details on); the cached part `cache_read_input_tokens`;
- `responses`: `usage.input_tokens` and `usage.input_tokens_details.cached_tokens`.

Where the usage is:
- a JSON answer: its `usage` member;
- `chat`, `completion` streams: the usage event, the last before `data: [DONE]`
  (`"choices": []` and a `usage` object), sent only when the request asked for
  `stream_options.include_usage`;
- `messages` streams: the `message_delta` event's `usage` (`message_start` carries only
  `input_tokens`);
- `responses` streams: the `response.completed` event's `response.usage`. That event
  holds the whole response (output, instructions, tools), so these streams are read
  event by event, not from their last bytes.

kvgate adds that option to a streamed request without `stream_options` (`asks_for_usage`); `UsageTap` with
`strip=True` then takes the usage event out of the stream, so the client receives the
events it would have received from the replica without kvgate. Invariants:
- without `strip`, every chunk is passed on as it came, at once;
- with `strip`, the bytes passed on are the stream's bytes minus exactly the usage
  events (SSE events end with a blank line: `\\n\\n` as vLLM writes them, or
  `\\r\\n\\r\\n`); an event is passed on once its end has arrived (vLLM writes whole
  events, so nothing waits);
- the tap holds at most `_EVENT_BYTES` of an unfinished event in every mode, and reads
  each byte a bounded number of times (a chunk is scanned once for event ends, with the
  3 bytes before it): an event longer than that is passed on as it comes, unread (a
  usage event is a few hundred bytes);
- a malformed or missing usage is no usage (None), never an error: the answer is the
  client's, the usage only a hint to the gate;
- Anthropic and Responses streams report usage unasked: they are never stripped; an
  event of theirs longer than `_EVENT_BYTES` is not held, the rest of the stream is
  then read from its last bytes as a chat stream is.

With `read_end` the tap also reads how the reply ended (`end`, `proxy.reply_end`): from
a JSON answer, from the event that carries an Anthropic or Responses stream's usage (the
same event says it), and from a chat stream's `finish_reason` (its last content chunk),
found in the events read or the last bytes kept. Nothing else changes: the same bytes pass.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import TypeGuard

import orjson

from kvgate.proxy.reply_end import ReplyEnd, combined, reply_end_of, stream_chat_end

USAGE_KINDS = frozenset({"chat", "completion", "messages", "responses"})  # routes whose answers report usage
ASKED_USAGE_KINDS = frozenset({"chat", "completion"})  # routes whose streams report it only when asked
_USAGE_KEY = b'"usage"'
_EVENT_END = re.compile(rb"\r?\n\r?\n")  # a blank line: LF or CRLF line ends
_END_OVERLAP = 3  # bytes of an event end that may precede a chunk (`\r\n\r` of `\r\n\r\n`)
_TAIL_BYTES = 16384  # the stream's last bytes kept to find the usage event in (the last but [DONE])
_EVENT_BYTES = 1 << 22  # the longest Anthropic or Responses event read (a response.completed holds the response)


@dataclass(frozen=True, slots=True)
class PromptUsage:
    """A served turn's prompt, as the replica counted it, and its reply's length.
    Invariant: 0 <= cached_tokens <= prompt_tokens."""

    prompt_tokens: int
    cached_tokens: int | None  # None: the server does not report prompt_tokens_details
    output_tokens: int | None = None  # the tokens generated; None: not reported


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _usage(prompt: object, cached: object, output: object) -> PromptUsage | None:
    """`prompt` tokens (> 0), `cached` of them (None unless 0 <= cached <= prompt), and
    `output` tokens generated (None unless a count)."""
    if not _count(prompt) or prompt == 0:
        return None
    return PromptUsage(
        prompt, cached if _count(cached) and cached <= prompt else None, output if _count(output) else None
    )


def _openai_usage(usage: dict) -> PromptUsage | None:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return _usage(usage.get("prompt_tokens"), cached, usage.get("completion_tokens"))


def _anthropic_usage(usage: dict) -> PromptUsage | None:
    """`input_tokens` leaves out the tokens read from and written to the prefix cache."""
    uncached = usage.get("input_tokens")
    read = usage.get("cache_read_input_tokens")
    created = usage.get("cache_creation_input_tokens")
    if not _count(uncached) or not all(part is None or _count(part) for part in (read, created)):
        return None
    return _usage(uncached + (read or 0) + (created or 0), read, usage.get("output_tokens"))


def _responses_usage(usage: dict) -> PromptUsage | None:
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return _usage(usage.get("input_tokens"), cached, usage.get("output_tokens"))


_READERS = {"messages": _anthropic_usage, "responses": _responses_usage}


def usage_of(doc: object, kind: str = "chat") -> PromptUsage | None:
    """The PromptUsage of an answer object or stream event of route `kind` (`{"usage":
    {...}}`; a Responses stream event: `{"response": {"usage": {...}}}`), or None."""
    if not isinstance(doc, dict):
        return None
    usage = doc.get("usage")
    if kind == "responses" and usage is None and isinstance(doc.get("response"), dict):
        usage = doc["response"].get("usage")  # response.completed (response.created: usage null)
    if not isinstance(usage, dict):
        return None
    return _READERS.get(kind, _openai_usage)(usage)


def json_usage(body: bytes, kind: str = "chat") -> PromptUsage | None:
    """The usage of a whole JSON answer of route `kind`, or None."""
    if _USAGE_KEY not in body:
        return None
    try:
        return usage_of(orjson.loads(body), kind)
    except orjson.JSONDecodeError:
        return None


def _event_usage(event: bytes, kind: str = "chat") -> tuple[PromptUsage | None, bool, object]:
    """The usage of one SSE event, whether it is the usage event (`choices: []`, a
    usage object) rather than a content event that carries usage too (a server that
    reports usage on every event, vLLM's `--enable-force-include-usage`), and the event's
    parsed data (None: no usage in it)."""
    start = event.find(b"data:")
    if start < 0 or _USAGE_KEY not in event:
        return None, False, None
    try:
        doc = orjson.loads(event[start + 5 :])
    except orjson.JSONDecodeError:
        return None, False, None
    usage = usage_of(doc, kind)
    return usage, usage is not None and isinstance(doc, dict) and doc.get("choices") in ([], None), doc


def _says_finish(data: bytes) -> bool:
    """Whether chat stream bytes may hold a `finish_reason` that is not null (a quick test
    before the pattern: every content chunk has the key, null until the last)."""
    return b'"finish_reason":"' in data or b'"finish_reason": "' in data


def _last_event_end(data: bytearray, start: int) -> int:
    """The offset just past the last event end in `data` found from `start`, or -1. Every
    event end (`_EVENT_END`) ends with one of these two: two C-speed searches, no regex."""
    lf, crlf = data.rfind(b"\n\n", start), data.rfind(b"\n\r\n", start)
    return max(lf + 2 if lf >= 0 else -1, crlf + 3 if crlf >= 0 else -1)


def _first_event_end(data: bytearray, start: int) -> int:
    """The offset just past the first event end in `data` found from `start`, or -1."""
    ends = [at + size for at, size in ((data.find(b"\n\n", start), 2), (data.find(b"\n\r\n", start), 3)) if at >= 0]
    return min(ends) if ends else -1


def _events(data: bytes, keep_rest: bool = False) -> list[bytes]:
    """`data`'s whole events, each with its end; and what follows the last end if `keep_rest`."""
    events, begin = [], 0
    for match in _EVENT_END.finditer(data):
        events.append(data[begin : match.end()])
        begin = match.end()
    if keep_rest and begin < len(data):
        events.append(data[begin:])
    return events


def asks_for_usage(body: dict) -> bool:
    """Whether kvgate should ask for the usage of this request on the client's behalf:
    a streamed request without `stream_options` (one that has them is left as sent).
    The caller adds `USAGE_OPTION` and strips the usage event from the answer."""
    return body.get("stream") is True and "stream_options" not in body


USAGE_OPTION = {"include_usage": True}


class UsageTap:
    """Watches one answer of route `kind` for its usage: an SSE stream's chunks through
    `feed` (which returns the bytes to pass on) and `finish`, or a whole JSON body
    through `whole`. `strip` (chat and completion only) takes the usage event out;
    `read_end` reads how the reply ended too (`end`)."""

    __slots__ = (
        "strip",
        "kind",
        "usage",
        "end",
        "_chat_end",
        "_event_end",
        "_by_event",
        "_held",
        "_passing",
        "_recent",
        "_recent_bytes",
        "_unasked",
    )

    def __init__(self, strip: bool, kind: str = "chat", read_end: bool = False) -> None:
        assert not strip or kind in ASKED_USAGE_KINDS
        self.strip = strip
        self.kind = kind
        self.usage: PromptUsage | None = None
        self.end = ReplyEnd.UNKNOWN  # read only with read_end
        self._chat_end = read_end and kind in ASKED_USAGE_KINDS  # from the finish_reason of the stream's chunks
        self._event_end = read_end and kind not in ASKED_USAGE_KINDS  # from the event that carries the usage
        # read event by event (strip, or a stream whose usage is not in its last event)
        self._by_event = strip or kind not in ASKED_USAGE_KINDS
        self._held = bytearray()  # _by_event: the start of an event whose end has not arrived
        self._passing = False  # strip: an event over _EVENT_BYTES is being passed on unread
        self._recent: deque[bytes] = deque()  # otherwise: the last chunks, _TAIL_BYTES or a little more
        self._recent_bytes = 0
        # strip: a content event carried usage, so the server sends usage unasked
        # (`--enable-force-include-usage`): its usage event is the client's too, kept.
        self._unasked = False

    def feed(self, chunk: bytes) -> bytes:
        if not self._by_event:
            self._keep_recent(chunk)
            return chunk
        held = self._held
        scan_from = max(0, len(held) - _END_OVERLAP)
        held += chunk
        if self._passing:  # the rest of an over-long event: passed on as it comes, up to its end
            cut = _first_event_end(held, scan_from)
            if cut < 0:
                del held[: max(0, len(held) - _END_OVERLAP)]
                return chunk
            self._passing = False
            rest = bytes(held[cut:])  # new events: read from their start
            held.clear()
            return chunk[: len(chunk) - len(rest)] + self.feed(rest) if rest else chunk
        cut = _last_event_end(held, scan_from)
        whole = bytes(held[:cut]) if cut > 0 else b""
        if cut > 0:
            del held[:cut]
        passed = self._events_passed_on(whole)
        out = passed if self.strip else chunk
        if len(held) > _EVENT_BYTES:
            if not self.strip:  # read the rest from its last bytes, as a chat stream is
                self._by_event = False
                self._keep_recent(bytes(held))
                held.clear()
            else:  # a content event that long is no usage event: pass it on, unread
                self._passing = True
                out += bytes(held)
                del held[: len(held) - _END_OVERLAP]
        return out

    def _events_passed_on(self, whole: bytes) -> bytes:
        """Read the usage (and the end) off whole events; the events to pass on (strip: all but the usage event)."""
        self._read_chat_end(whole)
        if _USAGE_KEY not in whole:
            return whole
        kept = []
        for event in _events(whole):
            usage, usage_event, doc = _event_usage(event, self.kind)
            if usage is not None:
                self.usage = usage
                self._unasked |= not usage_event
                if self._event_end:
                    self._saw_end(reply_end_of(doc, self.kind))
            if not usage_event or self._unasked:
                kept.append(event)
        return b"".join(kept)

    def _keep_recent(self, chunk: bytes) -> None:
        recent = self._recent
        recent.append(chunk)
        self._recent_bytes += len(chunk)
        while self._recent_bytes - len(recent[0]) >= _TAIL_BYTES:
            self._recent_bytes -= len(recent.popleft())

    def _read_chat_end(self, data: bytes) -> None:
        """The end a chat stream's bytes say, if the tap reads one and they may say it."""
        if self._chat_end and _says_finish(data):
            self._saw_end(stream_chat_end(data))

    def _saw_end(self, end: ReplyEnd | None) -> None:
        """An end said by part of the stream: a chat stream's choices end in separate chunks."""
        if end is not None and end is not ReplyEnd.UNKNOWN:
            self.end = end if self.end is ReplyEnd.UNKNOWN else combined([self.end, end])

    def whole(self, body: bytes) -> None:
        """A JSON answer, whole."""
        if not (self._chat_end or self._event_end):
            self.usage = json_usage(body, self.kind)
            return
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        self.usage = usage_of(doc, self.kind)
        self.end = reply_end_of(doc, self.kind)

    def finish(self) -> bytes:
        """The stream ended: the bytes still to pass on; `usage` is final."""
        if not self._by_event:
            tail = b"".join(self._recent)
            self._recent.clear()
            self._recent_bytes = 0
            for event in reversed(_events(tail, keep_rest=True)):
                usage, _, doc = _event_usage(event, self.kind)
                if usage is not None:
                    self.usage = usage
                    if self._event_end:
                        self._saw_end(reply_end_of(doc, self.kind))
                    break
            self._read_chat_end(tail)
            return b""
        rest = b"" if self._passing else bytes(self._held)
        self._held.clear()
        return rest if self.strip else b""
