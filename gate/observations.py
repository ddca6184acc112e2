"""Pure estimates the gate reports to operators (docs/observability.md); no I/O, no clock.

`reprefill_tokens`: how many prompt tokens a turn prefills again because the blocks
its session's previous turn computed were evicted. The previous turn's full blocks
were in the replica's prefix cache when it ran (vLLM caches full blocks only); the
ones of them the prefix probe no longer finds resident must be computed again.
"""

from __future__ import annotations


def reprefill_tokens(
    previous_prompt_tokens: int | None, prompt_tokens: int, hit_blocks: int, block_size: int | None
) -> int:
    """Tokens of the session's previous prompt that this turn prefills again.

    previous_prompt_tokens: the prompt size of the session's last turn on this replica
    that the gate measured (None: no history, nothing can be re-prefilled).
    prompt_tokens, hit_blocks: this turn's prefix reading (prompt size, resident full
    blocks). block_size: the replica's (None or 0: unknown, no estimate).

    Invariant: 0 <= result <= min(previous, current prompt) rounded down to full blocks;
    a turn whose earlier prefix is fully resident re-prefills 0.
    """
    if not previous_prompt_tokens or not block_size or prompt_tokens <= 0:
        return 0
    shared_blocks = min(previous_prompt_tokens, prompt_tokens) // block_size
    return max(0, shared_blocks - hit_blocks) * block_size
