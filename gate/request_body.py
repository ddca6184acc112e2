"""What the gate reads off a turn's request body, in one place (pure).

The proxy parses and checks the body (`proxy.request_body`); the gate reads from the
parsed body, without changing it:

- **the output allowance and a bound on the prompt** (`output_allowance`,
  `prompt_token_bound`): what the working_set policy prices a turn by before any probe;
- **what the body says about its prompt, per route kind** (`body_holds_prompt`,
  `turn_key`): whether its bytes bound the prompt at all, and the turn's identity;
- **a floor on the prompt's tokens** (`user_text_bytes`, `prompt_token_floor`,
  `over_long`): the `prompt_too_long` refusal the gate can give before probing.

## Whether the body holds the prompt

The working_set policy bounds a turn's prompt by its body's bytes (`prompt_token_bound`),
which holds only when the body carries the whole prompt. A Responses body that
continues `previous_response_id` does not: the server prepends the conversation it
holds for that response (vLLM's `response_store`), so its bytes bound nothing and the
turn must be priced by the prefix probe, which renders it with that state.

## The floor

A replica refuses a prompt longer than its `max_model_len` (`prompt_too_long`), but only
after reading, rendering and tokenizing it. The gate refuses such a prompt itself, before
probing or forwarding it, when the body alone proves it too long:

    prompt tokens >= user text bytes / (max_token_bytes * MAX_TEXT_SHRINK)

- `max_token_bytes` (the replica's kv answer) bounds the bytes of text any one token
  stands for, so a rendered prompt of `n` bytes has at least `n / max_token_bytes` tokens.
- Only text every rendering keeps whole counts (`user_text_bytes`): the text of the
  user's messages, each piece stripped of surrounding whitespace (templates may trim
  it). A chat template only adds to it (role markers, a system prompt), so the bound
  from this text alone stays a lower bound. Everything else counts for nothing: a
  template may drop or rewrite assistant turns (earlier reasoning), a system prompt
  it does not support, or tool definitions; media parts have no text.
- A tokenizer's normalizer may compose characters before splitting (Unicode NFC turns
  three Hangul jamo of 3 bytes each into one syllable of 3 bytes), so text can shrink
  by up to MAX_TEXT_SHRINK before it is tokenized.
- A body that lets the server cut its prompt (`truncate_prompt_tokens`, Responses
  `truncation` other than "disabled") or render it with its own template
  (`chat_template`) has no floor: a long body may still be served.

Invariant (table-tested, including multi-byte text): `prompt_token_floor` never exceeds
the tokens the replica counts, so `over_long` refuses only prompts the replica would
refuse too.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import orjson

from kvgate.gate.policies.vocabulary import Reject, RejectCode
from kvgate.wire.blocks import cdiv

# ----------------------------------------------------------- allowance and bound


def output_allowance(body: Mapping[str, object]) -> int:
    """Output tokens a request may generate: `max_completion_tokens`, else `max_tokens`
    (chat, completion, Anthropic messages), else `max_output_tokens` (Responses), else 0.

    vLLM reads the same fields (the first wins). Anything that is not a non-negative
    integer counts as absent (vLLM rejects such a request itself).
    """
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 0


# Tokens a chat template may add that are not in the request body (role markers, a
# default system prompt, tool-use instructions). Generous: a low bound would let the
# no-probe path under-price a turn, a high one only makes it probe sooner.
TEMPLATE_MARGIN_TOKENS = 512

# Content types whose tokens are not bounded by their bytes in the body (an image URL
# of 100 bytes renders to hundreds of tokens). orjson writes no spaces, and a quote
# inside a string is escaped, so these only match real JSON keys and values.
_MEDIA_MARKERS = (
    b'"type":"image',
    b'"type":"input_image',
    b'"type":"audio',
    b'"type":"input_audio',
    b'"type":"video',
    b'"type":"file',
    b'"type":"document',
    b'"image_url"',
    b'"prompt_embeds"',
)
_TYPE_HEAD = b'"type":"'  # the head the content-type markers share


def _one_scan(markers: tuple[bytes, ...]) -> re.Pattern[bytes]:
    """One regex for all `markers`: an alternation reads the body once, where a test per
    marker reads it once each (and a long body holds many near misses of `"type":"`). The
    markers' common heads are factored out (`"` and `type":"`), so a position of the body
    that starts none of them is passed over by one comparison, not one per marker: a third
    less time on a 140 KB agent's body."""
    types = [marker[len(_TYPE_HEAD) :] for marker in markers if marker.startswith(_TYPE_HEAD)]
    others = [marker[1:] for marker in markers if not marker.startswith(_TYPE_HEAD)]
    assert all(marker.startswith(b'"') for marker in markers), "every marker is a JSON string"
    branches = [re.escape(_TYPE_HEAD[1:]) + b"(?:" + b"|".join(map(re.escape, types)) + b")", *map(re.escape, others)]
    return re.compile(b'"(?:' + b"|".join(branches) + b")")


_MEDIA_PATTERN = _one_scan(_MEDIA_MARKERS)


def prompt_token_bound(body_json: bytes) -> int | None:
    """An upper bound on the tokens a text request renders to, from its JSON bytes.

    A token stands for at least one byte of the text it encodes, and the body holds
    every byte of the messages (JSON escaping only adds bytes), so the body's length
    plus TEMPLATE_MARGIN_TOKENS bounds the prompt. None when the body carries media,
    whose tokens its bytes do not bound.
    """
    if _MEDIA_PATTERN.search(body_json) is not None:
        return None
    return len(body_json) + TEMPLATE_MARGIN_TOKENS


# --------------------------------------------------- media, read turn by turn

# `_MEDIA_MARKERS` as the parsed body holds them: a dict whose `type` starts with one of
# these heads, or that has one of these keys (a part that names its content without a
# `type`, completions' prompt embeddings).
MEDIA_TYPE_HEADS = tuple(m[len(_TYPE_HEAD) :].decode() for m in _MEDIA_MARKERS if m.startswith(_TYPE_HEAD))
MEDIA_KEYS = frozenset(m.strip(b'"').decode() for m in _MEDIA_MARKERS if not m.startswith(_TYPE_HEAD))
# The list of a route's body that holds its conversation and grows by every turn.
HISTORY_FIELDS = {"chat": "messages", "messages": "messages", "responses": "input"}
# Fields beside the history that carry no content of the prompt: tool definitions, whose
# `type` values are JSON-schema types and tool kinds (Responses' `file_search`), not parts.
NO_CONTENT_FIELDS = frozenset({"tools"})


@dataclass(frozen=True, slots=True)
class HistoryMedia:
    """What one thread of a session showed of media so far: how many items of its history
    were read, whether any of them held media, and digests of the first and the last one
    read (`item_digest`), by which a later turn's body is known to continue that history."""

    items: int = 0
    media: bool = False
    first: int = 0
    last: int = 0


# Anthropic's prompt-caching breakpoint on a message or a content block. It changes nothing
# the model reads, and agents move it every turn: Claude Code marks its newest message
# (a content list of one text part) and, a turn later, sends that message unmarked (its
# text as a plain string).
CACHE_MARK = "cache_control"


def _without_mark(part: dict) -> dict:
    return {name: value for name, value in part.items() if name != CACHE_MARK}


def _text_of(content: list) -> str | None:
    """The text of a content list of one plain text part, else None."""
    part = content[0] if len(content) == 1 else None
    text = part.get("text") if isinstance(part, dict) and len(part) == 2 and part.get("type") == "text" else None
    return text if isinstance(text, str) else None


def _rendered_content(content: list) -> list | str:
    """A content list as its prompt renders it: its parts without their marks, and one plain
    text part as its text; `content` itself when nothing changes."""
    if any(isinstance(part, dict) and CACHE_MARK in part for part in content):
        content = [_without_mark(part) if isinstance(part, dict) else part for part in content]
    text = _text_of(content)
    return content if text is None else text


def _rendered_part(part: object) -> object:
    """A content part as its prompt renders it: without its mark, and a tool result's own
    content list (text and image parts, each of which may carry a mark) as
    `_rendered_content` renders it; `part` itself when nothing changes."""
    if not isinstance(part, dict):
        return part
    inner = part.get("content")
    rendered = _rendered_content(inner) if isinstance(inner, list) else inner
    if rendered is inner and CACHE_MARK not in part:
        return part
    return {name: rendered if name == "content" else value for name, value in part.items() if name != CACHE_MARK}


def rendered_item(item: object) -> object:
    """A history item as its prompt renders it: without prompt-caching marks (CACHE_MARK,
    on the item, its content's parts or a tool result's own parts), and a content list of
    one plain text part as its text, the item's and a tool result's (the same prompt as a
    string content, on every route). The item itself when it has neither, as most items
    have; never changed in place."""
    if not isinstance(item, dict):
        return item
    content = item.get("content")
    changed = CACHE_MARK in item
    if isinstance(content, list):
        parts = [_rendered_part(part) for part in content]
        if any(new is not old for new, old in zip(parts, content)):
            content, changed = parts, True
        text = _text_of(content)
        if text is not None:
            content, changed = text, True
    if not changed:
        return item
    return {name: content if name == "content" else value for name, value in item.items() if name != CACHE_MARK}


def item_digest(item: object) -> int:
    """A digest of one history item as its prompt renders it (`rendered_item`): equal for
    the same item in the next turn's body (a fresh parse of the same JSON, with or without
    the prompt-caching mark an agent moved off it), different for another session
    thread's item there."""
    try:
        return hash(orjson.dumps(rendered_item(item)))
    except TypeError:  # not JSON data (only in-process callers): never taken for the same item
        return hash(id(item))


_CONTAINERS = (dict, list)


def holds_media(value: object) -> bool:
    """Whether a parsed JSON value carries media at any depth: a dict whose `type` starts
    with one of MEDIA_TYPE_HEADS, or with a key in MEDIA_KEYS. Strings are not read: a
    message's text is text, whatever it says (as a quote inside it is escaped in the bytes)."""
    stack = [value]
    pop, push = stack.pop, stack.append  # (on every turn's path: a plain loop, no generator)
    while stack:
        node = pop()
        if isinstance(node, dict):
            kind = node.get("type")
            if (isinstance(kind, str) and kind.startswith(MEDIA_TYPE_HEADS)) or not MEDIA_KEYS.isdisjoint(node):
                return True
            children: Iterable[object] = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        for child in children:
            if isinstance(child, _CONTAINERS):
                push(child)
    return False


# The threads of one session whose histories are remembered (`turn_media`): an agent's main
# thread, the subagents it runs at once, and its title or summary requests.
THREADS_KEPT = 4


def _thread_continued(history: list, threads: tuple[HistoryMedia, ...]) -> int | None:
    """The index of the thread whose history `history` continues, else None: one it is at
    least as long as, holding that thread's first item (where a subagent's history
    differs) and the item it read last (where a compacted one differs) where the thread
    read them. Of several, the longest: a title request's history of the first message
    alone is continued by its main thread's too. The first item is digested once."""
    count = len(history)
    first: int | None = None
    best: int | None = None
    for index, seen in enumerate(threads):
        if not 0 < seen.items <= count or (best is not None and seen.items <= threads[best].items):
            continue
        if first is None:
            first = item_digest(history[0])
        # (a thread of one item read has it as its first and its last)
        if first == seen.first and (seen.items == 1 or item_digest(history[seen.items - 1]) == seen.last):
            best = index
    return best


def turn_media(
    route_kind: str, body: Mapping[str, object], threads: tuple[HistoryMedia, ...]
) -> tuple[bool, tuple[HistoryMedia, ...]] | None:
    """Whether the turn's body carries media, and its session's threads as they are then
    seen (the one this body continues first, at most THREADS_KEPT), reading only the
    history items added since the thread's last turn when the body continues one of them
    (a thread's history grows by appending its turn's reply and tool results: the first
    item and the one read last are where they were, `_thread_continued`). A history that
    continues none is read whole and starts a thread: an agent compacted it, or a new
    thread of the session sent it (a subagent, a title request). The fields beside the
    history are read every turn, but for NO_CONTENT_FIELDS.

    A media part put into an item between the first and the last one read is not seen
    here; the turn's usage shows it (`Repricer.learn`: more prompt tokens than the body's
    bound), and the next turns read their histories whole. None: the body has no history
    list of its route's shape (a string `input` is one; a missing or malformed one is
    not), so its bytes must be read whole.
    """
    field = HISTORY_FIELDS.get(route_kind)
    if field is None:
        return None
    history = body.get(field)
    if not isinstance(history, list):
        if not (route_kind == "responses" and isinstance(history, str)):
            return None
        history = []
    count = len(history)
    index = _thread_continued(history, threads)
    seen = HistoryMedia() if index is None else threads[index]  # None: read it whole
    if count != seen.items:  # (else nothing new to read, and the same `seen`)
        media = seen.media or holds_media(history[seen.items :])
        first = seen.first if seen.items else item_digest(history[0])
        seen = HistoryMedia(count, media, first, item_digest(history[-1]))
    if seen.items and (index != 0 or seen is not threads[0]):  # (an empty history is no thread)
        others = threads if index is None else threads[:index] + threads[index + 1 :]
        threads = (seen, *others[: THREADS_KEPT - 1])
    if seen.media or not MEDIA_KEYS.isdisjoint(body):
        return True, threads
    for name, value in body.items():
        if isinstance(value, _CONTAINERS) and name != field and name not in NO_CONTENT_FIELDS and holds_media(value):
            return True, threads
    return False, threads


def body_bytes(prompt_bound_tokens: int) -> int:
    """The body's JSON bytes behind a `prompt_token_bound` (its inverse)."""
    return max(0, prompt_bound_tokens - TEMPLATE_MARGIN_TOKENS)


# -------------------------------------------------------- the prompt, per route

# The body fields that make a turn what it is, on every route kind: its prompt (chat and
# Anthropic `messages` and `system`, completions' `prompt`, Responses' `input`,
# `instructions` and the response it continues) and the tools it may call.
TURN_FIELDS = ("messages", "system", "prompt", "input", "instructions", "previous_response_id", "tools")


def body_holds_prompt(route_kind: str, body: Mapping[str, object]) -> bool:
    """True when every prompt token comes from the body (and the template)."""
    return not (route_kind == "responses" and body.get("previous_response_id") is not None)


def turn_key(route_kind: str, body: Mapping[str, object]) -> str:
    """The identity of a turn: equal for a re-sent request (a client's retry, an agent
    re-sending after a timeout), different for the distinct requests one session sends at
    once (a main turn beside a title or summary request, parallel subagents). Sampling
    settings (`stream`, `max_tokens`, `temperature`, ...) do not count: a retry may change
    them. A digest, so the books hold 32 bytes per attempt, not the prompt."""
    fields = {name: body[name] for name in TURN_FIELDS if name in body}
    try:
        encoded = orjson.dumps([route_kind, fields], option=orjson.OPT_SORT_KEYS)
    except TypeError:  # not JSON data (only in-process callers): every such body is its own turn
        encoded = repr((route_kind, id(body))).encode()
    return hashlib.blake2b(encoded, digest_size=16).hexdigest()


# --------------------------------------------------------------------- the floor

# The most a Unicode normalizer (NFC, NFKC) shrinks text in UTF-8 bytes: three jamo
# (9 bytes) composing into one Hangul syllable (3 bytes).
MAX_TEXT_SHRINK = 3

# Body fields that let the server shorten the prompt or render it differently.
_NO_FLOOR_FIELDS = ("truncate_prompt_tokens", "chat_template")

# Text part types of the user's content: chat, Anthropic messages, Responses.
_TEXT_PARTS = ("text", "input_text")


def _stripped_bytes(text: object) -> int:
    if not isinstance(text, str):
        return 0
    text = text.strip()
    return len(text) if text.isascii() else len(text.encode("utf-8"))  # isascii is O(1): no copy


def _content_texts(content: object) -> Iterator[object]:
    """The text pieces of one message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
                yield part.get("text")


def _user_messages(items: object) -> Iterator[object]:
    """The content of each user message in a list of messages (or Responses input items)."""
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict) and item.get("role") == "user" and item.get("type", "message") == "message":
            yield item.get("content")


def user_text_bytes(route_kind: str, body: Mapping[str, object]) -> int:
    """UTF-8 bytes of the body's text that every rendering of it keeps: the user's
    messages (chat, Anthropic `messages`, Responses `input`) or a completion's text
    `prompt`, each piece stripped. 0 when the body admits no floor (see the module)."""
    if any(body.get(name) is not None for name in _NO_FLOOR_FIELDS):
        return 0
    if route_kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:  # one prompt in a list; a batch is several prompts
            prompt = prompt[0]
        return _stripped_bytes(prompt)
    if route_kind == "responses":
        if body.get("truncation") not in (None, "disabled"):
            return 0
        items = body.get("input")
        if isinstance(items, str):
            return _stripped_bytes(items)
    else:  # chat and Anthropic messages
        items = body.get("messages")
    return sum(_stripped_bytes(text) for content in _user_messages(items) for text in _content_texts(content))


def prompt_token_floor(text_bytes: int, max_token_bytes: int) -> int:
    """The fewest tokens `text_bytes` bytes of kept text render to (module docstring)."""
    return cdiv(text_bytes, max_token_bytes * MAX_TEXT_SHRINK)  # a partial token is still a token


def over_long(text_bytes: int, max_model_len: int | None, max_token_bytes: int | None) -> Reject | None:
    """The `prompt_too_long` refusal of a prompt whose floor exceeds the replica's
    `max_model_len`, else None (also when the replica does not give both figures)."""
    if max_model_len is None or not max_token_bytes:
        return None
    floor = prompt_token_floor(text_bytes, max_token_bytes)
    if floor <= max_model_len:
        return None
    return Reject(
        RejectCode.PROMPT_TOO_LONG,
        f"the prompt has at least {floor} tokens, more than the replica's max_model_len ({max_model_len}); "
        "shorten the conversation (or start a new session) to fit",
    )
