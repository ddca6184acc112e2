"""The retention connector against vLLM's real KVCacheManager and BlockPool (no server, no model).

The turns run in the vLLM venv (scripts/pin_keeper_checks.py prints JSON); these tests
assert on what each phase saw.
"""

from __future__ import annotations

import pytest
from vllm_harness import check_json

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def seen(vllm_checks: dict[str, dict]) -> dict:
    return check_json(vllm_checks, "pin_keeper_checks.py")


def test_a_pin_holds_one_reference_on_each_full_block_and_counts_them_used(seen):
    flood = seen["flood"]
    assert flood["after_turns"] == {"num_pinned_blocks": 8, "num_pinned_sessions": 1, "num_pin_yields": 0, "free": 23}
    assert flood["pinned_refs"] == [1] * 8  # the finished request's own references are gone


def test_a_pinned_window_survives_a_flood_that_evicts_an_unpinned_one(seen):
    flood = seen["flood"]
    assert (flood["pinned_hits_after_flood"], flood["unpinned_hits_after_flood"]) == (8, 0)
    assert flood["after_flood"] == flood["after_turns"]


def test_an_allocation_that_does_not_fit_yields_the_least_recent_pin_only(seen):
    yields = seen["yields"]
    assert yields["before"]["num_pinned_sessions"] == 2 and yields["fits"]
    assert yields["after_one_yield"] == {
        "num_pinned_blocks": 6,
        "num_pinned_sessions": 1,
        "num_pin_yields": 1,
        "free": 25,
        "b_pinned": True,
    }


def test_an_allocation_that_never_fits_ends_every_pin_and_still_fails(seen):
    yields = seen["yields"]
    assert yields["too_big_allocated"] is False
    assert yields["after_too_big"] == {
        "num_pinned_blocks": 0,
        "num_pinned_sessions": 0,
        "num_pin_yields": 2,
        "free": 31,
    }


def test_a_next_pinned_turn_replaces_the_pin_and_a_release_leaves_the_blocks_cached(seen):
    replace = seen["replace"]
    assert replace["replaced"]["num_pinned_sessions"] == 1 and replace["replaced"]["refs"] == [1] * 6
    assert replace["release"] == {"released_sessions": 1, "released_blocks": 6}
    after = replace["after_release"]
    assert (after["num_pinned_blocks"], after["refs"], after["hits"]) == (0, [0] * 6, 6)
    assert replace["release_again"] == {"released_sessions": 0, "released_blocks": 0}
    assert "error" in replace["bad_release"]


def test_invalid_pins_are_served_unpinned_and_pins_end_at_their_ttl_or_the_cap(seen):
    phases = seen["invalid_and_ttl"]
    assert phases["invalid"]["num_pinned_sessions"] == 0
    assert (phases["held"]["num_pinned_sessions"], phases["held"]["num_pinned_blocks"]) == (1, 2)
    assert phases["expired"]["num_pinned_sessions"] == 0 and phases["expired"]["free"] == 31
    assert phases["capped"]["num_pinned_sessions"] == 0


def test_the_keeper_is_found_in_a_multi_connector_and_absent_without_the_connector(seen):
    lookup = seen["lookup"]
    assert lookup["open_key"] is None and lookup["found_in_multi"]
    assert lookup["bare_figures"] == {}
    assert "--kv-transfer-config" in lookup["bare_release"]["error"]


def test_every_block_is_free_again_at_the_end(seen):
    assert seen["pool_consistent"]
