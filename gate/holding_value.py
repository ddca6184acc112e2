"""What holding a newcomer keeps of its own prefix on one replica, measured from its turns.

The work-conserving rule (`gate.policies.economics`) weighs, against the compute holding
a turn leaves unused, the re-prefill its admission without a window causes, and that
counts the turn's own prefix: admitted without a window, its blocks are unpinned when it
ends, and its next turn may compute them again; held until a window fits, it keeps them.
How much of the own prefix holding really keeps depends on the replica:

- `kept_without_window`: the share of a session's previous prompt its next turn found
  resident when that previous turn went in without a window. Near 0 where the engine's
  LRU cycles through more than its cache holds (every unpinned prefix is gone by the
  next turn); well above 0 where the free cache keeps most sessions' prefixes across
  their tool calls anyway (many sessions whose gaps vary: the fleet).
- `kept_with_window`: the same, for a previous turn admitted with a window.
- `held_got_window`: the share of held newcomers admitted with a window in the end; the
  rest waited and went in without one, which kept nothing, and pushed out the windows'
  blocks that their admission would have pushed out at once (the rule counts those
  blocks at this share: `economics.at_risk_blocks`). A newcomer the policy lets in
  without a window while others wait ahead of it is not counted (the shell's
  `_observe_held`): it left before its turn at a window came, so its admission says
  nothing of what waiting gives, and counting it made a loop (fewer windows measured,
  a smaller own share, more turns let in without one).

- `engine_lost`: the share of a probed prefix (resident when the turn was admitted) the
  engine no longer held when it ran the turn: where the engine's queue evicts admitted
  turns' prefixes, what unqueued turns kept understates what admitting one costs.

`own_share()` = held_got_window x (kept_with_window - kept_without_window), or
`engine_lost` if larger, in [0, 1]: the expected share of a held turn's own prefix that
holding it keeps for its next turn. Each share starts at what the rule assumed before it
was measured (the whole prefix counts; the engine loses nothing) and moves toward each
observation by HOLDING_VALUE_ALPHA, so a few turns before the cache fills do not
outweigh it.

Invariants: every share stays in [0, 1], so `own_share()` does. Pure: no clock, no I/O;
one instance per replica's gate (`SessionBook.holding`).
"""

from __future__ import annotations

from dataclasses import dataclass

# How far each observation moves a share: about the last 20 observations weigh.
HOLDING_VALUE_ALPHA = 0.05


def _smooth(last: float, value: float) -> float:
    return last + HOLDING_VALUE_ALPHA * (min(1.0, max(0.0, value)) - last)


def kept_share(
    previous_tokens: int | None, prompt_tokens: int, hit_tokens: int, block_size: int | None
) -> float | None:
    """The share of the full blocks this prompt (`prompt_tokens`) shares with the session's
    previous prompt (`previous_tokens`) that the replica still held (`hit_tokens` were
    hit); None without a previous prompt, a block size or a full block shared."""
    if not previous_tokens or not block_size or prompt_tokens <= 0:
        return None
    shared_blocks = min(previous_tokens, prompt_tokens) // block_size
    if shared_blocks <= 0:
        return None
    return min(1.0, max(0, hit_tokens) // block_size / shared_blocks)


@dataclass(slots=True)
class HoldingValue:
    """The replica's measured value of holding a newcomer for its own prefix (module docstring)."""

    kept_with_window: float = 1.0
    kept_without_window: float = 0.0
    held_got_window: float = 1.0
    engine_lost: float = 0.0

    def observe_engine(self, probed_hit_blocks: int, hit_blocks: int) -> None:
        """A turn admitted on a prefix reading that found `probed_hit_blocks` resident was
        served with `hit_blocks` hit: the engine lost the rest before it ran the turn."""
        if probed_hit_blocks > 0:
            self.engine_lost = _smooth(self.engine_lost, max(0, probed_hit_blocks - hit_blocks) / probed_hit_blocks)

    def observe_next_turn(self, previous_window: bool, kept: float) -> None:
        """A turn found `kept` of its session's previous prompt resident; that previous turn
        was admitted with a window (`previous_window`) or without one."""
        if previous_window:
            self.kept_with_window = _smooth(self.kept_with_window, kept)
        else:
            self.kept_without_window = _smooth(self.kept_without_window, kept)

    def observe_held(self, got_window: bool) -> None:
        """A newcomer the policy held was admitted, with a window or without one."""
        self.held_got_window = _smooth(self.held_got_window, 1.0 if got_window else 0.0)

    def own_share(self) -> float:
        """The share of a held turn's own prefix that holding it keeps (module docstring)."""
        kept = self.held_got_window * max(0.0, self.kept_with_window - self.kept_without_window)
        return max(self.engine_lost, kept)

    def state(self) -> dict[str, float]:
        """The shares, for /admin/state."""
        return {
            "kept_with_window": round(self.kept_with_window, 4),
            "kept_without_window": round(self.kept_without_window, 4),
            "held_got_window": round(self.held_got_window, 4),
            "engine_lost": round(self.engine_lost, 4),
            "own_share": round(self.own_share(), 4),
        }
