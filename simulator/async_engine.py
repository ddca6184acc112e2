"""The engine model in real time: the scheduler's step loop as an asyncio task.

Each step: schedule, wait the cost model's step time x `time_scale` (minus the time
the step's own bookkeeping took; time_scale 0 still yields to the event loop once per
step), then sample one token for every request whose known tokens are computed and wake
its reader. The loop sleeps on an event when there is no work.

Probes (`kv_answer`, `prefix_answer`, `release_pins`) come through `between_steps`, as
vLLM runs them: while a step runs they wait for its end (`simulator.between_steps`).

Invariant: the scheduler is only touched from the event loop thread, between awaits,
so probes see a consistent state and change nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import TypeVar

from kvgate.simulator.admission_policies import AdmissionPolicy, naive
from kvgate.simulator.between_steps import BetweenSteps
from kvgate.simulator.config import CostModel, EngineConfig
from kvgate.simulator.request import RequestStatus, SimRequest, compute_block_hashes
from kvgate.simulator.scheduler import Scheduler
from kvgate.simulator.step_meter import StepMeter
from kvgate.simulator.tokenizer import output_token
from kvgate.wire.kv_pins import Pin, ReleaseAnswer
from kvgate.wire.probe_api import KvAnswer, PrefixAnswer

T = TypeVar("T")

log = logging.getLogger(__name__)


class RequestHandle:
    """A reader's view of one request: new tokens appear in `request.output_token_ids`;
    `changed` is set after every step that added a token or finished the request."""

    __slots__ = ("request", "changed", "finish_reason")

    def __init__(self, request: SimRequest) -> None:
        self.request = request
        self.changed = asyncio.Event()
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def final_reason(self) -> str:
        """Why the request finished ("length", "abort"): read only once it has."""
        reason = self.finish_reason
        assert reason is not None, "the request has not finished"
        return reason


def _next_token(request: SimRequest) -> int:
    return output_token(request.num_tokens)


def engine_kv_answer(
    scheduler: Scheduler, meter: StepMeter, now: float | None = None, cpu_load_sec_per_block: float | None = None
) -> KvAnswer:
    """An engine's KV usage as the probe API answers it, its measurements as of `now` (the
    engine's clock). The pool counts usable blocks; vLLM's `num_gpu_blocks` has one more, its
    null block, and so does this answer. With a CPU tier, its capacity, the blocks it holds
    and `cpu_load_sec_per_block` (the engine's seconds to load one) fill the plugin's fields."""
    pool = scheduler.kv_cache_manager.block_pool
    pins = scheduler.kv_cache_manager.pins
    tier = scheduler.kv_cache_manager.cpu_tier
    measured = meter.reading(now)
    rate = measured["prefill_tokens_per_sec"]
    return KvAnswer.of_engine(
        num_gpu_blocks=pool.num_blocks + 1,
        num_free_blocks=pool.get_num_free_blocks(),
        num_cached_blocks=len(pool.cached_block_hash_to_block),
        block_size=scheduler.kv_cache_manager.block_size,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_pinned_blocks=pins.num_pinned_blocks,
        num_pinned_sessions=pins.num_pinned_sessions,
        num_pin_yields=pins.num_yields,
        num_cpu_blocks=None if tier is None else tier.capacity,
        num_cpu_cached_blocks=None if tier is None else tier.num_held,
        cpu_load_sec_per_block=None if tier is None else cpu_load_sec_per_block or None,
        **measured,
        token_sec=1.0 / rate if rate else None,  # the meter's prefill cost per token
    )


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig = EngineConfig(),
        cost_model: CostModel = CostModel(),
        time_scale: float = 1.0,
        policy: AdmissionPolicy = naive,
    ) -> None:
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0 (got {time_scale})")
        self.config = config.validate()
        self.cost_model = cost_model.validate()
        self.time_scale = time_scale
        self.scheduler = Scheduler(config, policy)
        self._handles: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.meter = StepMeter()
        self._stepping = False  # a step is scheduled and has not ended
        self._probes = BetweenSteps()

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-sim-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._answer_probes()  # no step runs any more
        for request_id in list(self._handles):
            self.abort(request_id)

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        cache_salt: str | None = None,
        priority: int = 0,
        pin: Pin | None = None,
    ) -> RequestHandle:
        """Queue a request. Raises ValueError if it can never fit the cache (the HTTP
        layer checks max_model_len first, which the config keeps within the cache).
        `priority` orders it under priority scheduling (lower first); its arrival is its
        place in the order requests came. `pin` (already checked against the replica key):
        when it finishes, its session pins its blocks (`kvgate.wire.kv_pins`)."""
        sequence = next(self._ids)
        request = SimRequest(
            f"req-{sequence}",
            prompt_token_ids,
            max_tokens,
            self.config.block_size,
            cache_salt,
            arrival=float(sequence),
            priority=priority,
        )
        request.pin = (pin.session, pin.ttl_sec) if pin is not None else None
        if not self.scheduler.add_request(request):
            raise ValueError(
                f"request of {len(prompt_token_ids)} prompt + {max_tokens} output tokens can never fit the "
                f"KV cache of {self.config.cache_tokens} tokens"
            )
        handle = RequestHandle(request)
        self._handles[request.request_id] = handle
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> None:
        """Drop a request (client gone): frees its blocks now. Unknown or finished ids are a no-op."""
        handle = self._handles.pop(request_id, None)
        if handle is None:
            return
        self.scheduler.abort_request(request_id)
        handle.finish_reason = "abort"
        handle.changed.set()

    # -- probes (no side effects) --------------------------------------------------------

    async def between_steps(self, probe: Callable[[], T]) -> T:
        """`probe()` (e.g. `self.kv_answer`) answered as vLLM's engine core answers a utility
        call: at once while no step runs, else at the end of the step in progress."""
        if not self._stepping:
            return probe()
        return await self._probes.wait(probe)

    def kv_answer(self) -> KvAnswer:
        now = asyncio.get_running_loop().time()
        self.scheduler.kv_cache_manager.expire_pins(now)  # pins end at their ttl, stepping or not
        return engine_kv_answer(self.scheduler, self.meter, now, self.cost_model.cpu_load_block_s * self.time_scale)

    def prefix_answer(self, token_ids: list[int], cache_salt: str | None = None) -> PrefixAnswer:
        self.scheduler.kv_cache_manager.expire_pins(asyncio.get_running_loop().time())
        hashes = compute_block_hashes(token_ids, self.config.block_size, cache_salt)
        return self.scheduler.kv_cache_manager.prefix_answer(hashes, len(token_ids))

    def release_pins(self, sessions: tuple[str, ...]) -> ReleaseAnswer:
        """End the pins of `sessions` (`POST /v1/kvgate/release`)."""
        return ReleaseAnswer(*self.scheduler.kv_cache_manager.release_pins(sessions))

    # -- the step loop ---------------------------------------------------------------------

    def _answer_probes(self) -> None:
        """No step runs now (one ended, or the loop stopped): answer the probes waiting for it."""
        self._stepping = False
        self._probes.answer_all()

    async def _run(self) -> None:
        try:
            await self._step_loop()
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug in the model must not leave readers hanging: end every request.
            log.exception("simulated engine step loop failed; aborting all requests")
            self._answer_probes()
            for request_id in list(self._handles):
                self.abort(request_id)
            raise

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        scheduler = self.scheduler
        while True:
            if not scheduler.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            started = loop.time()
            output = scheduler.schedule(started)
            self._stepping = True
            step_seconds = self.cost_model.step_seconds(
                output.num_prefill_tokens, output.num_decode_seqs, output.num_context_tokens, output.num_loaded_blocks
            )
            delay = step_seconds * self.time_scale - (loop.time() - started)
            await asyncio.sleep(delay if delay > 0 else 0)
            ended = loop.time()
            load = self.cost_model.cpu_load_block_s * output.num_loaded_blocks * self.time_scale
            self.meter.observe(output.num_prefill_tokens, output.num_decode_seqs, ended - started, ended, load)
            finished = scheduler.update_from_output(output, _next_token, ended)
            handles = self._handles
            for request, _ in output.scheduled:
                handle = handles.get(request.request_id)
                if handle is not None and request.status == RequestStatus.RUNNING:
                    handle.changed.set()
            for request in finished:
                handle = handles.pop(request.request_id, None)
                if handle is not None:
                    handle.finish_reason = "length"
                    handle.changed.set()
            self._answer_probes()
