"""The simulated replica's built-in tokenizer and chat template.

Deterministic and stable across processes: a text piece's id is derived from
zlib.crc32 of its UTF-8 bytes, never from Python's randomised str hash.

Pieces: a word of up to 8 word characters with at most one leading space, one
punctuation character with at most one leading space, or a run of up to 16 whitespace
characters. So roughly one token per short word, like a real BPE on English text, and
no token stands for more than MAX_TOKEN_BYTES bytes of text.

Chat template (prefix-stable): every message renders as
    <|role|> content-tokens <|end|>
after a <|bos|> (and a <|tools|> json <|end|> header when tools are given); the
generation prompt is <|assistant|>. Each message is tokenised on its own, so the token
ids of a conversation are an exact prefix of the ids of the same conversation with more
messages appended, and a turn's generation prompt is the start of its answer's rendering.
"""

from __future__ import annotations

import re
import zlib
from functools import lru_cache

import orjson

VOCAB_SIZE = 32000
PAD, BOS, EOS, END = 0, 1, 2, 3
ROLE_TOKENS = {"system": 4, "user": 5, "assistant": 6, "tool": 7, "developer": 8, "function": 9}
OTHER_ROLE, TOOLS = 10, 11
NUM_SPECIAL = 16
SPECIAL_TEXT = {
    PAD: "<|pad|>",
    BOS: "<|bos|>",
    EOS: "<|eos|>",
    END: "<|end|>",
    OTHER_ROLE: "<|role|>",
    TOOLS: "<|tools|>",
}
SPECIAL_TEXT.update({token: f"<|{role}|>" for role, token in ROLE_TOKENS.items()})

MAX_WORD_CHARS, MAX_SPACE_RUN = 8, 16
_PIECE = re.compile(rf"\s?\w{{1,{MAX_WORD_CHARS}}}|\s?[^\w\s]|\s{{1,{MAX_SPACE_RUN}}}")
# The most UTF-8 bytes one piece can hold (a character takes at most 4, a whitespace
# character at most 3): a word with its leading space, or a whitespace run.
MAX_TOKEN_BYTES = max(3 + 4 * MAX_WORD_CHARS, 3 + 4, 3 * MAX_SPACE_RUN)

# Output text is drawn from this word list, so generated ids decode to readable text.
OUTPUT_WORDS = (
    "the",
    "model",
    "reads",
    "a",
    "file",
    "and",
    "calls",
    "tool",
    "with",
    "cache",
    "block",
    "prefix",
    "token",
    "next",
    "turn",
    "agent",
    "result",
    "plan",
    "edit",
    "test",
    "passes",
    "then",
    "it",
    "writes",
    "code",
    "to",
    "check",
    "output",
    "of",
    "run",
    "done",
    "step",
)


def piece_id(piece: str) -> int:
    return NUM_SPECIAL + zlib.crc32(piece.encode("utf-8")) % (VOCAB_SIZE - NUM_SPECIAL)


@lru_cache(maxsize=4096)
def _encode_cached(text: str) -> tuple[int, ...]:
    return tuple(piece_id(piece) for piece in _PIECE.findall(text))


def encode(text: str) -> list[int]:
    """Token ids of `text` (no special tokens). Cached: conversations resend the same messages."""
    return list(_encode_cached(text))


OUTPUT_IDS = tuple(piece_id(" " + word) for word in OUTPUT_WORDS)
_ID_TO_TEXT = {token: " " + word for token, word in zip(OUTPUT_IDS, OUTPUT_WORDS)}
_ID_TO_TEXT.update(SPECIAL_TEXT)


def output_token(position: int) -> int:
    """The deterministic token generated at `position` (0-based index in the full sequence)."""
    return OUTPUT_IDS[(position * 7 + 3) % len(OUTPUT_IDS)]


def decode_token(token_id: int) -> str:
    """Text of a generated token; ids outside the output vocabulary render as <id>."""
    return _ID_TO_TEXT.get(token_id, f"<{token_id}>")


class TemplateError(ValueError):
    """A chat body the template cannot render; the message says which field is wrong."""


def _content_text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and "type" in part:
                # Non-text parts (images, audio) render as their JSON, so they still hash.
                parts.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
            else:
                raise TemplateError(f"{where}.content[{index}] must be a string or a content part object")
        return "".join(parts)
    raise TemplateError(f"{where}.content must be a string, a list of content parts or null")


def _json_text(value) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def render_message(message, index: int) -> list[int]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise TemplateError(f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise TemplateError(f"{where}.role must be a non-empty string")
    role_token = ROLE_TOKENS.get(role)
    ids = [role_token] if role_token is not None else [OTHER_ROLE, *encode(role)]
    ids.extend(encode(_content_text(message.get("content"), where)))
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.get(key) is not None:
            ids.extend(encode(f"\n{key}: {_json_text(message[key])}"))
    ids.append(END)
    return ids


def render_chat(body: dict) -> list[int]:
    """Prompt token ids of a /v1/chat/completions body (messages, tools, generation prompt)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages must be a non-empty list of message objects")
    ids = [BOS]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise TemplateError("tools must be a list of tool objects")
        if tools:
            ids.extend((TOOLS, *encode(_json_text(tools)), END))
    for index, message in enumerate(messages):
        ids.extend(render_message(message, index))
    add_generation_prompt = body.get("add_generation_prompt", True)
    last_role = messages[-1].get("role")
    continue_final = bool(body.get("continue_final_message", False)) and last_role == "assistant"
    if continue_final:
        ids.pop()  # keep the final assistant message open
    elif add_generation_prompt:
        ids.append(ROLE_TOKENS["assistant"])
    return ids


def render_completion_prompt(prompt) -> list[int]:
    """Prompt token ids of a /v1/completions `prompt`: text gets a <|bos|>, token ids are used as is."""
    if isinstance(prompt, str):
        return [BOS, *encode(prompt)]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return render_completion_prompt(prompt[0])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 or t >= VOCAB_SIZE for t in prompt):
            raise TemplateError(f"prompt token ids must be in [0, {VOCAB_SIZE})")
        return list(prompt)
    raise TemplateError(
        "prompt must be a string, a list of token ids, or a one-element list of either "
        "(the simulated replica serves one prompt per request)"
    )
