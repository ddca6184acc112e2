"""Jumping over decode-only engine steps: what `Scheduler.schedule` + `update_from_output`
would do over several steps, computed at once.

A step is *stable* when nothing waits, every running request is decoding (all its
known tokens but the last sampled one computed, at least one output token), and the
token budget covers one token of each: such a step schedules exactly one token per
running request, in running order, and changes the cache only where a request
crosses a block boundary (one new block from the head of the free queue, or one full
block registered in the prefix cache and stored to the CPU tier). `stable_decode_steps` says how many steps from
now stay stable and finish no request and allocate no more blocks than are free;
`jump_decode_steps` applies that many steps: the same block allocations and
registrations in the same order (step by step, running order within a step), the
same token counts, counters and step index as the step-by-step scheduler. The work
is O(running requests + blocks allocated), not O(steps x running requests).

The per-step scheduler stays the reference: tests/simulator/test_decode_jump.py runs
both on the same scenarios and compares every block table, the free queue, the
prefix cache, the CPU tier and the counters.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgate.simulator.request import RequestStatus, SimRequest
from kvgate.simulator.scheduler import Scheduler

_ALLOCATE, _CACHE = 0, 1  # within one step and request, allocate_slots allocates, then registers


def _is_stable(scheduler: Scheduler) -> bool:
    running = scheduler.running
    if scheduler.waiting or not running or len(running) > scheduler.config.max_num_batched_tokens:
        return False
    size = scheduler.block_size
    cached = scheduler.kv_cache_manager.num_cached_blocks
    for request in running:
        computed = request.num_computed_tokens
        if computed != request.num_tokens - 1 or not request.num_output_tokens:
            return False
        if cached.get(request.request_id, 0) != computed // size:  # registrations caught up (they always are)
            return False
    return True


def _events(scheduler: Scheduler, steps: int) -> list[tuple[int, int, int, int]]:
    """(step, running index, kind, block index) of every allocation and registration in
    the next `steps` stable steps; sorted, the order the per-step scheduler makes them."""
    manager = scheduler.kv_cache_manager
    size = scheduler.block_size
    events = []
    for index, request in enumerate(scheduler.running):
        computed = request.num_computed_tokens
        held = manager.num_held_blocks(request)
        # step j computes token position computed + j: it needs cdiv(computed + j + 1) blocks
        first = held * size - computed
        for step in range(max(0, first), steps, size):
            events.append((step, index, _ALLOCATE, held + (step - first) // size))
        cached = manager.num_cached_blocks.get(request.request_id, 0)
        # and registers the blocks below (computed + j + 1) // size
        first = (cached + 1) * size - computed - 1
        for step in range(max(0, first), steps, size):
            events.append((step, index, _CACHE, cached + (step - first) // size))
    return events


def stable_decode_steps(scheduler: Scheduler, limit: int) -> int:
    """How many of the next steps (at most `limit`) `jump_decode_steps` may take: stable
    steps before the first one that finishes a request or needs more blocks than are
    free (that step, and everything after it, runs step by step). 0 when the next step
    is not stable."""
    if limit <= 0 or not _is_stable(scheduler):
        return 0
    steps = min(limit, min(r.max_tokens - r.num_output_tokens for r in scheduler.running) - 1)
    if steps <= 0:
        return 0
    free = scheduler.num_free_blocks
    allocations = sorted(event for event in _events(scheduler, steps) if event[2] == _ALLOCATE)
    if len(allocations) > free:
        return allocations[free][0]  # the step of the first allocation that would not fit
    return steps


def jump_decode_steps(scheduler: Scheduler, steps: int, next_token: Callable[[SimRequest], int]) -> None:
    """Apply `steps` stable decode steps (at most `stable_decode_steps`) as the per-step
    scheduler would: tokens, blocks, prefix-cache registrations, counters, step index."""
    if steps <= 0:
        return
    running = scheduler.running
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    events = sorted(_events(scheduler, steps))
    tier = manager.cpu_tier  # a registered block is stored to the CPU tier too (write-through)
    for request in running:  # the sampled tokens first: a registration needs its block's hash
        advance = getattr(request, "advance_output", None)
        if advance is not None:
            advance(steps)
        else:
            for _ in range(steps):
                request.append_output_token(next_token(request))
    for _, index, kind, block_index in events:
        request = running[index]
        blocks = manager.req_to_blocks[request.request_id]
        if kind == _ALLOCATE:
            assert len(blocks) == block_index, "jump_decode_steps: block table out of step"
            blocks.extend(pool.get_new_blocks(1))
        else:
            pool.cache_full_block(blocks[block_index], request.block_hashes[block_index])
            if tier is not None:
                tier.store((request.block_hashes[block_index],))
            manager.num_cached_blocks[request.request_id] = block_index + 1
    for request in running:
        assert request.status == RequestStatus.RUNNING
        request.num_computed_tokens += steps
        if request.num_computed_tokens > request.max_computed_tokens:
            request.max_computed_tokens = request.num_computed_tokens
    counters = scheduler.counters
    counters.num_generation_tokens += steps * len(running)
    counters.num_steps += steps
    scheduler.step_index += steps


def decode_context_tokens(scheduler: Scheduler) -> int:
    """KV tokens the next stable step reads (its `num_context_tokens`); each later
    stable step reads one more per running request."""
    return sum(request.num_computed_tokens + 1 for request in scheduler.running)
