"""The decode jump against the per-step scheduler it replaces: same blocks, same cache, same counters.

Two schedulers get the same requests at the same steps; one only ever steps, the other
jumps whenever `stable_decode_steps` allows (a random part of it). After every jump the
two must be identical: every request's tokens and block table, the free queue's order,
the prefix cache, evictions, the CPU tier's blocks in LRU order, counters and the step index.
"""

from __future__ import annotations

import random

import pytest

from kvgate.simulator.config import EngineConfig
from kvgate.simulator.decode_jump import decode_context_tokens, jump_decode_steps, stable_decode_steps
from kvgate.simulator.request import SimRequest
from kvgate.simulator.scheduler import Scheduler
from kvgate.simulator.session_request import SessionRequest
from kvgate.simulator.tokenizer import output_token


def _token(request: SimRequest) -> int:
    return output_token(request.num_tokens)


def _snapshot(scheduler: Scheduler) -> dict:
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    requests = {
        rid: (r.num_tokens, r.num_computed_tokens, r.max_computed_tokens, r.status.value, r.num_preemptions)
        for rid, r in scheduler.requests.items()
    }
    return {
        "requests": requests,
        "running": [r.request_id for r in scheduler.running],
        "waiting": [r.request_id for r in scheduler.waiting],
        "tables": {rid: [b.block_id for b in blocks] for rid, blocks in manager.req_to_blocks.items()},
        "cached_counts": dict(manager.num_cached_blocks),
        "free_queue": pool.free_block_queue.block_ids(),
        "prefix_cache": sorted((h, b.block_id) for h, b in pool.cached_block_hash_to_block.items()),
        "ref_counts": [b.ref_cnt for b in pool.blocks],
        "evictions": pool.num_evictions,
        "counters": vars(scheduler.counters).copy(),
        "step": scheduler.step_index,
        "stats": vars(manager.prefix_cache_stats).copy(),
        "cpu_tier": None if manager.cpu_tier is None else (list(manager.cpu_tier.held), manager.cpu_tier.num_evicted),
    }


def _make(kind: str, rid: str, session: int, prompt: int, out: int, block_size: int, shared: int):
    if kind == "session":
        return SessionRequest(rid, session, prompt, out, block_size, (0, shared))
    rng = random.Random(session)
    own = [rng.randrange(16, 32000) for _ in range(prompt)]
    tokens = list(range(100, 100 + shared)) + own[shared:] if shared < prompt else own
    return SimRequest(rid, tokens[:prompt], out, block_size)


@pytest.mark.parametrize("cpu_tier", [False, True])
@pytest.mark.parametrize("kind", ["session", "tokens"])
@pytest.mark.parametrize("seed", range(6))
def test_jumps_match_the_per_step_scheduler(kind, seed, cpu_tier):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    num_blocks = rng.randint(24, 90)
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(2, 8),
        max_num_batched_tokens=64,
        cpu_blocks=2 * num_blocks if cpu_tier else 0,  # small enough that the tier evicts too
    )
    stepped, jumped = Scheduler(config), Scheduler(config)
    sessions: dict[int, int] = {}  # session -> tokens so far (a growing agent context)
    jumps = jumped_steps = 0
    for arrival in range(40):
        session = rng.randrange(6)
        prompt = sessions.get(session, rng.randint(3, 5) * block_size) + rng.randint(1, 3 * block_size)
        out = rng.randint(1, 40)
        if (prompt + out) // block_size + 2 < config.num_blocks:
            sessions[session] = prompt + out
            for scheduler in (stepped, jumped):
                scheduler.add_request(_make(kind, f"r{arrival}", session, prompt, out, block_size, 2 * block_size))
        for _ in range(rng.randint(1, 25)):
            limit = stable_decode_steps(jumped, rng.randint(1, 30))
            if limit >= 1:
                steps = rng.randint(1, limit)
                assert decode_context_tokens(jumped) == decode_context_tokens(stepped)
                jump_decode_steps(jumped, steps, _token)
                for _ in range(steps):
                    output = stepped.schedule()
                    assert output.num_prefill_tokens == 0 and output.num_decode_seqs == len(stepped.running)
                    assert not stepped.update_from_output(output, _token)  # a stable step finishes nothing
                jumps += 1
                jumped_steps += steps
            else:
                for scheduler in (stepped, jumped):
                    scheduler.update_from_output(scheduler.schedule(), _token)
            assert _snapshot(jumped) == _snapshot(stepped)
    assert jumps > 5 and jumped_steps > jumps  # the scenarios did exercise multi-step jumps
    if cpu_tier:  # the tier was exercised: blocks loaded back, and evicted to make room
        assert stepped.counters.num_cpu_loaded_blocks > 0 and stepped.kv_cache_manager.cpu_tier.num_evicted > 0


def test_no_jump_when_a_request_waits_or_prefills():
    config = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=8)
    scheduler = Scheduler(config)
    scheduler.add_request(SessionRequest("a", 1, 20, 10, 4))
    assert stable_decode_steps(scheduler, 100) == 0  # waiting
    scheduler.update_from_output(scheduler.schedule(), _token)
    assert stable_decode_steps(scheduler, 100) == 0  # still prefilling (8 of 20 tokens)
    while scheduler.running[0].num_output_tokens == 0:
        scheduler.update_from_output(scheduler.schedule(), _token)
    assert stable_decode_steps(scheduler, 100) == 8  # 9 outputs to go: the finishing step is not jumped
    scheduler.add_request(SessionRequest("b", 2, 8, 4, 4))
    assert stable_decode_steps(scheduler, 100) == 0  # a waiting request (no free seq slot) stops it


def test_the_jump_stops_before_the_free_blocks_run_out():
    config = EngineConfig(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    scheduler = Scheduler(config)
    scheduler.add_request(SessionRequest("a", 1, 12, 10, 4))
    scheduler.add_request(SessionRequest("b", 2, 12, 10, 4))
    scheduler.update_from_output(scheduler.schedule(), _token)
    # 3 blocks each held, 2 free; each request needs a new block at its 1st and 5th next step,
    # so the 5th step runs out (and preempts): 4 steps may be jumped
    assert scheduler.num_free_blocks == 2
    assert stable_decode_steps(scheduler, 100) == 4
