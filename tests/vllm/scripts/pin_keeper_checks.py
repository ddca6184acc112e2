"""Drive the retention connector against vLLM's real KVCacheManager/BlockPool; print JSON.

Run by the vLLM venv's python (no server, no model): tests/vllm/test_pin_keeper.py asserts
on the printed result. The script builds a real ``KVCacheManager`` (one full-attention
group, 16-token blocks, 31 usable blocks: ``probe_side_effects.make_manager``), binds a
``KvgateRetentionConnector`` to it as vLLM's scheduler does (``bind_kv_cache_manager``),
and runs turns the way the scheduler does: look up hits, ``allocate_slots`` (the
connector's wrapped one), then ``request_finished`` with the request's blocks and ``free``.
Each phase records what it saw (pin figures, ref counts, free counts, hits) for the test to assert.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

from probe_side_effects import BLOCK_SIZE, NUM_BLOCKS, make_manager  # the same real manager (scripts/ is on sys.path)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvgate.vllm_plugin.pin_keeper import keeper_of, pin_figures, release_answer
from kvgate.vllm_plugin.retention_connector import KvgateRetentionConnector
from kvgate.wire.kv_pins import Pin, make_pin, with_pin

KEY = "replica-key"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_connector(manager: KVCacheManager, clock: Clock) -> KvgateRetentionConnector:
    import os

    os.environ["KVGATE_REPLICA_API_KEY"] = KEY
    vllm_config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(kv_connector="KvgateRetentionConnector", kv_role="kv_producer")
    )
    connector = KvgateRetentionConnector(vllm_config, KVConnectorRole.SCHEDULER, None)
    connector.bind_kv_cache_manager(manager)  # what vLLM's Scheduler.__init__ does
    connector.kvgate_pins.clock = clock
    return connector


class Engine:
    """The scheduler's part of a turn: hits, allocation, the connector's finish, the free."""

    def __init__(self) -> None:
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.manager = make_manager()
        self.clock = Clock()
        self.connector = make_connector(self.manager, self.clock)
        self.keeper = self.connector.kvgate_pins
        self.pool = self.manager.block_pool
        self.core = SimpleNamespace(scheduler=SimpleNamespace(connector=self.connector))
        self.serial = 0

    def request(self, prompt: list[int], pin: Pin | dict | None = None) -> Request:
        self.serial += 1
        body = with_pin({}, pin) if isinstance(pin, Pin) else {"kv_transfer_params": {"kvgate_pin": pin}} if pin else {}
        extra = {"kv_transfer_params": body["kv_transfer_params"]} if body else None
        return Request(
            request_id=f"r{self.serial}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=1, extra_args=extra),
            pooling_params=None,
            block_hasher=self.hasher,
        )

    def start(self, prompt: list[int], pin: Pin | dict | None = None) -> Request | None:
        request = self.request(prompt, pin)
        computed, num_computed, _ = self.manager.get_computed_blocks(request)
        blocks = self.manager.allocate_slots(request, request.num_tokens - num_computed, num_computed, computed)
        if blocks is None:
            return None
        request.num_computed_tokens = request.num_tokens
        return request

    def finish(self, request: Request) -> None:
        block_ids = self.manager.get_block_ids(request.request_id)[0]
        delay, params = self.connector.request_finished(request, block_ids)
        assert (delay, params) == (False, None)
        self.manager.free(request)

    def turn(self, prompt: list[int], pin: Pin | dict | None = None) -> bool:
        request = self.start(prompt, pin)
        if request is None:
            return False
        self.finish(request)
        return True

    def hits(self, prompt: list[int]) -> int:
        request = self.request(prompt)
        found, _, _ = self.manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens)
        return len(found[0])

    def refs(self, prompt: list[int]) -> list[int]:
        request = self.request(prompt)
        found, _, _ = self.manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens)
        return [block.ref_cnt for block in found[0]]

    def figures(self) -> dict:
        return {**pin_figures(self.core), "free": self.pool.get_num_free_blocks()}


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(blocks * BLOCK_SIZE)]


def survives_a_flood(engine: Engine) -> dict:
    engine.turn(prompt(1, 8), make_pin("a", 60, KEY))
    engine.turn(prompt(2, 8))
    after_turns = engine.figures()
    refs = engine.refs(prompt(1, 8))
    for seed in range(100, 106):  # 6 x 12 blocks through a cache of 31: everything unpinned goes
        engine.turn(prompt(seed, 12))
    return {
        "after_turns": after_turns,
        "pinned_refs": refs,
        "pinned_hits_after_flood": engine.hits(prompt(1, 8)),
        "unpinned_hits_after_flood": engine.hits(prompt(2, 8)),
        "after_flood": engine.figures(),
    }


def yields_least_recent_first(engine: Engine) -> dict:
    engine.turn(prompt(3, 6), make_pin("b", 60, KEY))  # "a" (8 blocks) is older than "b"
    before = engine.figures()
    # 31 blocks, 14 pinned: a 20-block request fits once "a" yields, and "b" can stay.
    fits = engine.turn(prompt(4, 20))
    after_one = {**engine.figures(), "b_pinned": engine.keeper.book.pinned("b") is not None}
    too_big = engine.start(prompt(5, 32))  # more blocks than the cache has: never fits
    return {
        "before": before,
        "fits": fits,
        "after_one_yield": after_one,
        "too_big_allocated": too_big is not None,
        "after_too_big": engine.figures(),
    }


def replaced_then_released(engine: Engine) -> dict:
    first, longer = prompt(6, 4), prompt(6, 4) + prompt(7, 2)
    engine.turn(first, make_pin("r", 60, KEY))
    engine.turn(longer, make_pin("r", 60, KEY))
    replaced = {**engine.figures(), "refs": engine.refs(longer)}
    answer = release_answer(engine.core, ["r", "r", "never"])
    return {
        "replaced": replaced,
        "release": answer,
        "after_release": {**engine.figures(), "refs": engine.refs(longer), "hits": engine.hits(longer)},
        "release_again": release_answer(engine.core, ["r"]),
        "bad_release": release_answer(engine.core, "r"),
    }


def invalid_pins_and_ttl(engine: Engine) -> dict:
    engine.turn(prompt(8, 2), Pin("x", 60, "00" * 32))
    engine.turn(prompt(9, 2), {"session": "y", "ttl_sec": -1})
    engine.turn(prompt(10, 2), {"session": "z"})
    invalid = engine.figures()
    engine.turn(prompt(11, 2), make_pin("t", 1.0, KEY))
    held = engine.figures()
    engine.clock.now += 1.5
    expired = engine.figures()
    engine.turn(prompt(12, 2), make_pin("capped", 10_000, KEY))
    engine.clock.now += 601  # the server's cap (MAX_PIN_TTL_SEC = 600) ends it
    return {"invalid": invalid, "held": held, "expired": expired, "capped": engine.figures()}


def open_replica_and_lookup() -> dict:
    import os

    os.environ.pop("KVGATE_REPLICA_API_KEY", None)
    manager = make_manager()
    vllm_config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(kv_connector="KvgateRetentionConnector", kv_role="kv_producer")
    )
    connector = KvgateRetentionConnector(vllm_config, KVConnectorRole.SCHEDULER, None)
    connector.bind_kv_cache_manager(manager)
    multi = SimpleNamespace(scheduler=SimpleNamespace(connector=SimpleNamespace(_connectors=[object(), connector])))
    bare = SimpleNamespace(scheduler=SimpleNamespace(connector=None))
    return {
        "open_key": connector.kvgate_pins.replica_key,
        "found_in_multi": keeper_of(multi) is connector.kvgate_pins,
        "bare_figures": pin_figures(bare),
        "bare_release": release_answer(bare, ["a"]),
    }


def main() -> None:
    engine = Engine()
    result = {
        "flood": survives_a_flood(engine),
        "yields": yields_least_recent_first(engine),
    }
    engine.keeper.release(["b"])
    result["replace"] = replaced_then_released(engine)
    result["invalid_and_ttl"] = invalid_pins_and_ttl(engine)
    result["lookup"] = open_replica_and_lookup()
    result["pool_consistent"] = engine.pool.get_num_free_blocks() == NUM_BLOCKS - 1
    print(json.dumps(result))


if __name__ == "__main__":
    main()
