"""``vllm.general_plugins`` entry point: add the probe UTILITY methods to ``EngineCore``.

vLLM loads general plugins in the API server, in every engine core and in every
worker, possibly more than once per process, and a forked engine core inherits
"plugins loaded" from its parent without calling ``register`` again. So
``register`` patches the ``EngineCore`` class itself, unconditionally (whatever
process it runs in) and idempotently (a second call changes nothing).

The API server reaches the methods with
``engine_client.engine_core.call_utility_all_async(KV_USAGE_METHOD)`` and
``(PREFIX_HITS_METHOD, token_ids, cache_salt, lora)``; the engine core runs them on
its main thread between two scheduler steps (``EngineCoreProc._handle_client_request``
dispatches UTILITY requests by ``getattr``), so they never enter a scheduler queue.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

KV_USAGE_METHOD = "kvgate_kv_usage"
PREFIX_HITS_METHOD = "kvgate_prefix_hits"
_PATCH_MARKER = "_kvgate_probes_installed"


def _kv_usage(self) -> dict:
    from kvgate.vllm_plugin.engine_probes import read_kv_usage

    return read_kv_usage(self)


# No annotations on purpose: vLLM converts UTILITY arguments whose annotation is a
# msgspec.Struct class, and these must stay plain lists/str/dicts.
def _prefix_hits(self, token_ids, cache_salt=None, lora=None) -> dict:
    from kvgate.vllm_plugin.engine_probes import count_prefix_hits

    return count_prefix_hits(self, token_ids, cache_salt, lora)


def install_probes(engine_core_cls: type) -> bool:
    """Add the probe methods to ``engine_core_cls``; False if they were already there."""
    if getattr(engine_core_cls, _PATCH_MARKER, False):
        return False
    setattr(engine_core_cls, KV_USAGE_METHOD, _kv_usage)
    setattr(engine_core_cls, PREFIX_HITS_METHOD, _prefix_hits)
    setattr(engine_core_cls, _PATCH_MARKER, True)
    return True


def register() -> None:
    """Entry point: patch ``vllm.v1.engine.core.EngineCore`` (safe to call repeatedly)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError as exc:  # a vLLM without the V1 engine core
        logger.error(
            "kvgate: cannot import vllm.v1.engine.core.EngineCore (%s); the probe "
            "endpoints will answer with an error. kvgate_vllm supports vLLM >=0.32,<0.34.",
            exc,
        )
        return
    if install_probes(EngineCore):
        logger.info("kvgate: probe utility methods installed on EngineCore")
