"""The infinite-cache ceiling on hand-worked token sequences (block size 4)."""

import pytest

from kvgate.bench.agentic.ceiling import WORDS, InfiniteCache, ceiling_of_requests, render_words, workload_ceiling
from kvgate.bench.agentic.workload import WorkloadSpec, generate_workload

A_TO_J = list("abcdefghij")


def test_hand_worked_workload():
    requests = [
        # turn 1: cold. Cached afterwards: abcd efgh ijxy (prompt + reply minus its last token).
        (A_TO_J, list("xyz")),
        # turn 2 = turn 1 + reply + end + new tool tokens: abcd efgh ijxy hit, [z E k l] misses.
        (A_TO_J + list("xyz") + ["E"] + list("klm"), list("uv")),
        # another session sharing only the first block (the system prompt): abcd hits.
        (list("abcd") + list("qrst"), list("w")),
        # a prompt wholly cached: its last token must be computed, so only 1 of 2 blocks hits.
        (list("abcdefgh"), list("w")),
        # same block content under another parent is a different block: no hit.
        (list("qrst") + list("efgh") + ["!"], list("w")),
    ]
    ceiling = ceiling_of_requests(requests, block_size=4)
    assert ceiling.prompt_tokens == 10 + 17 + 8 + 8 + 9
    assert ceiling.hit_tokens == 0 + 12 + 4 + 4 + 0
    assert ceiling.hit_rate == pytest.approx(20 / 52)


def test_partial_blocks_are_never_cached_or_hit():
    cache = InfiniteCache(block_size=4)
    cache.insert(list("abcdef"), list("g"))  # computed: abcdef -> one full block
    assert cache.lookup(list("abcdefgh") + ["z"]) == 4


def test_lookup_stops_at_first_miss():
    cache = InfiniteCache(block_size=2)
    cache.insert(list("ab") + list("cd") + list("ef"), list("gh"))
    assert cache.lookup(list("ab") + list("XX") + list("ef") + ["z"]) == 2


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size"):
        InfiniteCache(0)


def test_workload_ceiling_of_one_two_turn_session():
    spec = WorkloadSpec(
        sessions=1,
        concurrency=1,
        turns_min=2,
        turns_max=2,
        reply_tokens=5,
        system_prompt_words=10,
        task_words=7,
        tool_result_words_min=9,
        tool_result_words_max=9,
    )
    workload = generate_workload(spec, seed=3)
    session = workload.sessions[0]
    block = 4
    first = render_words(
        [{"role": "system", "content": session.system_prompt}, {"role": "user", "content": session.task}]
    )
    second_len = len(first) + 5 + 1 + 1 + len(("Tool result: " + session.turns[0].tool_result).split()) + 1 + 1
    # turn 2 repeats turn 1's prompt and its reply; the cache holds prompt + reply - 1 tokens.
    expected_hits = min((len(first) + 5 - 1) // block, (second_len - 1) // block) * block
    ceiling = workload_ceiling(workload, block, WORDS)
    assert ceiling.prompt_tokens == len(first) + second_len
    assert ceiling.hit_tokens == expected_hits


def test_shared_system_prompt_raises_the_ceiling():
    base = WorkloadSpec(sessions=6, concurrency=2, turns_min=1, turns_max=1, system_prompt_words=200)
    shared = workload_ceiling(generate_workload(base, 1), 16)
    private = workload_ceiling(generate_workload(base.replace(shared_system_prompt=False), 1), 16)
    assert private.hit_tokens == 0  # one turn per session, nothing shared: an infinite cache gains nothing
    assert shared.hit_tokens > 0


def test_the_ceiling_counts_every_thread_of_a_session():
    from kvgate.bench.agentic.ceiling import workload_requests

    spec = WorkloadSpec(sessions=3, turns_min=3, turns_max=3, subagent_prob=1.0, subagent_turns=2)
    workload = generate_workload(spec, 0)
    assert len(list(workload_requests(workload))) == workload.num_turns == 3 * (3 + 2 * 2)
