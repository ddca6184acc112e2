"""The prefix-cache ceiling: the hit rate an infinite cache would reach on a workload.

An infinite cache never evicts, so a prompt token is a hit exactly when it lies in a
full block whose whole prefix (every token from the start up to the end of that
block) was already computed by an earlier request. This module counts those tokens,
with vLLM v1's rules:

- only full blocks are cached and looked up, by a chain key (parent block, tokens);
- a lookup stops at the first missing block (a prefix match, not a set match);
- at most `len(prompt) - 1` tokens can hit: the last prompt token is always computed,
  so a prompt that is wholly cached still re-computes its last block;
- after a request, the cache holds the full blocks of its prompt plus its reply minus
  the last reply token (the last sampled token is never fed back to the model).

Everything here is pure: token sequences in, counts out. Tokens are any hashable
values (ids or words).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from kvgate.bench.agentic.workload import Workload, build_messages

Token = Hashable
Renderer = Callable[[list[dict]], Sequence[Token]]


@dataclass(frozen=True)
class Ceiling:
    prompt_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class InfiniteCache:
    """A prefix cache of unbounded size keyed like vLLM's block hashes (exact, no hashing)."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._block_ids: dict[tuple[int, tuple], int] = {}

    def _chain(self, tokens: Sequence[Token], create: bool) -> int:
        """Number of leading full blocks of `tokens` present (and, if `create`, added)."""
        parent = -1
        count = 0
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            key = (parent, tuple(tokens[start : start + self.block_size]))
            block_id = self._block_ids.get(key)
            if block_id is None:
                if not create:
                    return count
                block_id = len(self._block_ids)
                self._block_ids[key] = block_id
            parent = block_id
            count += 1
        return count

    def lookup(self, prompt: Sequence[Token]) -> int:
        """Hit tokens for `prompt`: leading cached full blocks, never the last prompt token."""
        if len(prompt) <= 1:
            return 0
        max_blocks = (len(prompt) - 1) // self.block_size
        return min(self._chain(prompt, create=False), max_blocks) * self.block_size

    def insert(self, prompt: Sequence[Token], reply: Sequence[Token]) -> None:
        """Cache what a finished request computed: prompt + reply without its last token."""
        computed = list(prompt) + list(reply[:-1])
        self._chain(computed, create=True)


def ceiling_of_requests(requests: Iterable[tuple[Sequence[Token], Sequence[Token]]], block_size: int) -> Ceiling:
    """The ceiling of `(prompt, reply)` pairs served in the given order by an infinite cache."""
    cache = InfiniteCache(block_size)
    prompt_tokens = hit_tokens = 0
    for prompt, reply in requests:
        prompt_tokens += len(prompt)
        hit_tokens += cache.lookup(prompt)
        cache.insert(prompt, reply)
    return Ceiling(prompt_tokens, hit_tokens)


def render_words(messages: list[dict]) -> list[Token]:
    """A neutral chat template over words: `<role>` words `</s>` per message, then `<assistant>`.

    It is the workload's own token model when the replica's tokenizer is unknown; the
    generation prompt `<assistant>` is what the next turn's assistant message starts
    with, so consecutive prompts share their prefix as with real chat templates.
    """
    tokens: list[Token] = []
    for message in messages:
        tokens.append(f"<{message['role']}>")
        tokens.extend(message["content"].split())
        tokens.append("</s>")
    tokens.append("<assistant>")
    return tokens


@dataclass(frozen=True)
class TokenModel:
    """How prompts become tokens: `render(messages)` for a chat prompt, `encode(text)` for a reply."""

    name: str
    render: Renderer
    encode: Callable[[str], Sequence[Token]]


WORDS = TokenModel("words", render_words, str.split)


def simulator_token_model() -> TokenModel | None:
    """The simulated replica's own tokenizer and chat template, when the simulator is installed.

    With it the ceiling is exact for simulated replicas; for other servers the words
    model is a close estimate (one token per short word).
    """
    try:
        from kvgate.simulator import tokenizer
    except ImportError:
        return None
    return TokenModel("simulator", lambda messages: tokenizer.render_chat({"messages": messages}), tokenizer.encode)


def placeholder_reply(length: int) -> str:
    """A reply of `length` one-token words, standing in for the server's reply.

    Its content does not matter to the ceiling: blocks are keyed by their whole prefix,
    so identical replies in different sessions never collide.
    """
    return " ".join(["ok"] * length)


def workload_requests(workload: Workload, model: TokenModel = WORDS, reply_length: int | None = None):
    """Yield `(prompt_tokens, reply_tokens)` for every turn, thread by thread (a session's
    main thread, then its subagents').

    The reply of a turn counts `reply_length` tokens (default: the turn's max_tokens,
    which the replicas honour as the reply length). Session order suffices: sessions
    share only the system prompt, which an infinite cache holds after its first use
    whatever the interleaving.
    """
    for thread in workload.threads:
        replies: list[str] = []
        for turn in thread.turns:
            prompt = model.render(build_messages(thread, replies, turn.index))
            reply = placeholder_reply(workload.reply_tokens(turn) if reply_length is None else reply_length)
            yield prompt, model.encode(reply)
            replies.append(reply)


def workload_ceiling(workload: Workload, block_size: int, model: TokenModel = WORDS) -> Ceiling:
    """The hit rate an infinite cache would reach on `workload` (see the module docstring)."""
    return ceiling_of_requests(workload_requests(workload, model), block_size)
