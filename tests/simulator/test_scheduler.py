"""Scheduler semantics on hand-worked cases (block_size 4 keeps the traces short)."""

import pytest

from kvgate.simulator.admission_policies import AdmissionView, make_policy, naive, reserve, reserve_watermark
from kvgate.simulator.config import ConfigError, EngineConfig
from kvgate.simulator.request import RequestStatus, SimRequest
from kvgate.simulator.scheduler import Scheduler


def token(request):
    return 7


def step(scheduler):
    output = scheduler.schedule()
    scheduler.update_from_output(output, token)
    return output


def make(rid, prompt_len, max_tokens, base, block_size=4):
    return SimRequest(rid, list(range(base, base + prompt_len)), max_tokens, block_size)


def test_chunked_prefill_within_token_budget():
    scheduler = Scheduler(EngineConfig(num_blocks=100, block_size=4, max_num_seqs=4, max_num_batched_tokens=8))
    a, b = make("a", 20, 2, 0), make("b", 4, 1, 1000)
    scheduler.add_request(a)
    scheduler.add_request(b)
    plan = [[(r.request_id, n) for r, n in step(scheduler).scheduled] for _ in range(4)]
    # a's prompt takes 8 + 8 + 4 tokens; b only joins when budget is left; a's first token
    # comes with its last chunk, then one decode step.
    assert plan == [[("a", 8)], [("a", 8)], [("a", 4), ("b", 4)], [("a", 1)]]
    assert a.first_token_step == 2 and a.status == RequestStatus.FINISHED_LENGTH
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert not scheduler.has_unfinished_requests()


def test_running_requests_decode_before_waiting_requests_prefill():
    scheduler = Scheduler(EngineConfig(num_blocks=100, block_size=4, max_num_seqs=4, max_num_batched_tokens=6))
    a, b = make("a", 4, 5, 0), make("b", 12, 1, 1000)
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(b)
    output = step(scheduler)
    assert [(r.request_id, n) for r, n in output.scheduled] == [("a", 1), ("b", 5)]
    assert output.num_decode_seqs == 1 and output.num_prefill_tokens == 5


def test_sequence_limit():
    scheduler = Scheduler(EngineConfig(num_blocks=100, block_size=4, max_num_seqs=2, max_num_batched_tokens=100))
    for index in range(3):
        scheduler.add_request(make(f"r{index}", 4, 3, index * 100))
    output = step(scheduler)
    assert [r.request_id for r in output.admitted] == ["r0", "r1"]
    assert len(scheduler.waiting) == 1


def test_preemption_of_newest_running_request_and_recompute():
    """Hand-worked trace: 6 blocks of 4 tokens, two requests of 8 prompt + 10 output tokens.

    Steps 0-4: both prefill (2 blocks each), then decode into a third block each: 6/6 used.
    Step 5: a needs a 4th block; b (newest) is preempted: its blocks go to the free queue
    tail last-block-first, a takes b's last block (1 eviction). b's first two blocks stay
    cached but are all the free blocks, so b cannot resume while a runs.
    Step 9: a needs its 5th block and evicts b's second block, then finishes.
    Step 10: b resumes with a 1-block hit (4 tokens) and recomputes tokens 4..11 (8 tokens
    it had computed before) plus token 12 for the first time.
    """
    scheduler = Scheduler(EngineConfig(num_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=100))
    a, b = make("a", 8, 10, 0), make("b", 8, 10, 1000)
    scheduler.add_request(a)
    scheduler.add_request(b)
    outputs = [step(scheduler) for _ in range(5)]
    assert scheduler.num_free_blocks == 0 and not any(o.preempted for o in outputs)
    output = step(scheduler)  # step 5
    assert output.preempted == [b]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert a.num_preemptions == 0
    assert scheduler.kv_cache_manager.block_pool.num_evictions == 1
    for _ in range(4):  # steps 6-9
        output = step(scheduler)
        assert [r.request_id for r, _ in output.scheduled] == ["a"]
    assert a.status == RequestStatus.FINISHED_LENGTH and a.finish_step == 9
    assert scheduler.kv_cache_manager.block_pool.num_evictions == 2
    output = step(scheduler)  # step 10
    assert output.scheduled == [(b, 9)] and output.num_recomputed_tokens == 8
    stats = scheduler.kv_cache_manager.prefix_cache_stats
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 13, 4)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 10
    assert scheduler.counters.num_preemptions == 1 and scheduler.counters.num_recomputed_tokens == 8
    assert scheduler.num_free_blocks == 6


def test_prefix_hit_after_request_finishes_counts_in_vllm_stats():
    scheduler = Scheduler(EngineConfig(num_blocks=20, block_size=4, max_num_seqs=2, max_num_batched_tokens=100))
    first = make("a", 10, 2, 0)
    scheduler.add_request(first)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    second = make("b", 10, 2, 0)  # same prompt
    scheduler.add_request(second)
    output = step(scheduler)
    assert output.scheduled == [(second, 2)]
    assert second.num_cached_prompt_tokens == 8
    stats = scheduler.kv_cache_manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)


def test_request_that_can_never_fit_is_rejected_not_queued():
    scheduler = Scheduler(EngineConfig(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=100))
    assert not scheduler.add_request(make("big", 16, 2, 0))  # 17 tokens need 5 blocks
    assert scheduler.counters.num_rejected == 1 and not scheduler.has_unfinished_requests()
    assert scheduler.add_request(make("ok", 16, 1, 0))  # the last output token is never computed


def test_abort_frees_blocks():
    scheduler = Scheduler(EngineConfig(num_blocks=10, block_size=4, max_num_seqs=2, max_num_batched_tokens=100))
    a, b = make("a", 8, 5, 0), make("b", 8, 5, 100)
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(b)
    assert scheduler.abort_request("b") and b.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.abort_request("a") and scheduler.num_free_blocks == 10
    assert not scheduler.abort_request("a")
    assert scheduler.counters.num_aborted == 2


def test_policy_blocks_admission_but_never_with_nothing_running():
    config = EngineConfig(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=100)
    scheduler = Scheduler(config, policy=make_policy("reserve_watermark"))
    a, b = make("a", 40, 4, 0), make("b", 20, 4, 1000)  # a: 10 blocks; b: 5 more would leave 1 < headroom 2
    scheduler.add_request(a)
    scheduler.add_request(b)
    output = step(scheduler)
    assert output.admitted == [a]
    naive_scheduler = Scheduler(config, policy=naive)
    naive_scheduler.add_request(make("a", 40, 4, 0))
    naive_scheduler.add_request(make("b", 20, 4, 1000))
    assert len(step(naive_scheduler).admitted) == 2


def test_shadow_policy_counts_disagreements():
    config = EngineConfig(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=100)
    scheduler = Scheduler(config, policy=naive, shadow_policy=make_policy("reserve_watermark"))
    scheduler.add_request(make("a", 40, 4, 0))
    scheduler.add_request(make("b", 20, 4, 1000))
    step(scheduler)
    assert scheduler.counters.shadow_decisions == 2 and scheduler.counters.shadow_disagreements == 1


def test_policies_price_obligations_and_headroom():
    view = AdmissionView(num_total_blocks=80, num_free_blocks=30, uncached_blocks=15, obligation_blocks=10)
    assert naive(view) and reserve(view) and not reserve_watermark(view)  # headroom ceil(80 / 8) = 10
    assert not reserve(AdmissionView(80, 30, 21, 10))
    assert not naive(AdmissionView(80, 0, 1, 0))
    with pytest.raises(ValueError, match="unknown admission policy"):
        make_policy("fifo")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_blocks", 0, "num_blocks"),
        ("block_size", 0, "block_size"),
        ("max_num_batched_tokens", 0, "max_num_batched_tokens"),
        ("max_num_seqs", 0, "max_num_seqs"),
        ("max_model_len", 10_000, "max_model_len"),
        ("scheduling_policy", "lifo", "scheduling_policy"),
    ],
)
def test_invalid_config_names_the_parameter(field, value, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**{"num_blocks": 10, "block_size": 16, field: value}).validate()


# -- priority scheduling (vLLM's --scheduling-policy priority) ---------------------------------


def prioritized(rid, prompt_len, max_tokens, base, priority, arrival):
    request = make(rid, prompt_len, max_tokens, base)
    request.priority, request.arrival = priority, arrival
    return request


@pytest.mark.parametrize("policy, order", [("fcfs", ["x", "y", "z"]), ("priority", ["y", "z", "x"])])
def test_waiting_requests_go_in_priority_order_only_under_priority_scheduling(policy, order):
    """One sequence slot: requests are admitted one at a time, in the waiting queue's order.
    x came first at priority 1; y and z after it at priority 0 (lower is served first)."""
    config = EngineConfig(num_blocks=100, block_size=4, max_num_seqs=1, scheduling_policy=policy)
    scheduler = Scheduler(config)
    for index, (rid, priority) in enumerate((("x", 1), ("y", 0), ("z", 0))):
        scheduler.add_request(prioritized(rid, 4, 1, index * 100, priority, float(index)))
    admitted = []
    while scheduler.has_unfinished_requests():
        admitted += [r.request_id for r in step(scheduler).admitted]
    assert admitted == order


def test_priority_scheduling_preempts_the_lowest_priority_not_the_newest():
    """The trace of test_preemption_of_newest_running_request_and_recompute, with a (the
    older) at priority 1 and b at 0: at step 5 the cache is full and the victim is a, the
    lowest priority (fcfs preempts b, the newest); b runs on."""
    config = EngineConfig(num_blocks=6, block_size=4, max_num_seqs=2, scheduling_policy="priority")
    scheduler = Scheduler(config)
    a, b = prioritized("a", 8, 10, 0, 1, 0.0), prioritized("b", 8, 10, 1000, 0, 1.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    for _ in range(5):
        step(scheduler)
    output = step(scheduler)  # step 5
    assert output.preempted == [a] and [r.request_id for r, _ in output.scheduled] == ["b"]
    assert b.status == RequestStatus.RUNNING and b.num_preemptions == 0
    assert list(scheduler.waiting) == [a]
    output = step(scheduler)
    assert [r.request_id for r, _ in output.scheduled] == ["b"]  # a cannot resume while b holds the blocks
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert b.finish_step < a.finish_step and scheduler.counters.num_preemptions == 1
    assert scheduler.num_free_blocks == 6


def test_a_victim_already_scheduled_in_the_step_gives_its_tokens_back():
    """low (priority 1) runs first; high (priority 0) comes later, so it is after low in the
    running list. When high needs a block, low is preempted though it was scheduled earlier
    in the same step: it leaves the step's schedule and its token goes back to the budget."""
    config = EngineConfig(num_blocks=5, block_size=4, max_num_seqs=2, scheduling_policy="priority")
    scheduler = Scheduler(config)
    low, high = prioritized("low", 8, 10, 0, 1, 0.0), prioritized("high", 8, 10, 1000, 0, 1.0)
    scheduler.add_request(low)
    step(scheduler)
    scheduler.add_request(high)
    preempting = None
    for _ in range(10):
        output = step(scheduler)
        if output.preempted:
            preempting = output
            break
    assert preempting is not None and preempting.preempted == [low]
    assert [r.request_id for r, _ in preempting.scheduled] == ["high"]
    assert preempting.num_scheduled_tokens == 1 and low.num_computed_tokens == 0
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert high.finish_step < low.finish_step and high.num_preemptions == 0
    assert scheduler.num_free_blocks == 5
