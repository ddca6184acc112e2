"""What the simulated replica answers: a reply length and, sometimes, a tool call.

A model ends its reply when it has said its piece, not at `max_tokens`. `plan_reply`
draws the reply's length from a lognormal (median `median_tokens`, shape `sigma`);
`max_tokens` only caps it. When the request offers tools, the reply is a tool call at
`tool_call_rate` (always when the request forces a tool, never with `tool_choice`
none), its arguments drawn from the tool's JSON schema (`schema_values`).

Invariants:
- Deterministic: the plan is a function of the settings (`seed` included), the prompt's
  token ids, the cap and the tool offer, so the same request gets the same answer on any
  replica and in any order.
- A tool call costs what text would: the engine generates `tokens` output tokens either
  way; only what the API shows for them differs.
- A reply cut by the cap is text with finish reason `length` (never a truncated call).
- `lengths="max_tokens"` (or vLLM's `ignore_eos` on the request) is the fixed-length
  answer the benchmarks rely on: exactly `max_tokens` tokens of text, finish `length`;
  with `lengths="max_tokens"`, a request's `min_tokens` (vLLM's floor) ends it there
  instead, finish `stop`: a model that stops as soon as it may, under a cap far above
  its reply (an agent client's max_tokens).
- A sampled reply is never shorter than `min_tokens`.
"""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from dataclasses import dataclass
from typing import Any

import orjson

from kvgate.simulator.config import ConfigError
from kvgate.simulator.schema_values import sample_arguments

REPLY_LENGTHS = ("sampled", "max_tokens")
FIXED_DEFAULT_TOKENS = 16  # an exact-length reply to a request that set no max_tokens (as before)


@dataclass(frozen=True)
class ReplyModel:
    """The replica's answer settings (`kvgate replica --reply-*`, docs/simulator.md).

    Defaults: a median reply of 120 tokens (sigma 0.8: the middle half spans ~70-200
    tokens, about an agent's turn) and a tool call for half the replies that may make one."""

    lengths: str = "sampled"  # "sampled", or "max_tokens": always exactly the cap (benchmarks)
    median_tokens: int = 120
    sigma: float = 0.8
    tool_call_rate: float = 0.5
    seed: int = 0

    def validate(self) -> ReplyModel:
        if self.lengths not in REPLY_LENGTHS:
            raise ConfigError(f"reply lengths must be one of {', '.join(REPLY_LENGTHS)} (got {self.lengths!r})")
        if self.median_tokens < 1:
            raise ConfigError(f"reply median_tokens must be >= 1 (got {self.median_tokens})")
        if not 0 <= self.sigma <= 4:
            raise ConfigError(f"reply sigma must be in [0, 4] (got {self.sigma})")
        if not 0 <= self.tool_call_rate <= 1:
            raise ConfigError(f"reply tool_call_rate must be in [0, 1] (got {self.tool_call_rate})")
        return self


FIXED_LENGTHS = ReplyModel(lengths="max_tokens")  # the benchmarks' replies: exactly max_tokens


@dataclass(frozen=True)
class ToolSpec:
    """One function tool a request offers: its name and its parameters' JSON schema."""

    name: str
    schema: Any


@dataclass(frozen=True)
class ToolOffer:
    """The tools of a request and its choice: "auto", "none", "required" (any tool), or
    "named" (`name` only)."""

    tools: tuple[ToolSpec, ...] = ()
    choice: str = "auto"
    name: str | None = None

    def candidates(self) -> tuple[ToolSpec, ...]:
        if self.choice == "none":
            return ()
        if self.choice == "named":
            return tuple(tool for tool in self.tools if tool.name == self.name)
        return self.tools


NO_TOOLS = ToolOffer()


@dataclass(frozen=True)
class ToolCall:
    """A tool call: `key` (hex, each API prefixes it: call_, toolu_, fc_), the tool's name
    and its arguments as JSON text."""

    key: str
    name: str
    arguments: str

    @property
    def input(self) -> dict:
        return orjson.loads(self.arguments)


@dataclass(frozen=True)
class ReplyPlan:
    tokens: int  # output tokens the engine generates
    natural_stop: bool  # False: cut at the cap
    tool_call: ToolCall | None = None

    @property
    def finish_reason(self) -> str:
        """In chat's words: "tool_calls", "stop" or "length" (each API maps it)."""
        if not self.natural_stop:
            return "length"
        return "tool_calls" if self.tool_call is not None else "stop"


def _rng(seed: int, prompt_token_ids: list[int], max_tokens: int) -> random.Random:
    digest = hashlib.blake2b(array("q", prompt_token_ids).tobytes(), digest_size=16, key=str(seed).encode())
    return random.Random(int.from_bytes(digest.digest(), "big") ^ max_tokens)


def plan_reply(
    model: ReplyModel,
    prompt_token_ids: list[int],
    max_tokens: int,
    offer: ToolOffer = NO_TOOLS,
    fixed: bool = False,
    max_tokens_given: bool = True,
    min_tokens: int = 0,
) -> ReplyPlan:
    """The answer to a prompt capped at `max_tokens`, never shorter than `min_tokens`
    (module doc); `fixed`: the request asked for exactly `max_tokens` (vLLM's
    `ignore_eos`). An exact-length reply to a request without max_tokens
    (`max_tokens_given` False: the cap is the context left) is `FIXED_DEFAULT_TOKENS` long."""
    if model.lengths == "max_tokens" and not fixed and 0 < min_tokens < max_tokens:
        return ReplyPlan(min_tokens, natural_stop=True)
    if fixed or model.lengths == "max_tokens":
        return ReplyPlan(max_tokens if max_tokens_given else min(FIXED_DEFAULT_TOKENS, max_tokens), natural_stop=False)
    rng = _rng(model.seed, prompt_token_ids, max_tokens)
    length = max(1, min_tokens, round(rng.lognormvariate(math.log(model.median_tokens), model.sigma)))
    if length >= max_tokens:
        return ReplyPlan(max_tokens, natural_stop=False)
    candidates = offer.candidates()
    forced = offer.choice in ("required", "named")
    if candidates and (forced or rng.random() < model.tool_call_rate):
        tool = rng.choice(candidates)
        arguments = orjson.dumps(sample_arguments(tool.schema, rng)).decode()
        return ReplyPlan(
            length, natural_stop=True, tool_call=ToolCall(f"{rng.getrandbits(96):024x}", tool.name, arguments)
        )
    return ReplyPlan(length, natural_stop=True)


def arguments_slice(call: ToolCall, sent: int, now: int, total: int) -> str:
    """The part of `call`'s arguments a stream shows between `sent` and `now` of `total`
    generated tokens: the text is spread evenly over the reply, the last token ends it."""
    size = len(call.arguments)
    return call.arguments[size * sent // total : size * now // total]


def tool_offer(tools: list[ToolSpec], choice) -> ToolOffer:
    """A request's offer from its tools and `tool_choice`, in any API's form: "auto",
    "none", "required"; {"type": "auto" | "any" | "none"} (Anthropic); a named tool,
    {"type": "function", "function": {"name"}} (chat), {"type": "function", "name"}
    (Responses) or {"type": "tool", "name"} (Anthropic). Anything else counts as auto."""
    if not tools:
        return NO_TOOLS
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind == "none":
        return ToolOffer(tuple(tools), "none")
    if kind in ("required", "any"):
        return ToolOffer(tuple(tools), "required")
    if isinstance(choice, dict) and kind in ("function", "tool"):
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        if isinstance(name, str):
            return ToolOffer(tuple(tools), "named", name)
    return ToolOffer(tuple(tools), "auto")


def function_tools(tools, api: str) -> list[ToolSpec]:
    """The function tools of a request's `tools` in `api`'s form (chat: {type: function,
    function: {name, parameters}}; messages: {name, input_schema}; responses: {type:
    function, name, parameters}); other tools (server tools, built-ins) are skipped."""
    specs = []
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, dict):
            continue
        if api == "chat" and tool.get("type", "function") == "function" and isinstance(tool.get("function"), dict):
            described, schema_key = tool["function"], "parameters"
        elif api == "messages" and "input_schema" in tool:
            described, schema_key = tool, "input_schema"
        elif api == "responses" and tool.get("type") == "function":
            described, schema_key = tool, "parameters"
        else:
            continue
        if isinstance(described.get("name"), str):
            specs.append(ToolSpec(described["name"], described.get(schema_key) or {"type": "object"}))
    return specs
