"""One simulated vLLM engine in virtual time, driven by event-loop timers.

The scheduler, KV cache manager and block pool are the engine model's (the same code
the simulated replica runs); this module only moves them through time, as
`AsyncEngine` does in real time:

- a step begins when work exists: `schedule()`, then it lasts the cost model's step
  time x `time_scale`; at its end `update_from_output()` samples tokens, and the next
  step begins at once. Requests added while a step runs join the next one; an idle
  engine begins a step once the callbacks ready at that instant have run (so turns
  arriving together share it).
- stable decode-only stretches (`simulator.decode_jump`) are taken as one timer: the
  steps' durations are summed one by one (the same floats as stepping), the state is
  jumped at the stretch's end. Anything that looks inside the engine during a stretch
  (a probe, a new request) first settles it: the steps that ended are jumped, the
  one in progress is scheduled for real, exactly the state stepping would show then.
- `StepMeter` observes every step (jumped ones too), so the probe API's measured
  decode step, prefill throughput and prefill share are the simulated replica's.

Probes come through `between_steps`, as vLLM answers them: while a step runs, at its end,
before the next one is scheduled (`simulator.between_steps`; a decode stretch is settled
first, so the step in progress is a real one).

KV pins (`kvgate.wire.kv_pins`): a request whose `pin` is set pins its session's blocks
when it finishes; pins end on `release_pins`, at their ttl (checked by every step and
probe: a decode stretch allocates only free blocks, so a pin that expires inside one
changes nothing before the stretch ends) or by yielding to a request that needs blocks.

Invariant: the state any caller sees at virtual time t equals the per-step engine's
state at t (tests/bench/test_cluster_sim.py runs whole clusters both ways).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import TypeVar

from kvgate.simulator.async_engine import engine_kv_answer
from kvgate.simulator.between_steps import BetweenSteps
from kvgate.simulator.config import CostModel, EngineConfig
from kvgate.simulator.decode_jump import decode_context_tokens, jump_decode_steps, stable_decode_steps
from kvgate.simulator.request import SimRequest
from kvgate.simulator.scheduler import Scheduler, SchedulerOutput
from kvgate.simulator.step_meter import StepMeter
from kvgate.wire.kv_pins import ReleaseAnswer
from kvgate.wire.probe_api import KvAnswer, PrefixAnswer

T = TypeVar("T")

MAX_JUMP_STEPS = 4096  # a stretch longer than this is taken in several jumps (bounds the plan's size)


class EngineStopped(Exception):
    """The engine was stopped (its replica failed or was removed) while the request ran."""


class Turn:
    """One request's progress: `first_token_at` (virtual seconds) and `done` (a future
    resolved with the finish time, or failed with EngineStopped)."""

    __slots__ = ("request", "first_token_at", "done")

    def __init__(self, request: SimRequest, done: asyncio.Future[float]) -> None:
        self.request = request
        self.first_token_at: float | None = None
        self.done = done


def _next_token(request: SimRequest) -> int:
    return 0  # content is irrelevant to a SessionRequest (its blocks are keyed by position)


class SimEngine:
    def __init__(
        self,
        name: str,
        config: EngineConfig,
        cost_model: CostModel,
        time_scale: float = 1.0,
        jump: bool = True,
        next_token: Callable[[SimRequest], int] = _next_token,
    ) -> None:
        self.name = name
        self.config = config.validate()
        self.cost_model = cost_model.validate()
        self.time_scale = time_scale
        self.jump = jump
        self.scheduler = Scheduler(config)
        self.meter = StepMeter()
        self.busy_sec = 0.0
        self.stopped = False
        self._next_token = next_token
        self._loop = asyncio.get_running_loop()
        self._turns: dict[str, Turn] = {}
        self._arrivals = itertools.count()  # requests' places in the order they came (priority ties)
        self._kick: asyncio.Handle | None = None  # a step begins once the ready callbacks ran
        self._timer: asyncio.TimerHandle | None = None
        self._output: SchedulerOutput | None = None  # the step in progress (scheduled, not updated)
        self._step_began = 0.0
        self._step_sec = 0.0
        self._stretch: tuple[float, list[float], list[float]] | None = None  # (began, step ends, step seconds)
        self._answer: KvAnswer | None = None  # the last kv answer, and the figures it was made of
        self._answer_key: tuple = ()
        self._probes = BetweenSteps()

    # ------------------------------------------------------------------ requests

    def add(self, request: SimRequest) -> Turn:
        """Queue `request`; its Turn's `done` fails with ValueError if it can never fit. Its
        arrival becomes its place in the order requests came (as `AsyncEngine.add` gives it):
        under priority scheduling, equal priorities are served oldest first, and a
        preemption takes the newest."""
        done: asyncio.Future[float] = self._loop.create_future()
        turn = Turn(request, done)
        if self.stopped:
            done.set_exception(EngineStopped(f"replica {self.name} is gone"))
            return turn
        self.settle()
        request.arrival = float(next(self._arrivals))
        if not self.scheduler.add_request(request):
            done.set_exception(
                ValueError(
                    f"request of {request.num_prompt_tokens} prompt + {request.max_tokens} output tokens can "
                    f"never fit the KV cache of {self.config.cache_tokens} tokens"
                )
            )
            return turn
        self._turns[request.request_id] = turn
        if self._timer is None and self._kick is None:
            self._kick = self._loop.call_soon(self._begin)
        return turn

    def stop(self) -> None:
        """The replica is gone: every request fails with EngineStopped, nothing runs any more."""
        self.stopped = True
        for handle in (self._timer, self._kick):
            if handle is not None:
                handle.cancel()
        self._timer = self._kick = None
        self._stretch = self._output = None
        self._probes.fail_all(EngineStopped(f"replica {self.name} is gone"))
        turns, self._turns = self._turns, {}
        for turn in turns.values():
            if not turn.done.done():
                turn.done.set_exception(EngineStopped(f"replica {self.name} stopped while the request ran"))

    # --------------------------------------------------------------------- probes

    async def between_steps(self, probe: Callable[[], T]) -> T:
        """`probe()` (e.g. `self.kv_answer`) answered as vLLM's engine core answers a utility
        call: at once while no step runs, else at the end of the step in progress; fails
        with EngineStopped if the engine stops first."""
        if self.stopped:
            raise EngineStopped(f"replica {self.name} is gone")
        self.settle()
        if self._stretch is not None:  # a stretch that began at this instant: its first step is the one in progress
            self.settle()
        if self._output is None or self._step_sec <= 0:
            return probe()
        return await self._probes.wait(probe)

    def kv_answer(self) -> KvAnswer:
        """The kv probe's answer, as the simulated replica gives it: the same object while
        nothing it reads has changed (the waiters a release wakes all probe at one instant)."""
        self.settle()
        scheduler, meter = self.scheduler, self.meter
        pool = scheduler.kv_cache_manager.block_pool
        pins = scheduler.kv_cache_manager.pins
        now = self._loop.time()
        scheduler.kv_cache_manager.expire_pins(now)  # pins end at their ttl, stepping or not
        key = (
            now,
            meter.observations,
            pool.free_block_queue.num_free_blocks,
            len(pool.cached_block_hash_to_block),
            len(scheduler.running),
            len(scheduler.waiting),
            pins.num_pinned_blocks,
            pins.num_pinned_sessions,
            pins.num_yields,
            scheduler.kv_cache_manager.cpu_tier and scheduler.kv_cache_manager.cpu_tier.num_held,
        )
        if key != self._answer_key or self._answer is None:
            load = self.cost_model.cpu_load_block_s * self.time_scale
            self._answer, self._answer_key = engine_kv_answer(scheduler, meter, now, load), key
        return self._answer

    def prefix_answer(self, request: SimRequest) -> PrefixAnswer:
        """The prefix probe's answer for `request`'s prompt: no side effects."""
        self.settle()
        manager = self.scheduler.kv_cache_manager
        manager.expire_pins(self._loop.time())
        return manager.prefix_answer(request.block_hashes, request.num_prompt_tokens)

    def release_pins(self, sessions: tuple[str, ...]) -> ReleaseAnswer:
        """End the KV pins of `sessions` (the replica's `POST /v1/kvgate/release`)."""
        self.settle()
        return ReleaseAnswer(*self.scheduler.kv_cache_manager.release_pins(sessions))

    # ----------------------------------------------------------------- stepping

    def settle(self) -> None:
        """Bring a decode stretch in progress up to now (see the module docstring)."""
        if self._stretch is None:
            return
        began, ends, seconds = self._stretch
        now = self._loop.time()
        done = 0
        while done < len(ends) and ends[done] <= now:
            done += 1
        self._stretch = None
        assert self._timer is not None
        self._timer.cancel()
        self._timer = None
        self._jump(done, seconds, ends)
        if done == len(ends):
            self._begin()
            return
        # the step in progress began at the last jumped step's end: schedule it for real
        self._schedule_step(ends[done - 1] if done else began)

    def _begin(self) -> None:
        self._kick = None
        if self.stopped or not self.scheduler.has_unfinished_requests():
            return
        now = self._loop.time()
        steps = stable_decode_steps(self.scheduler, MAX_JUMP_STEPS) if self.jump else 0
        if steps >= 2:
            self._plan_stretch(now, steps)
        else:
            self._schedule_step(now)

    def _schedule_step(self, began: float) -> None:
        output = self.scheduler.schedule(began)
        seconds = self._seconds(
            output.num_prefill_tokens, output.num_decode_seqs, output.num_context_tokens, output.num_loaded_blocks
        )
        self._output, self._step_began, self._step_sec = output, began, seconds
        self._timer = self._loop.call_at(began + seconds, self._end_step)

    def _seconds(self, prefill: int, decode: int, context: int, loaded: int = 0) -> float:
        return self.cost_model.step_seconds(prefill, decode, context, loaded) * self.time_scale

    def _end_step(self) -> None:
        self._timer = None
        output, self._output = self._output, None
        assert output is not None
        now = self._step_began + self._step_sec
        load = self.cost_model.cpu_load_block_s * output.num_loaded_blocks * self.time_scale
        self.meter.observe(output.num_prefill_tokens, output.num_decode_seqs, self._step_sec, now, load)
        self.busy_sec += self._step_sec
        finished = self.scheduler.update_from_output(output, self._next_token, now)
        turns = self._turns
        step = self.scheduler.step_index - 1
        for request, _ in output.scheduled:
            if request.first_token_step == step:  # its first token came out of this step
                turn = turns.get(request.request_id)
                if turn is not None and turn.first_token_at is None:
                    turn.first_token_at = now
        for request in finished:
            turn = turns.pop(request.request_id, None)
            if turn is not None and not turn.done.done():
                if turn.first_token_at is None:
                    turn.first_token_at = now
                turn.done.set_result(now)
        self._probes.answer_all()
        self._begin()

    def _plan_stretch(self, began: float, steps: int) -> None:
        decoders = len(self.scheduler.running)
        context = decode_context_tokens(self.scheduler)
        ends, seconds = [], []
        at = began
        for _ in range(steps):
            step = self._seconds(0, decoders, context)
            at = at + step  # the same sum, in the same order, as stepping
            ends.append(at)
            seconds.append(step)
            context += decoders
        self._stretch = (began, ends, seconds)
        self._timer = self._loop.call_at(ends[-1], self._end_stretch)

    def _end_stretch(self) -> None:
        assert self._stretch is not None
        _, ends, seconds = self._stretch
        self._stretch = None
        self._timer = None
        self._jump(len(ends), seconds, ends)
        self._begin()

    def _jump(self, steps: int, seconds: list[float], ends: list[float]) -> None:
        """Jump the first `steps` steps of the planned stretch (their meter readings included)."""
        if steps == 0:
            return
        decoders = len(self.scheduler.running)
        for step, end in zip(seconds[:steps], ends[:steps], strict=True):
            self.meter.observe(0, decoders, step, end)
            self.busy_sec += step
        jump_decode_steps(self.scheduler, steps, self._next_token)
