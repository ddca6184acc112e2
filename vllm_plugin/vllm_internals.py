"""Every vLLM internal the plugin touches, in one table: ``TOUCHED``.

The plugin's modules reach into vLLM (engine core, scheduler, KV cache manager,
serving classes, the app state). Those internals change between minor releases, so
they are listed here, declaratively, and ``compat_check`` verifies each one against
the Python sources of every supported release's wheel (statically: no vLLM install,
no import). ``tests/vllm_plugin/test_vllm_internals_table.py`` checks that the plugin code
references nothing from vLLM this table does not name.

An entry names a module and a dotted name in it:

- ``Symbol``: a class or function the plugin imports or relies on;
- ``Member``: an attribute or method of a class (class body, ``self.x = ...`` in a
  method, or a base class);
- ``Call``: a class, function or method the plugin calls, with the call's shape
  (positional count, keyword names, the length of a returned tuple it unpacks);
- ``Assigned``: an attribute the module assigns (``state.openai_serving_chat = ...``);
- ``Text``: a string the module must contain (a metric name the plugin reads).

``releases`` limits an entry to [low, high) minor releases, for version-dependent
code paths (e.g. ``rendering._disabled_thinking_effort``). Pure data; imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

Release = tuple[int, int]
ANY_RELEASE: tuple[Release, Release] = ((0, 0), (999, 0))


@dataclass(frozen=True)
class Symbol:
    module: str
    name: str
    used_by: str
    releases: tuple[Release, Release] = ANY_RELEASE


@dataclass(frozen=True)
class Member:
    module: str
    name: str  # "Class.member"
    used_by: str
    releases: tuple[Release, Release] = ANY_RELEASE


@dataclass(frozen=True)
class Call:
    """``name`` (a function, a class: its constructor, or "Class.method") must accept a
    call with ``positional`` positional arguments and ``keywords``; when ``returns`` is
    set and the definition annotates a ``tuple[...]`` return, it has that many items."""

    module: str
    name: str
    used_by: str
    positional: int = 0
    keywords: tuple[str, ...] = ()
    returns: int | None = None
    releases: tuple[Release, Release] = ANY_RELEASE


@dataclass(frozen=True)
class Assigned:
    module: str
    name: str  # "state.openai_serving_chat": an assignment to that attribute of that name
    used_by: str
    releases: tuple[Release, Release] = ANY_RELEASE


@dataclass(frozen=True)
class Text:
    module: str
    name: str  # the string
    used_by: str
    releases: tuple[Release, Release] = ANY_RELEASE


Internal = Symbol | Member | Call | Assigned | Text

CORE = "vllm.v1.engine.core"
SCHEDULER = "vllm.v1.core.sched.scheduler"
KV_MANAGER = "vllm.v1.core.kv_cache_manager"
BLOCK_POOL = "vllm.v1.core.block_pool"
COORDINATOR = "vllm.v1.core.kv_cache_coordinator"
REQUEST = "vllm.v1.request"
ASYNC_LLM = "vllm.v1.engine.async_llm"
CORE_CLIENT = "vllm.v1.engine.core_client"
ENDPOINT_PLUGINS = "vllm.plugins.endpoint_plugins.interface"
ERRORS = "vllm.entrypoints.serve.engine.protocol"
BASE_SERVING = "vllm.entrypoints.serve.engine.serving"
RENDERER = "vllm.renderers.online_renderer"
MODELS = "vllm.entrypoints.openai.models.serving"
CHAT = "vllm.entrypoints.openai.chat_completion.protocol"
COMPLETION = "vllm.entrypoints.openai.completion.protocol"
ANTHROPIC = "vllm.entrypoints.anthropic.serving"
ANTHROPIC_PROTOCOL = "vllm.entrypoints.anthropic.protocol"
RESPONSES = "vllm.entrypoints.openai.responses.serving"
RESPONSES_PROTOCOL = "vllm.entrypoints.openai.responses.protocol"
APP_STATE = "vllm.entrypoints.launchers.api_server.app_state"
GENERATE_ROUTES = "vllm.entrypoints.generate.api_router"
METRICS = "vllm.v1.metrics.loggers"
CONNECTOR_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
KV_UTILS = "vllm.v1.core.kv_cache_utils"

_PLUGIN = "engine_plugin.install_probes"
_KV = "engine_probes.kv_answer"
_PREFIX = "engine_probes.prefix_answer"
_BUILD = "engine_probes.build_probe_request"
_SERVICE = "endpoint_plugin.ProbeService"
_INIT = "endpoint_plugin.KvgateEndpointPlugin.init_state"
_RENDER = "rendering.render_prefix_query"
_WITH = "rendering._render_with"
_MESSAGES = "rendering._render_messages"
_RESPONSES = "rendering._render_responses"
_RATES = "engine_rates.SAMPLES"
_EFFORT = "rendering._disabled_thinking_effort"
_UP_TO_0_32: tuple[Release, Release] = ((0, 0), (0, 33))
_SINCE_0_33: tuple[Release, Release] = ((0, 33), ANY_RELEASE[1])
_LORA_FIELDS = ("lora_name", "lora_int_id", "lora_path")  # read in the API server, rebuilt in the engine

ENGINE_CORE: tuple[Internal, ...] = (
    Symbol(CORE, "EngineCore", "engine_plugin.register"),
    Call(CORE, "EngineCore.step", _PLUGIN),  # wrapped, timed
    Member(CORE, "EngineCore.scheduler", _KV),
    Member(CORE, "EngineCore.request_block_hasher", _PREFIX),
    # UTILITY requests reach the probe methods by name (getattr on the engine core).
    Member(CORE, "EngineCoreProc._handle_client_request", _PLUGIN),
    Call(SCHEDULER, "Scheduler.schedule", _PLUGIN),
    Member("vllm.v1.core.sched.output", "SchedulerOutput.total_num_scheduled_tokens", _PLUGIN),
    Member(SCHEDULER, "Scheduler.kv_cache_manager", _KV),
    Member(SCHEDULER, "Scheduler.block_size", _KV),
    Call(SCHEDULER, "Scheduler.get_request_counts", _KV, returns=2),
    Member(KV_MANAGER, "KVCacheManager.block_pool", _KV),
    Member(KV_MANAGER, "KVCacheManager.enable_caching", _PREFIX),
    Member(KV_MANAGER, "KVCacheManager.coordinator", _PREFIX),
    Member(BLOCK_POOL, "BlockPool.num_gpu_blocks", _KV),
    Call(BLOCK_POOL, "BlockPool.get_num_free_blocks", _KV),
    Member(BLOCK_POOL, "BlockPool.cached_block_hash_to_block", _KV),
    Call(COORDINATOR, "KVCacheCoordinator.find_longest_cache_hit", _PREFIX, positional=2, returns=3),
    Member("vllm.v1.core.kv_cache_utils", "KVCacheBlock.ref_cnt", _PREFIX),
    Call(
        REQUEST,
        "Request",
        _BUILD,
        keywords=(
            "request_id",
            "prompt_token_ids",
            "sampling_params",
            "pooling_params",
            "lora_request",
            "cache_salt",
            "block_hasher",
        ),
    ),
    Member(REQUEST, "Request.block_hashes", _PREFIX),
    Member(REQUEST, "Request.num_tokens", _PREFIX),
    Call("vllm.sampling_params", "SamplingParams", _BUILD, keywords=("max_tokens",)),
    Call("vllm.lora.request", "LoRARequest", _BUILD, keywords=_LORA_FIELDS),
)

API_SERVER: tuple[Internal, ...] = (
    # vLLM's side of the endpoint plugin: what it calls on KvgateEndpointPlugin.
    Member(ENDPOINT_PLUGINS, "EndpointPlugin.required_tasks", "endpoint_plugin.KvgateEndpointPlugin"),
    Call(ENDPOINT_PLUGINS, "EndpointPlugin.attach_router", "endpoint_plugin.KvgateEndpointPlugin", positional=1),
    Call(ENDPOINT_PLUGINS, "EndpointPlugin.init_state", "endpoint_plugin.KvgateEndpointPlugin", positional=3),
    Member(ASYNC_LLM, "AsyncLLM.engine_core", _SERVICE),
    Member(ASYNC_LLM, "AsyncLLM.vllm_config", "endpoint_plugin.scheduling_policy"),
    Member(ASYNC_LLM, "AsyncLLM.model_config", _INIT),
    Member(ASYNC_LLM, "AsyncLLM.tokenizer", "endpoint_plugin._vocabulary_bound"),
    Member("vllm.config.vllm", "VllmConfig.scheduler_config", "endpoint_plugin.scheduling_policy"),
    Member("vllm.config.scheduler", "SchedulerConfig.policy", "endpoint_plugin.scheduling_policy"),
    Member("vllm.config.model", "ModelConfig.max_model_len", _INIT),
    Call("vllm.tokenizers.protocol", "TokenizerLike.get_vocab", "endpoint_plugin._vocabulary_bound"),
    Call(CORE_CLIENT, "AsyncMPClient.call_utility_all_async", _SERVICE, positional=4),
    Call(CORE_CLIENT, "AsyncMPClient.call_utility_async", _SERVICE, positional=4),
    *(Text(METRICS, metric, _RATES) for metric in ("vllm:prompt_tokens", "vllm:prefix_cache_hits")),
    *(Text(METRICS, metric, _RATES) for metric in ("vllm:generation_tokens", "vllm:request_prefill_time_seconds")),
    Text(METRICS, "vllm:request_decode_time_seconds", _RATES),
)

RENDERING: tuple[Internal, ...] = (
    Symbol("vllm.exceptions", "VLLMClientError", "rendering._render_errors"),
    Symbol(ERRORS, "ErrorResponse", _WITH),
    Member(ERRORS, "ErrorResponse.error", "rendering._error_message"),
    Member(ERRORS, "ErrorInfo.message", "rendering._error_message"),
    *(Member("vllm.lora.request", f"LoRARequest.{field}", "rendering.lora_fields") for field in _LORA_FIELDS),
    Assigned(APP_STATE, "state.online_renderer", _RENDER),
    Assigned(APP_STATE, "state.openai_serving_models", "rendering._model_lora"),
    Assigned(GENERATE_ROUTES, "state.openai_serving_chat", _RENDER),
    Assigned(GENERATE_ROUTES, "state.openai_serving_completion", _RENDER),
    Assigned(GENERATE_ROUTES, "state.anthropic_serving_messages", _MESSAGES),
    Assigned(GENERATE_ROUTES, "state.openai_serving_responses", _RESPONSES),
    Call(RENDERER, "OnlineRenderer.render_chat", _WITH, positional=1, keywords=("skip_mm_cache",)),
    Call(RENDERER, "OnlineRenderer.render_completion", _WITH, positional=1, keywords=("skip_mm_cache",)),
    Call(MODELS, "OpenAIServingModels.is_base_model", "rendering._model_lora", positional=1),
    Member(MODELS, "OpenAIServingModels.lora_requests", "rendering._model_lora"),
    Member(MODELS, "OpenAIServingModels.base_model_paths", "rendering._model_lora"),
    Member("vllm.entrypoints.openai.models.protocol", "BaseModelPath.name", "rendering._model_lora"),
    Call(BASE_SERVING, "BaseServing._check_model", _WITH, positional=1),
    Call(BASE_SERVING, "BaseServing._maybe_get_adapters", _WITH, positional=1, keywords=("supports_default_mm_loras",)),
    Symbol(CHAT, "ChatCompletionRequest", _RENDER),
    Symbol(COMPLETION, "CompletionRequest", _RENDER),
    Member(COMPLETION, "CompletionRequest.prompt_embeds", _RENDER),
    Symbol(ANTHROPIC_PROTOCOL, "AnthropicMessagesRequest", _MESSAGES),
    Member(ANTHROPIC_PROTOCOL, "AnthropicMessagesRequest.thinking", _MESSAGES),
    Call(
        ANTHROPIC,
        "AnthropicServingMessages.to_chat_completion_request",
        _MESSAGES,
        positional=1,
        keywords=("merge_inline_system", "disabled_thinking_effort"),
    ),
    Member(ANTHROPIC, "AnthropicServingMessages._merge_inline_system", _MESSAGES),
    # The effort for thinking.type "disabled": a method up to 0.32, a resolver object since 0.33.
    Call(ANTHROPIC, "AnthropicServingMessages._get_disabled_thinking_effort", _EFFORT, releases=_UP_TO_0_32),
    Member(ANTHROPIC, "AnthropicServingMessages.disabled_thinking_effort_resolver", _EFFORT, releases=_SINCE_0_33),
    Call(ANTHROPIC, "DisabledThinkingEffortResolver.resolve_for", _EFFORT, positional=1, releases=_SINCE_0_33),
    Symbol(RESPONSES_PROTOCOL, "ResponsesRequest", _RESPONSES),
    Member(RESPONSES_PROTOCOL, "ResponsesRequest.previous_response_id", _RESPONSES),
    Call(RESPONSES, "OpenAIServingResponses._check_model", _RESPONSES, positional=1),
    Call(RESPONSES, "OpenAIServingResponses._validate_create_responses_input", _RESPONSES, positional=1),
    Member(RESPONSES, "OpenAIServingResponses.response_store", _RESPONSES),
    Member(RESPONSES, "OpenAIServingResponses.response_store_lock", _RESPONSES),
    Call(
        RESPONSES,
        "OpenAIServingResponses._render_resolved_response_inputs",
        _RESPONSES,
        positional=2,
        keywords=("skip_mm_cache",),
    ),
    Member(RENDERER, "ResponsesRenderResult.engine_input", _RESPONSES),
    Call(RESPONSES, "OpenAIServingResponses._maybe_get_adapters", _RESPONSES, positional=1),
)

_CONNECTOR = "retention_connector.KvgateRetentionConnector"
_KEEPER = "pin_keeper.PinKeeper"
_PIN_ROUTES = "gate.pins.PIN_ROUTE_KINDS (the gate's pins, as kv_transfer_params.kvgate_pin)"
_BASE = "KVConnectorBase_V1"

RETENTION: tuple[Internal, ...] = (
    # vLLM loads the connector by module path and builds it with three arguments.
    Text("vllm.distributed.kv_transfer.kv_connector.factory", "kv_connector_module_path", _CONNECTOR),
    Symbol(CONNECTOR_BASE, _BASE, _CONNECTOR),
    Symbol(CONNECTOR_BASE, "KVConnectorMetadata", "retention_connector.KvgateRetentionMetadata"),
    Call(CONNECTOR_BASE, _BASE, _CONNECTOR, positional=3),
    Member(CONNECTOR_BASE, f"{_BASE}.requires_kv_delivery", _CONNECTOR),
    # What the scheduler calls on it (the abstract methods and the two hooks it uses).
    Call(CONNECTOR_BASE, f"{_BASE}.bind_kv_cache_manager", _CONNECTOR, positional=1),
    Call(CONNECTOR_BASE, f"{_BASE}.get_num_new_matched_tokens", _CONNECTOR, positional=2, returns=2),
    Call(CONNECTOR_BASE, f"{_BASE}.update_state_after_alloc", _CONNECTOR, positional=3),
    Call(CONNECTOR_BASE, f"{_BASE}.build_connector_meta", _CONNECTOR, positional=1),
    Call(CONNECTOR_BASE, f"{_BASE}.request_finished", _CONNECTOR, positional=2, returns=2),
    Call(CONNECTOR_BASE, f"{_BASE}.start_load_kv", _CONNECTOR, positional=1),
    Call(CONNECTOR_BASE, f"{_BASE}.wait_for_layer_load", _CONNECTOR, positional=1),
    Call(CONNECTOR_BASE, f"{_BASE}.save_kv_layer", _CONNECTOR, positional=3),
    Call(CONNECTOR_BASE, f"{_BASE}.wait_for_save", _CONNECTOR),
    Member(REQUEST, "Request.kv_transfer_params", _CONNECTOR),
    # The gate's pin rides in the body's kv_transfer_params on every prompt route.
    Member(CHAT, "ChatCompletionRequest.kv_transfer_params", _PIN_ROUTES),
    Member(COMPLETION, "CompletionRequest.kv_transfer_params", _PIN_ROUTES),
    Member(ANTHROPIC_PROTOCOL, "AnthropicMessagesRequest.kv_transfer_params", _PIN_ROUTES),
    Member(RESPONSES_PROTOCOL, "ResponsesRequest.kv_transfer_params", _PIN_ROUTES),
    # Pins are references in the scheduler's block pool; allocations that fail yield them.
    Call(KV_MANAGER, "KVCacheManager.allocate_slots", "pin_keeper.PinKeeper.yielding", positional=2),
    Member(BLOCK_POOL, "BlockPool.blocks", _KEEPER),
    Call(BLOCK_POOL, "BlockPool.touch", _KEEPER, positional=1),
    Call(BLOCK_POOL, "BlockPool.free_blocks", _KEEPER, positional=1),
    Member(KV_UTILS, "KVCacheBlock.is_null", _KEEPER),
    Member(KV_UTILS, "KVCacheBlock.block_hash", _KEEPER),
    # The engine core's utility methods find the keeper through the scheduler's connector.
    Member(SCHEDULER, "Scheduler.connector", "pin_keeper.keeper_of"),
    Member(
        "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector",
        "MultiConnector._connectors",
        "pin_keeper.keeper_of",
    ),
)

_TIER = "cpu_tier.cpu_tier_of"
_HELD = "cpu_tier.capacity_figures"
_RUN = "cpu_tier.cpu_run_blocks"
_OFFLOAD = "vllm.distributed.kv_transfer.kv_connector.v1.offloading"
OFFLOAD_BASE = "vllm.v1.kv_offload.base"
CPU_MANAGER = "vllm.v1.kv_offload.cpu.manager"
KV_SPECS = "vllm.v1.kv_cache_interface"

CPU_TIER: tuple[Internal, ...] = (
    # --kv-offloading-size makes the kv_transfer_config an OffloadingConnector with cpu_bytes_to_use.
    Text("vllm.config.vllm", "OffloadingConnector", "docs/vllm-plugin.md CPU tier"),
    Text("vllm.v1.kv_offload.cpu.spec", "cpu_bytes_to_use", "docs/vllm-plugin.md CPU tier"),
    # The connector's scheduler side, found as the scheduler's connector or a MultiConnector child.
    Member(f"{_OFFLOAD}_connector", "OffloadingConnector.connector_scheduler", "cpu_tier.offloading_scheduler_of"),
    Member(f"{_OFFLOAD}.scheduler", "OffloadingConnectorScheduler.manager", _TIER),
    Member(f"{_OFFLOAD}.scheduler", "OffloadingConnectorScheduler.config", _TIER),
    Member(f"{_OFFLOAD}.scheduler", "SchedulerOffloadConfig.kv_group_configs", _TIER),
    *(
        Member(f"{_OFFLOAD}.scheduler", f"GroupOffloadConfig.{field}", _TIER)
        for field in ("group_idx", "tokens_per_block", "tokens_per_chunk", "hashes_per_chunk")
    ),
    # The CPU manager (or a tiering manager's primary CPU tier): read-only lookups and chunk counts.
    Member("vllm.v1.kv_offload.tiering.manager", "TieringOffloadingManager.primary_tier", "cpu_tier._cpu_manager"),
    Call(CPU_MANAGER, "CPUOffloadingManager.lookup", _RUN, positional=2),
    *(
        Member(CPU_MANAGER, f"CPUOffloadingManager.{field}", _HELD)
        for field in ("_num_chunks", "_num_allocated_chunks", "_free_list")
    ),
    Call(OFFLOAD_BASE, "make_offload_key", "engine_probes.hit_blocks_cpu", positional=2),
    Call(OFFLOAD_BASE, "ReqContext", "engine_probes.hit_blocks_cpu", keywords=("req_id",)),
    *(Member(OFFLOAD_BASE, f"LookupResult.{name}", _RUN) for name in ("HIT", "HIT_PENDING")),
    # One block's KV bytes on one worker, from the scheduler's KV cache config.
    Member(SCHEDULER, "Scheduler.kv_cache_config", "cpu_tier._bytes_per_block"),
    Member(KV_SPECS, "KVCacheConfig.kv_cache_groups", "cpu_tier._bytes_per_block"),
    Member(KV_SPECS, "KVCacheGroupSpec.kv_cache_spec", "cpu_tier._bytes_per_block"),
    Member(KV_SPECS, "KVCacheGroupSpec.layer_names", "cpu_tier._bytes_per_block"),
    Member(KV_SPECS, "AttentionSpec.page_size_bytes", "cpu_tier._bytes_per_block"),
    Symbol(KV_SPECS, "UniformTypeKVCacheSpecs", "cpu_tier._is_uniform_wrapper"),
)

TOUCHED: tuple[Internal, ...] = ENGINE_CORE + API_SERVER + RENDERING + RETENTION + CPU_TIER


def applies(entry: Internal, release: Release) -> bool:
    """Whether the plugin relies on ``entry`` on vLLM ``release`` (major, minor)."""
    low, high = entry.releases
    return low <= release < high
