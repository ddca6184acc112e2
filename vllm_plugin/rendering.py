"""Turn a validated prefix query into the exact prompt vLLM would generate from.

Runs in the API server, with the app state vLLM (0.32-0.34) builds at start:
``online_renderer`` (``render_chat(request, skip_mm_cache=True)``,
``render_completion(request, skip_mm_cache=True)``), ``openai_serving_chat`` /
``openai_serving_completion`` (model check and LoRA lookup, as generation does)
and ``openai_serving_models``. Chat bodies are rendered by the same renderer
generation uses (same chat template, tools, ``cache_salt``), so the token ids,
and hence the block hashes, are the ones a real request would have. ``/tokenize``
is not used: it renders slightly differently (no cache_salt or tool_choice handling).

Anthropic and Responses bodies go through vLLM's own serving objects, exactly as
their generation routes do (nothing is reimplemented here):

- ``messages``: ``state.anthropic_serving_messages`` (``AnthropicServingMessages``)
  converts the body to a chat request with ``to_chat_completion_request`` (with the
  server's inline-system merge and disabled-thinking effort, `_disabled_thinking_effort`), which is then rendered
  like a chat body; ``create_messages`` does the same before generating.
- ``responses``: ``state.openai_serving_responses`` (``OpenAIServingResponses``)
  checks the body like ``create_responses``, looks up ``previous_response_id`` in its
  in-memory ``response_store`` (404 when this server does not hold it) and renders
  with ``_render_resolved_response_inputs``, which adds the stored conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.wire.probe_api import PROMPT_TOO_LONG, PrefixQuery, ProbeQueryError

_MULTIMODAL_PART_MARKERS = ("image", "audio", "video", "embeds", "file")


@dataclass(frozen=True)
class RenderedPrompt:
    """What the engine-side probe needs: token ids, cache salt, LoRA identity (a dict
    of ``LoRARequest`` fields, because it crosses the msgpack UTILITY channel)."""

    token_ids: list[int]
    cache_salt: str | None
    lora: dict | None


def lora_fields(lora_request: Any) -> dict | None:
    """The ``LoRARequest`` fields the block hash depends on (name and path), plus its id."""
    if lora_request is None:
        return None
    return {
        "lora_name": lora_request.lora_name,
        "lora_int_id": lora_request.lora_int_id,
        "lora_path": lora_request.lora_path,
    }


def _error_message(error_response: Any) -> str:
    error = getattr(error_response, "error", None)
    return getattr(error, "message", None) or str(error_response)


# vLLM's own words when a prompt exceeds max_model_len: its renderer checks the text's length
# before tokenizing (cheaply) and the token count after, as it does for generation.
_CONTEXT_LENGTH_WORDS = "maximum context length"


def _render_errors() -> tuple[type[BaseException], ...]:
    """What vLLM raises for a body it will not render: Python's own errors, and its client
    errors (`VLLMClientError`, which is not a ValueError; its context-length check raises one)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # a vLLM release without the class
        return (ValueError, TypeError, KeyError)
    return (ValueError, TypeError, KeyError, VLLMClientError)


def _render_refusal(message: str, kind: str) -> ProbeQueryError:
    """The 400 of a body vLLM would not render; `prompt_too_long` when it is longer than the
    server serves (the gate then refuses the turn instead of forwarding it)."""
    if _CONTEXT_LENGTH_WORDS in message:
        return ProbeQueryError(message, param=kind, code=PROMPT_TOO_LONG)
    return ProbeQueryError(message, param=kind)


def _reject_multimodal_parts(items: Any, param: str) -> None:
    """400 before rendering, so a probe never downloads or processes media.

    ``items``: chat messages, Anthropic messages or Responses input items; each one's
    ``content`` list (or the item itself, for Responses) is checked for media parts."""
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        content = item.get("content")
        parts = [item] + (content if isinstance(content, list) else [])
        for part in parts:
            part_type = part.get("type", "") if isinstance(part, dict) else ""
            if any(marker in str(part_type) for marker in _MULTIMODAL_PART_MARKERS):
                raise ProbeQueryError(
                    f"multimodal content ('{part_type}') is not supported by the prefix "
                    "probe yet; probe the text-only prompt or its token_ids",
                    param=param,
                )


def _reject_multimodal_messages(body: dict) -> None:
    _reject_multimodal_parts(body.get("messages"), "chat.messages")


def _single_token_input(engine_inputs: list, kind: str) -> RenderedPrompt:
    if len(engine_inputs) != 1:
        raise ProbeQueryError(
            f"the {kind} body renders to {len(engine_inputs)} prompts; the prefix probe "
            "takes exactly one prompt per call",
            param=kind,
        )
    engine_input = engine_inputs[0]
    input_type = engine_input.get("type")
    if input_type != "token":
        raise ProbeQueryError(
            f"the {kind} body renders to a '{input_type}' input; the prefix probe supports "
            "text/token prompts only (no multimodal or embedding inputs yet)",
            param=kind,
        )
    return RenderedPrompt(
        token_ids=list(engine_input["prompt_token_ids"]),
        cache_salt=engine_input.get("cache_salt"),
        lora=None,
    )


def _model_lora(state: Any, model: str | None) -> dict | None:
    """LoRA identity for a ``model`` name given with raw token ids; 400 if unknown."""
    if not model:
        return None
    models = state.openai_serving_models
    if models.is_base_model(model):
        return None
    lora_request = models.lora_requests.get(model)
    if lora_request is None:
        names = ", ".join(path.name for path in models.base_model_paths)
        raise ProbeQueryError(
            f"the model `{model}` does not exist on this server; valid names: {names}",
            param="model",
        )
    return lora_fields(lora_request)


async def _render_with(
    serving: Any, request: Any, kind: str, render, chat_shaped: bool | None = None
) -> RenderedPrompt:
    """Model check, rendering and LoRA lookup in the order generation does them.

    ``chat_shaped``: ``render`` returns (conversation, engine inputs) as ``render_chat``
    does (default: ``kind == "chat"``)."""
    chat_shaped = kind == "chat" if chat_shaped is None else chat_shaped
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    if serving is None:
        raise ProbeQueryError(f"this server does not serve {kind} requests", param=kind)
    error = await serving._check_model(request)
    if error is not None:
        raise ProbeQueryError(_error_message(error), param=f"{kind}.model")
    try:
        result = await render(request, skip_mm_cache=True)
    except _render_errors() as exc:
        raise _render_refusal(f"cannot render the {kind} body: {exc}", kind) from exc
    if isinstance(result, ErrorResponse):
        raise _render_refusal(_error_message(result), kind)
    engine_inputs = result[1] if chat_shaped else result
    rendered = _single_token_input(list(engine_inputs), kind)
    # Chat generation also picks a default multimodal LoRA; completions do not.
    lora = lora_fields(serving._maybe_get_adapters(request, supports_default_mm_loras=chat_shaped))
    return RenderedPrompt(rendered.token_ids, rendered.cache_salt, lora)


def _validate(model_cls: Any, body: dict, kind: str) -> Any:
    try:
        return model_cls.model_validate(body)
    except (ValueError, TypeError) as exc:  # pydantic.ValidationError is a ValueError
        raise ProbeQueryError(f"invalid {kind} body: {exc}", param=kind) from exc


async def render_prefix_query(state: Any, query: PrefixQuery) -> RenderedPrompt:
    """Token ids, cache salt and LoRA for ``query``, or ``ProbeQueryError`` (400)."""
    if query.kind == "token_ids":
        return RenderedPrompt(
            token_ids=list(query.token_ids or []),
            cache_salt=query.cache_salt,
            lora=_model_lora(state, query.model),
        )
    renderer = state.online_renderer
    if query.kind == "messages":
        return await _render_messages(state, query.body or {})
    if query.kind == "responses":
        return await _render_responses(state, query.body or {})
    if query.kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        _reject_multimodal_messages(query.body or {})
        request = _validate(ChatCompletionRequest, query.body or {}, "chat")
        serving = getattr(state, "openai_serving_chat", None)
        return await _render_with(serving, request, "chat", renderer.render_chat)
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    request = _validate(CompletionRequest, query.body or {}, "completion")
    if request.prompt_embeds is not None:
        raise ProbeQueryError("prompt_embeds are not supported by the prefix probe yet", param="completion")
    serving = getattr(state, "openai_serving_completion", None)
    return await _render_with(serving, request, "completion", renderer.render_completion)


async def _render_messages(state: Any, body: dict) -> RenderedPrompt:
    """An Anthropic body, converted and rendered by vLLM's ``AnthropicServingMessages``
    exactly as ``create_messages`` does before it generates."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    serving = getattr(state, "anthropic_serving_messages", None)
    if serving is None:
        raise ProbeQueryError("this server does not serve Anthropic /v1/messages requests", param="messages")
    _reject_multimodal_parts(body.get("messages"), "messages.messages")
    request = _validate(AnthropicMessagesRequest, body, "messages")
    effort = await _disabled_thinking_effort(serving, request)
    try:
        chat_request = serving.to_chat_completion_request(
            request, merge_inline_system=serving._merge_inline_system, disabled_thinking_effort=effort
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise ProbeQueryError(f"cannot convert the messages body: {exc}", param="messages") from exc
    return await _render_with(serving, chat_request, "messages", state.online_renderer.render_chat, chat_shaped=True)


async def _disabled_thinking_effort(serving: Any, request: Any) -> str:
    """The reasoning effort ``create_messages`` uses for this body's ``thinking``: since vLLM
    0.33 its ``disabled_thinking_effort_resolver`` decides (0.34 also maps ``between_tools``);
    0.32 asks ``_get_disabled_thinking_effort`` for ``thinking.type == "disabled"`` only."""
    resolver = getattr(serving, "disabled_thinking_effort_resolver", None)
    if resolver is not None:
        return await resolver.resolve_for(request)
    if request.thinking is not None and request.thinking.type == "disabled":
        return await serving._get_disabled_thinking_effort()
    return "none"


def _previous_response_not_found(response_id: str) -> ProbeQueryError:
    return ProbeQueryError(
        f"Response with id '{response_id}' not found on this server: vLLM keeps Responses state "
        "in the memory of the server that produced it (and only with VLLM_ENABLE_RESPONSES_API_STORE=1)",
        param="responses.previous_response_id",
        status=404,
    )


async def _render_responses(state: Any, body: dict) -> RenderedPrompt:
    """A Responses body rendered by vLLM's ``OpenAIServingResponses`` as ``create_responses``
    does: model and input checks, the stored ``previous_response_id`` state, the render."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    serving = getattr(state, "openai_serving_responses", None)
    if serving is None:
        raise ProbeQueryError("this server does not serve /v1/responses requests", param="responses")
    _reject_multimodal_parts(body.get("input"), "responses.input")
    request = _validate(ResponsesRequest, body, "responses")
    error = await serving._check_model(request)
    if error is not None:
        raise ProbeQueryError(_error_message(error), param="responses.model")
    error = serving._validate_create_responses_input(request)
    if error is not None:
        raise ProbeQueryError(_error_message(error), param="responses")
    previous = None
    if request.previous_response_id is not None:
        async with serving.response_store_lock:
            previous = serving.response_store.get(request.previous_response_id)
        if previous is None:
            raise _previous_response_not_found(request.previous_response_id)
    try:
        result = await serving._render_resolved_response_inputs(request, previous, skip_mm_cache=True)
    except _render_errors() as exc:
        raise _render_refusal(f"cannot render the responses body: {exc}", "responses") from exc
    if isinstance(result, ErrorResponse):
        raise _render_refusal(_error_message(result), "responses")
    rendered = _single_token_input([result.engine_input], "responses")
    lora = lora_fields(serving._maybe_get_adapters(request))
    return RenderedPrompt(rendered.token_ids, rendered.cache_salt, lora)
