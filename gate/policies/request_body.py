"""What a policy reads off a request's body: its output allowance and a bound on its prompt."""

from __future__ import annotations

import re
from collections.abc import Mapping


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
# One scan for all of them: a regex alternation reads the body once, where a test per
# marker reads it once each (and a long body holds many near misses of `"type":"`).
_MEDIA_PATTERN = re.compile(b"|".join(re.escape(marker) for marker in _MEDIA_MARKERS))


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


def body_bytes(prompt_bound_tokens: int) -> int:
    """The body's JSON bytes behind a `prompt_token_bound` (its inverse)."""
    return max(0, prompt_bound_tokens - TEMPLATE_MARGIN_TOKENS)
