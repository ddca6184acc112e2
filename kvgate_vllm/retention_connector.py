"""The retention connector: vLLM keeps a session's window of KV blocks between its turns.

Loaded by vLLM itself (never imported by kvgate), with::

    --kv-transfer-config '{"kv_connector":"KvgateRetentionConnector",
      "kv_connector_module_path":"kvgate.vllm_plugin.retention_connector","kv_role":"kv_producer"}'

(``pin_keeper.CONNECTOR_CONFIG``). It transfers no KV: it only holds references in the
scheduler's own block pool (docs/decisions/kv-pins-connector.md says why this way):

- ``request_finished``: a turn whose ``kv_transfer_params`` names a valid ``kvgate_pin``
  pins its full, cached blocks (``PinKeeper.finished``); the blocks are freed as usual
  (no delayed free), the pin's own reference keeps them resident;
- ``bind_kv_cache_manager``: makes the engine's ``PinKeeper`` and wraps this manager's
  ``allocate_slots`` (on the instance) so that an allocation that does not fit yields
  pins, least recently pinned first, and retries, before the scheduler would preempt a
  running request or leave a waiting one waiting (``PinKeeper.yielding``);
- ``build_connector_meta`` (once per scheduler step): ends pins whose ttl passed.

The worker side does nothing. The replica key (``KVGATE_REPLICA_API_KEY[_FILE]``) is read
once, in the scheduler; a pin must carry its proof (`kvgate.wire.kv_pins`).
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

from kvgate.vllm_plugin.pin_keeper import PinKeeper
from kvgate.wire.replica_auth import replica_key_from_env


class KvgateRetentionMetadata(KVConnectorMetadata):
    """What the scheduler side tells the workers each step: nothing."""


class KvgateRetentionConnector(KVConnectorBase_V1):
    """Keeps KV pins in the block pool; no transfer (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        self.kvgate_pins: PinKeeper | None = None  # pin_keeper.KEEPER_ATTR; made in the scheduler only

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off: a preempted request's output needs no special care

    # ---------------------------------------------------------------- scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        keeper = PinKeeper(kv_cache_manager.block_pool, replica_key_from_env(os.environ))
        kv_cache_manager.allocate_slots = keeper.yielding(kv_cache_manager.allocate_slots)
        self.kvgate_pins = keeper

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # no external KV: hits on pinned blocks are vLLM's own prefix-cache hits

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.kvgate_pins is not None:
            self.kvgate_pins.expire()
        return KvgateRetentionMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.kvgate_pins is not None:
            self.kvgate_pins.finished(request.kv_transfer_params, block_ids)
        return False, None

    # ---------------------------------------------------------------- worker side: nothing to move

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
