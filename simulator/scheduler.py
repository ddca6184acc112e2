"""vLLM v1's scheduler, reduced to what decides KV-cache behaviour.

One step (`schedule`, then `update_from_output` once the step's tokens exist):
1. running requests first, in order, each gets min(remaining known tokens, budget):
   one token when decoding, the next chunk when prefilling (chunked prefill). If its
   blocks do not fit, the newest running request is preempted (blocks freed, computed
   state reset to 0, put back at the head of the waiting queue) until they do, or until
   the request itself was the one preempted;
2. if nothing was preempted, waiting requests in FCFS order while a sequence slot, token
   budget and the admission policy allow; a request reuses its longest prefix-cache hit
   and is allocated its first chunk; a failed allocation stops admission (head of line).
A request whose prompt plus output can never fit the cache is rejected on arrival.

`EngineConfig.scheduling_policy` is vLLM's `--scheduling-policy`. Under "fcfs" the
waiting queue is arrival order, a preempted request goes back to its head, and the
victim of a preemption is the newest running request. Under "priority" the waiting
queue is ordered by (priority, arrival), a preempted request goes back to its place in
that order, and the victim is the running request last in that order (the lowest
priority, the newest among equals; vLLM's `max(running, key=(priority, arrival_time))`),
whose tokens already scheduled in the step are given back to the budget. In both,
a waiting request that does not fit stops admission: it never preempts a running one.

KV pins (`kvgate.wire.kv_pins`): a step first ends the pins whose ttl passed by its
`now`; a finished request whose turn carries a pin (`SimRequest.pin`) pins its session's
blocks before its own references are dropped; the KV cache manager yields pins before
it fails an allocation, so a pin never preempts a request nor keeps one waiting.

The CPU tier (`EngineConfig.cpu_blocks`, vLLM's KV offloading; `kvgate.simulator.cpu_tier`):
an admitted request loads the run of CPU-held blocks right after its GPU hit instead of
computing them: they count as computed (and as cached prompt tokens, as vLLM counts an
external hit), the step that admits it pays `CostModel.cpu_load_block_s` per block
(`SchedulerOutput.num_loaded_blocks`), and the prefix stats count them as `cpu_hits`. A
request that loads nothing offers its GPU-hit blocks to the tier; a finished request
renews the recency of the tier's copies of its blocks.

The same code runs in virtual time (the admission experiment, the cluster simulation)
and in real time (the async engine behind the simulated replica). It does no I/O and
reads no clock: callers pass `now` (the engine's clock, seconds) to the steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.simulator.admission_policies import AdmissionPolicy, AdmissionView, naive
from kvgate.simulator.config import EngineConfig
from kvgate.simulator.kv_cache_manager import KVCacheManager
from kvgate.simulator.request import RequestStatus, SimRequest
from kvgate.wire.blocks import cdiv


@dataclass
class SchedulerOutput:
    step: int
    scheduled: list[tuple[SimRequest, int]] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_context_tokens: int = 0  # KV tokens read by attention this step
    num_recomputed_tokens: int = 0
    num_loaded_blocks: int = 0  # blocks loaded from the CPU tier for requests admitted this step
    preempted: list[SimRequest] = field(default_factory=list)
    admitted: list[SimRequest] = field(default_factory=list)
    shadow_decisions: int = 0
    shadow_disagreements: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs


@dataclass
class SchedulerCounters:
    """Monotonic totals; vLLM has the first three, the rest are the simulator's own."""

    num_prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # tokens computed again after a preemption
    num_computed_prefill_tokens: int = 0  # prompt (and resumed) tokens actually computed
    num_finished: int = 0
    num_aborted: int = 0
    num_rejected: int = 0
    num_steps: int = 0
    num_cpu_loaded_blocks: int = 0  # blocks loaded from the CPU tier instead of computed
    shadow_decisions: int = 0
    shadow_disagreements: int = 0


def _priority_order(request: SimRequest) -> tuple[int, float]:
    return request.priority, request.arrival


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        policy: AdmissionPolicy = naive,
        shadow_policy: AdmissionPolicy | None = None,
    ) -> None:
        self.config = config.validate()
        self.block_size = config.block_size
        self.kv_cache_manager = KVCacheManager(config.num_blocks, config.block_size, config.cpu_blocks)
        self.policy = policy
        self.shadow_policy = shadow_policy
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.counters = SchedulerCounters()
        self.step_index = 0
        self.by_priority = config.scheduling_policy == "priority"

    # -- queue management -----------------------------------------------------------------

    def can_ever_fit(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        """The last output token is never computed, so prompt + max_tokens - 1 tokens need KV."""
        return cdiv(num_prompt_tokens + max_tokens - 1, self.block_size) <= self.config.num_blocks

    def add_request(self, request: SimRequest) -> bool:
        """Queue a request; False (and status REJECTED) if it can never fit the cache."""
        if not self.can_ever_fit(request.num_prompt_tokens, request.max_tokens):
            request.status = RequestStatus.REJECTED
            self.counters.num_rejected += 1
            return False
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue(request, front=False)
        return True

    def _enqueue(self, request: SimRequest, front: bool) -> None:
        """Put a request in the waiting queue: under fcfs at the tail (new) or the head
        (preempted); under priority at its place in (priority, arrival) order."""
        if not self.by_priority:
            (self.waiting.appendleft if front else self.waiting.append)(request)
            return
        key = (request.priority, request.arrival)
        for position, queued in enumerate(self.waiting):
            if key < (queued.priority, queued.arrival):
                self.waiting.insert(position, request)
                return
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv_cache_manager.free(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self.counters.num_aborted += 1
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.block_pool.get_num_free_blocks()

    def obligation_blocks(self) -> int:
        """Blocks running requests still need to compute the tokens they already have."""
        manager = self.kv_cache_manager
        size = self.block_size
        total = 0
        for request in self.running:
            total += max(0, cdiv(request.num_tokens, size) - manager.num_held_blocks(request))
        return total

    def obligation_tokens(self) -> int:
        """Known tokens (mostly prompt) of running requests not yet computed."""
        return sum(request.num_tokens - request.num_computed_tokens for request in self.running)

    # -- one step -----------------------------------------------------------------------

    def _preempt(self, request: SimRequest, output: SchedulerOutput) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._enqueue(request, front=True)
        output.preempted.append(request)
        self.counters.num_preemptions += 1

    def _admission_view(self, request: SimRequest, hit_blocks: list) -> AdmissionView:
        evictable_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        return AdmissionView(
            num_total_blocks=self.config.num_blocks,
            num_free_blocks=self.num_free_blocks - evictable_hits,
            uncached_blocks=max(0, cdiv(request.num_tokens, self.block_size) - len(hit_blocks)),
            obligation_blocks=self.obligation_blocks(),
        )

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        config = self.config
        manager = self.kv_cache_manager
        if manager.pins.num_pinned_sessions:
            manager.expire_pins(now)
        output = SchedulerOutput(step=self.step_index)
        token_budget = config.max_num_batched_tokens
        scheduled = output.scheduled

        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            while manager.allocate_slots(request, num_new_tokens) is None:
                if self.by_priority:
                    victim = max(self.running, key=_priority_order)
                    position = self.running.index(victim)
                    del self.running[position]
                    if position < index:  # scheduled earlier in this step: give its tokens back
                        index -= 1
                        slot = next(i for i, (queued, _) in enumerate(scheduled) if queued is victim)
                        token_budget += scheduled.pop(slot)[1]
                else:
                    victim = self.running.pop()
                self._preempt(victim, output)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new_tokens))
                token_budget -= num_new_tokens
                index += 1
                continue
            break  # the request itself was preempted: nothing behind it runs either

        if not output.preempted:
            while self.waiting and token_budget > 0 and len(self.running) < config.max_num_seqs:
                request = self.waiting[0]
                hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
                num_loaded = manager.cpu_run(request, len(hit_blocks))
                num_loaded_tokens = num_loaded * self.block_size
                num_new_tokens = min(request.num_tokens - num_hit_tokens - num_loaded_tokens, token_budget)
                view = None
                if self.shadow_policy is not None:
                    view = self._admission_view(request, hit_blocks)
                    output.shadow_decisions += 1
                    if self.shadow_policy(view) != self.policy(view):
                        output.shadow_disagreements += 1
                # With nothing running, waiting cannot free anything: admit regardless of policy.
                if self.running:
                    view = view or self._admission_view(request, hit_blocks)
                    if not self.policy(view):
                        break
                computed = num_hit_tokens + num_loaded_tokens
                if manager.allocate_slots(request, num_new_tokens, hit_blocks, computed) is None:
                    break
                self.waiting.popleft()
                if manager.cpu_tier is not None:
                    self._load_or_offer(request, len(hit_blocks), num_loaded, output)
                if not request.prefix_stats_recorded or request.num_preemptions:
                    manager.prefix_cache_stats.record(
                        request.num_tokens, num_hit_tokens, request.num_preemptions > 0, num_loaded_tokens
                    )
                if not request.prefix_stats_recorded:
                    request.prefix_stats_recorded = True
                    request.num_cached_prompt_tokens = computed
                    request.admitted_step = self.step_index
                    self.counters.num_prompt_tokens += request.num_prompt_tokens
                request.num_computed_tokens = computed
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                output.admitted.append(request)
                scheduled.append((request, num_new_tokens))
                token_budget -= num_new_tokens

        self._account(output)
        return output

    def _load_or_offer(self, request: SimRequest, num_gpu_hits: int, num_loaded: int, output: SchedulerOutput) -> None:
        """An admitted request's CPU-tier traffic: its loads, counted for the step's cost, or,
        when it loads nothing, its GPU-hit blocks offered to the tier (vLLM's store index
        then starts at block 0: the tier keeps what it holds and stores what it lost)."""
        tier = self.kv_cache_manager.cpu_tier
        assert tier is not None
        if num_loaded:
            output.num_loaded_blocks += num_loaded
            self.counters.num_cpu_loaded_blocks += num_loaded
            tier.num_loaded += num_loaded
        elif num_gpu_hits:
            tier.store(request.block_hashes[:num_gpu_hits])

    def _account(self, output: SchedulerOutput) -> None:
        """Advance computed-token state of every scheduled request and tally the step."""
        for request, num_new in output.scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            if request.num_output_tokens and start == request.num_tokens - 1 and num_new == 1:
                output.num_decode_seqs += 1
            else:
                output.num_prefill_tokens += num_new
            if start < request.max_computed_tokens:
                output.num_recomputed_tokens += min(end, request.max_computed_tokens) - start
            output.num_context_tokens += end
            request.num_computed_tokens = end
            if end > request.max_computed_tokens:
                request.max_computed_tokens = end
        counters = self.counters
        counters.num_recomputed_tokens += output.num_recomputed_tokens
        counters.num_computed_prefill_tokens += output.num_prefill_tokens
        counters.shadow_decisions += output.shadow_decisions
        counters.shadow_disagreements += output.shadow_disagreements

    def update_from_output(
        self, output: SchedulerOutput, next_token: Callable[[SimRequest], int], now: float = 0.0
    ) -> list[SimRequest]:
        """Sample one token for every scheduled request whose known tokens are all computed;
        finish those that reached max_tokens (pinning their blocks when their turn carries a
        pin, as of `now`). Requests aborted meanwhile are skipped."""
        finished = []
        for request, _ in output.scheduled:
            if request.status != RequestStatus.RUNNING or request.num_computed_tokens < request.num_tokens:
                continue
            request.append_output_token(next_token(request))
            self.counters.num_generation_tokens += 1
            if request.first_token_step is None:
                request.first_token_step = self.step_index
            if request.num_output_tokens >= request.max_tokens:
                finished.append(request)
        if finished:
            done = set(id(request) for request in finished)
            self.running = [request for request in self.running if id(request) not in done]
            for request in finished:
                if request.pin is not None:
                    self.kv_cache_manager.pin_finished(request, *request.pin, now)
                self.kv_cache_manager.touch_cpu(request)
                self.kv_cache_manager.free(request)
                request.status = RequestStatus.FINISHED_LENGTH
                request.finish_step = self.step_index
                self.requests.pop(request.request_id, None)
                self.counters.num_finished += 1
        self.step_index += 1
        self.counters.num_steps += 1
        return finished
