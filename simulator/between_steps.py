"""Probe answers given between two engine steps, as vLLM's engine core gives them.

The plugin's probes (kv usage, prefix, pin release) are utility calls into vLLM's engine
core, which runs them between scheduler steps: a probe that arrives while a step runs
is answered once that step has ended (its tokens sampled, its finished requests freed)
and before the next one is scheduled, so under load it waits about one step
(docs/decisions/probes-as-engine-utility-calls.md). Both simulated engines (in real time
and in virtual time) queue their probes here while a step runs and answer them at its end.

Invariant: an answer is computed at a step boundary, on the engine's event loop, by the
engine calling `answer_all`; a caller that gave up (its future cancelled) is skipped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class BetweenSteps:
    """The probes waiting for the engine step in progress to end."""

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        self._waiting: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    async def wait(self, compute: Callable[[], T]) -> T:
        """`compute()`, run at the end of the step in progress (`answer_all`)."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiting.append((compute, future))
        return await future

    def answer_all(self) -> None:
        """A step has ended: answer every waiting probe, in the order they came."""
        waiting, self._waiting = self._waiting, []
        for compute, future in waiting:
            if future.done():
                continue
            try:
                future.set_result(compute())
            except Exception as error:  # the probe's own error (e.g. a stopped engine), for its caller
                future.set_exception(error)

    def fail_all(self, error: Exception) -> None:
        """The engine stops: no step will end; every waiting probe fails with `error`."""
        waiting, self._waiting = self._waiting, []
        for _, future in waiting:
            if not future.done():
                future.set_exception(error)
