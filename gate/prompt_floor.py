"""A lower bound on a prompt's tokens, read off its request body, and the refusal it allows (pure).

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

from collections.abc import Iterator, Mapping

from kvgate.gate.policies.vocabulary import Reject, RejectCode
from kvgate.wire.blocks import cdiv

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
