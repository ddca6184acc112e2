"""The least makespan any policy could serve a run's turns in: a bound from the engines' step costs.

Every admission, retention and placement policy serves the same turns on the same replicas,
and each replica runs one engine step at a time, priced by its cost model
(`CostModel.step_seconds` x `time_scale`). Two relaxations of that, each a lower bound on
the makespan of every policy:

- `work_s`: the replicas' step time, pooled. A sequence decodes one token per step, and the
  sequences that decode in one step hold their whole contexts in that replica's cache
  together, so the steps number at least (the sum over decoded tokens of the context they
  decode at) / (the cache's tokens); each costs at least the step overhead. Besides, the
  steps compute at least the prompt tokens no cache could hit (`prompt - ceiling`), one
  decode per output token after the first, and read the contexts they decode at. Whatever
  is kept or evicted, and whenever turns run, the replicas cannot do this work in less time.
- `chain_s`: a session's turns run one after another, with its tool calls between them:
  its turns' own least time (a step per output token, the first one also computing the
  prompt tokens no cache could hit) plus its tool calls. The longest session's.

The bound is the larger one. It counts no prefill chunking, no preemption, no re-prefill
and no imbalance between replicas, so a policy may never reach it; no policy goes below it.
Pure functions of the run's turn records and its engines' configuration.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvgate.bench.cluster.run import TurnRecord, session_turns, tool_call_s
from kvgate.simulator.config import CostModel
from kvgate.simulator.virtual_engine import SimEngine


@dataclass(frozen=True, slots=True)
class StepPrice:
    """The least an engine step costs, in seconds (time scale applied), and the tokens the
    largest replica's cache holds; over several replicas, the cheapest and the largest."""

    overhead_s: float
    prefill_token_s: float
    decode_seq_s: float
    context_token_s: float
    cache_tokens: int
    replicas: int

    @classmethod
    def of_engines(cls, engines: Iterable[tuple[CostModel, float, int]]) -> StepPrice:
        """From each replica's (cost model, time scale, cache tokens)."""
        engines = list(engines)
        if not engines:
            raise ValueError("a makespan bound needs at least one replica")

        def least(field: str) -> float:
            return min(getattr(model, field) * scale for model, scale, _ in engines)

        return cls(
            overhead_s=least("step_overhead_s"),
            prefill_token_s=least("prefill_token_s"),
            decode_seq_s=least("decode_seq_s"),
            context_token_s=least("context_token_s"),
            cache_tokens=max(tokens for _, _, tokens in engines),
            replicas=len(engines),
        )


def _decoded_context_tokens(turn: TurnRecord) -> int:
    """The contexts a turn's decode steps run at: one step per output token after the first
    (which its prefill step samples), at prompt + j tokens for the j-th."""
    later = max(0, turn.output_tokens - 1)
    return later * turn.prompt_tokens + later * (later + 1) // 2


def _uncacheable_tokens(turn: TurnRecord) -> int:
    """The prompt tokens no cache could have kept for this turn: computed by every policy."""
    return max(0, turn.prompt_tokens - turn.ceiling_tokens)


def work_bound_s(turns: list[TurnRecord], price: StepPrice) -> float:
    """`work_s` of the module docstring, for the completed `turns`."""
    contexts = sum(_decoded_context_tokens(t) for t in turns)
    steps = contexts / price.cache_tokens
    work = (
        price.overhead_s * steps
        + price.prefill_token_s * sum(_uncacheable_tokens(t) for t in turns)
        + price.decode_seq_s * sum(max(0, t.output_tokens - 1) for t in turns)
        + price.context_token_s * contexts
    )
    return work / price.replicas


def chain_bound_s(turns: list[TurnRecord], price: StepPrice) -> float:
    """`chain_s` of the module docstring: the longest session's own turns and tool calls.
    A tool call is the time from a turn's end to its session's next turn (`tool_call_s`); a
    session's chain stops at a turn that failed."""
    longest = 0.0
    for records in session_turns(turns):
        chain, before = 0.0, None
        for turn in records:
            if not turn.ok:
                break
            if before is not None:
                chain += tool_call_s(before, turn)
            chain += price.overhead_s * max(1, turn.output_tokens) + price.prefill_token_s * _uncacheable_tokens(turn)
            before = turn
        longest = max(longest, chain)
    return longest


def makespan_bound(turns: list[TurnRecord], engines: Iterable[SimEngine]) -> dict:
    """{"work_s", "chain_s"} of a run's turns on its engines (its completed turns count in `work_s`)."""
    price = StepPrice.of_engines(
        (engine.cost_model, engine.time_scale, engine.config.num_blocks * engine.config.block_size)
        for engine in engines
    )
    ok = [t for t in turns if t.ok]
    return {"work_s": round(work_bound_s(ok, price), 4), "chain_s": round(chain_bound_s(turns, price), 4)}


# What each part of the bound stands for, in a sentence (the cluster table, the results page).
BOUND_PARTS = {
    "work_s": "the replicas' steps, each decoding sequence's whole context in its replica's cache",
    "chain_s": "the longest session's own turns and tool calls, one after another",
}


def least_makespan(summary: dict) -> tuple[float, str] | None:
    """A policy's `makespan_bound_s`: its larger part in seconds and that part's name; None if
    the run served no turn."""
    bound: dict[str, float] = summary.get("makespan_bound_s") or {}
    if not any(bound.values()):
        return None
    part = max(bound, key=lambda name: bound[name])
    return bound[part], part
