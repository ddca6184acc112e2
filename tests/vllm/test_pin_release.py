"""The plugin's release path and pin fields without vLLM (main venv, not marked ``vllm``):
a server without the retention connector answers a release 501 saying how to load it,
and its kv answer leaves the pin fields null."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvgate.vllm_plugin.endpoint_plugin import ProbeService, ProbeUnavailable
from kvgate.vllm_plugin.engine_plugin import KV_ANSWER_METHOD, install_probes
from kvgate.wire.kv_pins import PinError
from kvgate.wire.probe_api import KvAnswer


class EngineWithoutConnector:
    """An engine core as the plugin reads it, started without --kv-transfer-config."""

    def __init__(self) -> None:
        pool = SimpleNamespace(num_gpu_blocks=33, get_num_free_blocks=lambda: 32, cached_block_hash_to_block={})
        self.scheduler = SimpleNamespace(
            kv_cache_manager=SimpleNamespace(block_pool=pool),
            block_size=16,
            get_request_counts=lambda: (0, 0),
            connector=None,
        )


install_probes(EngineWithoutConnector)


def service(cores: list) -> ProbeService:
    async def call_utility_all_async(method, *args):
        return [getattr(core, method)(*args) for core in cores]

    client = SimpleNamespace(engine_core=SimpleNamespace(call_utility_all_async=call_utility_all_async))
    return ProbeService(client, SimpleNamespace(), timeout_sec=5.0)


async def test_a_release_without_the_connector_is_501_naming_the_connector_config():
    with pytest.raises(ProbeUnavailable) as refused:
        await service([EngineWithoutConnector(), EngineWithoutConnector()]).release({"sessions": ["a"]})
    assert (refused.value.status, refused.value.code) == (501, "pins_not_kept")
    assert "--kv-transfer-config" in str(refused.value) and "KvgateRetentionConnector" in str(refused.value)


@pytest.mark.parametrize("body", [None, {}, {"sessions": "a"}, {"sessions": [""]}, {"sessions": [3]}])
async def test_a_release_body_without_a_list_of_sessions_is_refused(body):
    with pytest.raises(PinError):
        await service([EngineWithoutConnector()]).release(body)


def test_the_kv_answer_without_the_connector_leaves_the_pin_fields_null():
    kv = KvAnswer.parse(getattr(EngineWithoutConnector(), KV_ANSWER_METHOD)())
    assert (kv.num_pinned_blocks, kv.num_pinned_sessions, kv.num_pin_yields) == (None, None, None)
    assert kv.num_free_blocks == 32
