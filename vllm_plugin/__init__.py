"""kvgate's vLLM plugin: the probe API (docs/reference.md) on every vLLM server.

Two entry points (declared in pyproject.toml), both enabled with ``VLLM_PLUGINS=kvgate``:

- ``vllm.general_plugins: kvgate = kvgate.vllm_plugin.engine_plugin:register`` adds two
  UTILITY methods to vLLM's ``EngineCore`` (``engine_plugin.KV_ANSWER_METHOD`` and
  ``engine_plugin.PREFIX_ANSWER_METHOD``), computed by ``engine_probes``.
- ``vllm.endpoint_plugins: kvgate = kvgate.vllm_plugin.endpoint_plugin:KvgateEndpointPlugin``
  adds ``GET /v1/kvgate/kv``, ``POST /v1/kvgate/prefix`` and ``GET``/``POST
  /v1/kvgate/owner`` to the API server.

Invariant: importing this package (or any module of it except the ones vLLM itself
loads) never imports vLLM, so the proxy's own environment works without vLLM.
"""
