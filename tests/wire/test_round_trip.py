"""Every field of every wire message, through both implementations of the replica API.

For each message of `kvgate.wire` (the prefix query, the kv and prefix answers, the owner
claim and answer, the error envelope) the tests check two things:

- the message round-trips: `parse(to_json(x)) == x`, and a document a server sent is
  exactly what its parsed message writes back (a server sends no field the type does not
  know, and the type drops none it sends);
- every field is exercised: set (not None, not empty) somewhere in the message, its
  per-engine entries included, so no field of the contract goes untested.

Both implementations: the simulated replica as a real aiohttp server on loopback, and the
vLLM plugin's answer builders at unit level (the engine-core methods the plugin installs,
run on a stand-in engine core, and the API server's `ProbeService`, which merges the
engines' answers). The plugin on a real vLLM is tests/vllm_plugin/test_probe_endpoints.py and
tests/vllm_plugin/test_owner_record.py (marker `vllm`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import fields, replace
from types import SimpleNamespace

import aiohttp
import pytest

from kvgate.simulator.replica_server import SimulatedReplica
from kvgate.vllm_plugin import endpoint_plugin, jsonio
from kvgate.vllm_plugin.cpu_tier import cpu_run_blocks, cpu_tier_of
from kvgate.vllm_plugin.endpoint_plugin import ProbeService
from kvgate.vllm_plugin.engine_plugin import PREFIX_ANSWER_METHOD, install_probes
from kvgate.vllm_plugin.engine_rates import READ_INTERVAL_SEC
from kvgate.vllm_plugin.pin_keeper import PinKeeper, keeper_of
from kvgate.wire.errors import anthropic_error, openai_error
from kvgate.wire.kv_pins import ReleaseAnswer, make_pin
from kvgate.wire.owner_record import OWNER_PATH, OwnerAnswer, OwnerBook, OwnerClaim
from kvgate.wire.probe_api import (
    KV_PATH,
    PREFIX_PATH,
    QUERY_KINDS,
    KvAnswer,
    PrefixAnswer,
    PrefixQuery,
    merge_kv,
    merge_prefix,
)
from kvgate.wire.routes import PROMPT_KINDS

BLOCK = 16


# The CPU tier's figures: only a server with a CPU tier (vLLM's KV offloading) sets them;
# the simulated replica below runs without one (the plugin's stand-in engine has one).
CPU_TIER_FIELDS = {"num_cpu_blocks", "num_cpu_cached_blocks", "cpu_load_sec_per_block", "hit_blocks_cpu"}


def unset_fields(message) -> set[str]:
    """The fields of a wire message that neither it nor any of its engine entries sets."""
    nodes = [message, *getattr(message, "engines", ())]
    return {f.name for f in fields(message) if all(getattr(node, f.name) in (None, ()) for node in nodes)}


def assert_round_trips(message_type, doc: dict) -> object:
    """`doc` (a server's JSON, through a JSON codec) parses, and writes back exactly as sent."""
    doc = jsonio.loads(jsonio.dumps(doc))
    message = message_type.parse(doc)
    assert message.to_json() == doc
    assert message_type.parse(message.to_json()) == message
    return message


# ------------------------------------------------------------------ the messages alone


def full_kv() -> KvAnswer:
    engines = [
        KvAnswer.of_engine(
            num_gpu_blocks=65,
            num_free_blocks=free,
            num_cached_blocks=7,
            block_size=BLOCK,
            num_running=2,
            num_waiting=1,
            prefill_tokens_per_sec=9000.0,
            decode_step_sec=0.01,
            prefill_share=0.4,
            token_sec=1e-4,
            busy_share=busy,
            num_pinned_blocks=3,
            num_pinned_sessions=1,
            num_pin_yields=0,
            num_cpu_blocks=256,
            num_cpu_cached_blocks=12,
            cpu_load_sec_per_block=0.0001,
        )
        for free, busy in ((40, 0.5), (30, 0.75))
    ]
    # the server's own figures
    return replace(merge_kv(engines), max_model_len=4096, max_token_bytes=48, scheduling_policy="priority")


def full_prefix() -> PrefixAnswer:
    return merge_prefix(
        [
            PrefixAnswer.of_engine(
                total_tokens=70, block_size=BLOCK, hit_block_ref_counts=refs, hit_tokens=hit, hit_blocks_cpu=cpu
            )
            for refs, hit, cpu in (([1, 0, 0], 48, 1), ([2, 0], 32, 2))
        ]
    )


MESSAGES = {
    "kv answer": (KvAnswer, full_kv),
    "prefix answer": (PrefixAnswer, full_prefix),
    "owner claim": (OwnerClaim, lambda: OwnerClaim("gate-a", 15.0, "nonce-1")),
    "owner answer": (OwnerAnswer, lambda: OwnerAnswer(True, True, 12.5, 1, "nonce-1")),
}


@pytest.mark.parametrize("name", MESSAGES)
def test_each_message_round_trips_with_every_field_set(name):
    message_type, build = MESSAGES[name]
    message = build()
    assert unset_fields(message) == set(), name
    assert assert_round_trips(message_type, message.to_json()) == message


@pytest.mark.parametrize("kind", QUERY_KINDS)
def test_every_prefix_query_round_trips(kind):
    if kind == "token_ids":
        query = PrefixQuery("token_ids", [1, 2, 3], cache_salt="tenant", model="m")
        assert unset_fields(query) == {"body"}  # a query of token ids has no request body
    else:
        query = PrefixQuery.of_request(kind, {"model": "m", "messages": []})
        assert unset_fields(query) == {"token_ids", "cache_salt", "model"}  # ... nor a body kind token ids
    assert PrefixQuery.parse(jsonio.loads(jsonio.dumps(query.to_json()))) == query
    assert set(QUERY_KINDS) == {"token_ids", *PROMPT_KINDS}


def test_the_error_envelopes_carry_every_field():
    assert openai_error("m", "t", "c", "p") == {"error": {"message": "m", "type": "t", "param": "p", "code": "c"}}
    assert anthropic_error("m", "t", "c") == {"type": "error", "error": {"type": "t", "message": "m", "code": "c"}}


@pytest.mark.parametrize(
    "message_type, doc, field",
    [
        (KvAnswer, {"kv_cache_usage": 0.5, "token_sec": 0}, "token_sec"),
        (KvAnswer, {"kv_cache_usage": 0.5, "busy_share": 1.5}, "busy_share"),
        (KvAnswer, {"kv_cache_usage": 0.5, "num_gpu_blocks": -1}, "num_gpu_blocks"),
        (KvAnswer, {"kv_cache_usage": 0.5, "engines": [{"kv_cache_usage": 0.5}]}, "engine"),
        (KvAnswer, {"kv_cache_usage": 0.5, "version": "1"}, "version"),
        (KvAnswer, {"kv_cache_usage": 0.5, "max_model_len": -1}, "max_model_len"),
        (KvAnswer, {"kv_cache_usage": 0.5, "max_token_bytes": 0}, "max_token_bytes"),
        (KvAnswer, {"kv_cache_usage": 0.5, "max_token_bytes": 2.5}, "max_token_bytes"),
        (PrefixAnswer, {"total_blocks": 3, "hit_blocks": 2, "hit_ratio": 0.6, "block_size": 1.5}, "block_size"),
        (
            PrefixAnswer,
            {"total_blocks": 3, "hit_blocks": 2, "hit_ratio": 0.6, "hit_blocks_in_use": 2, "hit_blocks_evictable": 1},
            "hit_blocks_in_use",
        ),
        (PrefixAnswer, {"total_blocks": 3, "hit_blocks": 2, "hit_ratio": 0.6, "engines": {}}, "engines"),
    ],
)
def test_parse_names_the_field_that_is_wrong(message_type, doc, field):
    with pytest.raises(ValueError, match=field):
        message_type.parse(doc)


# --------------------------------------------------------- the simulated replica (HTTP)


@pytest.fixture
async def replica():
    started = await SimulatedReplica.start(num_blocks=64, block_size=BLOCK, time_scale=0)
    try:
        yield started
    finally:
        await started.stop()


CHAT = {"model": "kvgate-sim", "messages": [{"role": "user", "content": "a conversation " * 12}], "max_tokens": 8}


async def test_the_simulated_replica_answers_every_field_of_every_message(replica):
    base = replica.url
    async with aiohttp.ClientSession() as http:
        # prefill steps and decode steps, so the engine has measured itself
        for _ in range(2):
            async with http.post(base + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200, await resp.text()
        async with http.get(base + KV_PATH) as resp:
            kv = assert_round_trips(KvAnswer, await resp.json())
        assert unset_fields(kv) - CPU_TIER_FIELDS == set()
        assert kv.num_gpu_blocks == kv.num_total_blocks + 1 == 65
        assert (kv.max_model_len, kv.max_token_bytes) == (replica.engine.config.effective_max_model_len, 48)

        queries = [
            PrefixQuery("token_ids", list(range(40)), cache_salt="tenant", model="kvgate-sim"),
            PrefixQuery.of_request("chat", CHAT),
            PrefixQuery.of_request("completion", {"model": "kvgate-sim", "prompt": "a conversation " * 12}),
            PrefixQuery.of_request(
                "messages", {"model": "kvgate-sim", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            ),
            PrefixQuery.of_request("responses", {"model": "kvgate-sim", "input": "a conversation " * 12}),
        ]
        assert {query.kind for query in queries} == set(QUERY_KINDS)
        answers = []
        for query in queries:
            async with http.post(base + PREFIX_PATH, json=query.to_json()) as resp:
                assert resp.status == 200, (query.kind, await resp.text())
                answers.append(assert_round_trips(PrefixAnswer, await resp.json()))
        chat = answers[1]
        assert chat.hit_blocks > 0 and chat.total_tokens  # the conversation above is resident
        assert unset_fields(chat) - CPU_TIER_FIELDS == set()

        claims = [OwnerClaim("gate-a", 15.0), OwnerClaim("gate-b", 15.0)]
        owner_answers = []
        for claim in claims:
            assert OwnerClaim.parse(claim.to_json()) == claim
            async with http.post(base + OWNER_PATH, json=claim.to_json()) as resp:
                assert resp.status == 200, await resp.text()
                owner_answers.append(assert_round_trips(OwnerAnswer, await resp.json()))
        renewal = OwnerClaim("gate-a", 15.0, owner_answers[0].nonce)
        assert unset_fields(renewal) == set()
        async with http.post(base + OWNER_PATH, json=renewal.to_json()) as resp:  # a renewal learns of b
            renewed = assert_round_trips(OwnerAnswer, await resp.json())
        assert owner_answers[1].owned and not owner_answers[1].held and owner_answers[1].nonce is None
        assert renewed.held and renewed.contenders == 1 and renewed.expires_in_sec > 0
        assert unset_fields(renewed) == set()
        async with http.get(base + OWNER_PATH) as resp:
            read = assert_round_trips(OwnerAnswer, await resp.json())
        assert read.owned and not read.held and read.nonce is None

        async with http.post(base + PREFIX_PATH, json={"token_ids": [1], "cache_salt": 3}) as resp:
            assert resp.status == 400
            error = await resp.json()
        assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["param"] == "cache_salt"


# ------------------------------------------------------ the vLLM plugin (unit level)


class StandInBlockPool:
    """What `PinKeeper` does to vLLM's BlockPool: reference counts on hashed blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [SimpleNamespace(is_null=i == 0, block_hash=i or None, ref_cnt=0) for i in range(num_blocks)]

    def touch(self, blocks) -> None:
        for block in blocks:
            block.ref_cnt += 1

    def free_blocks(self, blocks) -> None:
        for block in blocks:
            block.ref_cnt -= 1


class StandInCpuManager:
    """What `cpu_tier` reads of vLLM's CPUOffloadingManager: ``lookup`` by key, chunk counts."""

    def __init__(self, num_chunks: int, held: set) -> None:
        self.held = held
        self._num_chunks, self._num_allocated_chunks, self._free_list = num_chunks, len(held) + 1, [7]

    def lookup(self, key, req_context):
        return SimpleNamespace(name="HIT" if key in self.held else "MISS")


def stand_in_offloading(held_chunks: set[int]) -> SimpleNamespace:
    """An OffloadingConnector's scheduler side: chunks of two blocks; the chunk keyed by a
    prompt's hash i (its last block) is held when i is in `held_chunks`."""
    group = SimpleNamespace(group_idx=0, tokens_per_block=BLOCK, tokens_per_chunk=2 * BLOCK, hashes_per_chunk=2)
    held = {(index, 0) for index in held_chunks}
    manager = StandInCpuManager(num_chunks=32, held=held)
    return SimpleNamespace(
        connector_scheduler=SimpleNamespace(manager=manager, config=SimpleNamespace(kv_group_configs=[group]))
    )


class StandInEngineCore:
    """What the plugin's engine-core methods read of vLLM's EngineCore (``scheduler``,
    ``step``), with a scheduler whose steps take time in proportion to their tokens, so
    the installed step timer fits a marginal token cost (`step_costs`). Its connector is a
    MultiConnector of the retention connector and an offloading connector (a CPU tier)."""

    def __init__(self, free_blocks: int, running: int) -> None:
        pool = SimpleNamespace(
            num_gpu_blocks=65,
            get_num_free_blocks=lambda: free_blocks,
            cached_block_hash_to_block={index: object() for index in range(9)},
        )
        self.scheduler = SimpleNamespace(
            kv_cache_manager=SimpleNamespace(block_pool=pool),
            block_size=BLOCK,
            get_request_counts=lambda: (running, 1),
            schedule=self._schedule,
            connector=SimpleNamespace(
                _connectors=[
                    SimpleNamespace(kvgate_pins=PinKeeper(StandInBlockPool(8), None)),
                    stand_in_offloading({3}),
                ]
            ),
            kv_cache_config=SimpleNamespace(  # 2 layers of 4 KiB pages: 8 KiB a block
                kv_cache_groups=[
                    SimpleNamespace(kv_cache_spec=SimpleNamespace(page_size_bytes=4096), layer_names=["a", "b"])
                ]
            ),
        )
        self._tokens = 0

    def _schedule(self):
        return SimpleNamespace(total_num_scheduled_tokens=self._tokens)

    def step(self, tokens: int) -> None:
        self._tokens = tokens
        self.scheduler.schedule()
        time.sleep(0.0005 + tokens * 2e-5)


install_probes(StandInEngineCore)


class StandInEngineClient:
    """The API server's view of the engines: one UTILITY call answered by each engine core."""

    def __init__(self, cores: list[StandInEngineCore], prefixes: list[PrefixAnswer]) -> None:
        async def call_utility_all_async(method, *args):
            if method == PREFIX_ANSWER_METHOD:  # the engine side needs vLLM's Request to hash a prompt
                return [answer.to_json() for answer in prefixes]
            return [getattr(core, method)(*args) for core in cores]

        self.engine_core = SimpleNamespace(call_utility_all_async=call_utility_all_async)


async def test_the_plugins_builders_answer_every_field_of_every_message(monkeypatch):
    cores = [StandInEngineCore(free_blocks=40, running=2), StandInEngineCore(free_blocks=20, running=3)]
    for core, blocks in zip(cores, ([1, 2, 3], [4, 5]), strict=True):  # a finished turn's blocks, each engine's pin
        keeper_of(core).finished({"kvgate_pin": make_pin("s", 60, None).to_json()}, blocks)
    for core in cores:
        for index in range(40):
            core.step(10 + 8 * index)  # varied step sizes: a marginal cost can be fitted
    assert all(core.kvgate_kv_answer()["token_sec"] for core in cores)  # the installed method
    hashes = list(range(70 // BLOCK))  # the prompt's block hashes; each engine holds chunk 1 (blocks 2-3) on its CPU
    prefixes = [  # what each engine's `prefix_answer` builds for a 70-token prompt
        PrefixAnswer.of_engine(
            total_tokens=70,
            block_size=BLOCK,
            hit_block_ref_counts=refs,
            hit_tokens=hit,
            hit_blocks_cpu=cpu_run_blocks(cpu_tier_of(core), hashes, len(refs), lambda h, g: (h, g), None),
        )
        for core, refs, hit in zip(cores, ([1, 0, 0], [2, 0]), (48, 32), strict=True)
    ]
    state = SimpleNamespace(openai_serving_models=SimpleNamespace(is_base_model=lambda name: name == "m"))
    vocabulary = {"▁hello": 0, "<0x0A>": 1, "Ġworld": 2}  # SentencePiece and byte-level BPE spellings
    service = ProbeService(
        StandInEngineClient(cores, prefixes),
        state,
        timeout_sec=5.0,
        max_model_len=4096,
        max_token_bytes=endpoint_plugin.max_token_bytes(vocabulary),
        scheduling_policy=endpoint_plugin.scheduling_policy(None, SimpleNamespace(scheduling_policy="priority")),
    )

    # vLLM's counters, as the API server's registry holds them: they grow between two probes
    totals = iter(
        [
            {"prompt_tokens": 1000, "hit_tokens": 200, "prefill_sec": 0.5, "generation_tokens": 100, "decode_sec": 1.0},
            {"prompt_tokens": 3000, "hit_tokens": 400, "prefill_sec": 1.0, "generation_tokens": 300, "decode_sec": 3.0},
        ]
    )
    monkeypatch.setattr(endpoint_plugin, "read_totals", lambda: next(totals))
    # the counters are read at most every READ_INTERVAL_SEC: the second probe comes that much later
    ticks = itertools.count(100.0, READ_INTERVAL_SEC)
    monkeypatch.setattr(endpoint_plugin, "time", SimpleNamespace(monotonic=lambda: next(ticks)))
    await service.kv_answer()
    kv = assert_round_trips(KvAnswer, (await service.kv_answer()).to_json())
    assert unset_fields(kv) == set()
    assert (kv.num_cpu_blocks, kv.num_cpu_cached_blocks) == (2 * 64, 2 * 2)  # two engines, 2 blocks a chunk
    assert kv.cpu_load_sec_per_block == pytest.approx(8192 / 50e9)
    assert [engine.engine for engine in kv.engines] == [0, 1] and kv.num_total_blocks == 128
    assert (kv.num_pinned_blocks, kv.num_pinned_sessions, kv.num_pin_yields) == (5, 2, 0)
    released = assert_round_trips(ReleaseAnswer, (await service.release({"sessions": ["s"]})).to_json())
    assert released == ReleaseAnswer(2, 5)  # every engine released its pin of the session
    assert (kv.max_model_len, kv.max_token_bytes) == (4096, 8)  # "▁hello": 3 + 5 bytes

    query = PrefixQuery("token_ids", list(range(70)), cache_salt="tenant", model="m")
    prefix = assert_round_trips(PrefixAnswer, (await service.prefix_answer(query.to_json())).to_json())
    assert unset_fields(prefix) == set()
    assert prefix.hit_blocks == 2 and prefix.hit_blocks_in_use == 1  # the engine with the fewest hits
    assert prefix.hit_blocks_cpu == 2  # blocks 2-3; the other engine's run is block 3 (its GPU holds 2)

    book = OwnerBook(iter(range(100)).__next__)  # the record both servers keep
    taken = assert_round_trips(OwnerAnswer, book.claim(OwnerClaim("gate-a", 15.0).to_json()))
    book.claim(OwnerClaim("gate-b", 15.0).to_json())
    renewed = assert_round_trips(OwnerAnswer, book.claim(OwnerClaim("gate-a", 15.0, taken.nonce).to_json()))
    assert unset_fields(renewed) == set() and renewed.contenders == 1
    assert assert_round_trips(OwnerAnswer, book.read()).owned

    bad = endpoint_plugin.error_body(400, "'cache_salt' must be a string", "invalid_request", "cache_salt")
    assert set(bad["error"]) == {"message", "type", "param", "code"}
