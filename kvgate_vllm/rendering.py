"""Turn a validated prefix query into the exact prompt vLLM would generate from.

Runs in the API server, with the app state vLLM 0.32 builds in ``init_app_state``:
``online_renderer`` (``render_chat(request, skip_mm_cache=True)``,
``render_completion(request, skip_mm_cache=True)``), ``openai_serving_chat`` /
``openai_serving_completion`` (model check and LoRA lookup, as generation does)
and ``openai_serving_models``. Chat bodies are rendered by the same renderer
generation uses (same chat template, tools, ``cache_salt``), so the token ids,
and hence the block hashes, are the ones a real request would have. ``/tokenize``
is not used: it renders slightly differently (no cache_salt or tool_choice handling).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate_vllm.prefix_query import PrefixQuery, ProbeRequestError

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


def _reject_multimodal_messages(body: dict) -> None:
    """400 before rendering, so a probe never downloads or processes media."""
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            part_type = part.get("type", "") if isinstance(part, dict) else ""
            if any(marker in str(part_type) for marker in _MULTIMODAL_PART_MARKERS):
                raise ProbeRequestError(
                    f"multimodal content ('{part_type}') is not supported by the prefix "
                    "probe yet; probe the text-only prompt or its token_ids",
                    param="chat.messages",
                )


def _single_token_input(engine_inputs: list, kind: str) -> RenderedPrompt:
    if len(engine_inputs) != 1:
        raise ProbeRequestError(
            f"the {kind} body renders to {len(engine_inputs)} prompts; the prefix probe "
            "takes exactly one prompt per call",
            param=kind,
        )
    engine_input = engine_inputs[0]
    input_type = engine_input.get("type")
    if input_type != "token":
        raise ProbeRequestError(
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
        raise ProbeRequestError(
            f"the model `{model}` does not exist on this server; valid names: {names}",
            param="model",
        )
    return lora_fields(lora_request)


async def _render_with(serving: Any, request: Any, kind: str, render) -> RenderedPrompt:
    """Model check, rendering and LoRA lookup in the order generation does them."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    if serving is None:
        raise ProbeRequestError(f"this server does not serve {kind} requests", param=kind)
    error = await serving._check_model(request)
    if error is not None:
        raise ProbeRequestError(_error_message(error), param=f"{kind}.model")
    try:
        result = await render(request, skip_mm_cache=True)
    except (ValueError, TypeError, KeyError) as exc:
        raise ProbeRequestError(f"cannot render the {kind} body: {exc}", param=kind) from exc
    if isinstance(result, ErrorResponse):
        raise ProbeRequestError(_error_message(result), param=kind)
    engine_inputs = result[1] if kind == "chat" else result
    rendered = _single_token_input(list(engine_inputs), kind)
    # Chat generation also picks a default multimodal LoRA; completions do not.
    lora = lora_fields(serving._maybe_get_adapters(request, supports_default_mm_loras=kind == "chat"))
    return RenderedPrompt(rendered.token_ids, rendered.cache_salt, lora)


def _validate(model_cls: Any, body: dict, kind: str) -> Any:
    try:
        return model_cls.model_validate(body)
    except (ValueError, TypeError) as exc:  # pydantic.ValidationError is a ValueError
        raise ProbeRequestError(f"invalid {kind} body: {exc}", param=kind) from exc


async def render_prefix_query(state: Any, query: PrefixQuery) -> RenderedPrompt:
    """Token ids, cache salt and LoRA for ``query``, or ``ProbeRequestError`` (400)."""
    if query.kind == "token_ids":
        return RenderedPrompt(
            token_ids=list(query.token_ids or []),
            cache_salt=query.cache_salt,
            lora=_model_lora(state, query.model),
        )
    renderer = state.online_renderer
    if query.kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        _reject_multimodal_messages(query.body or {})
        request = _validate(ChatCompletionRequest, query.body or {}, "chat")
        serving = getattr(state, "openai_serving_chat", None)
        return await _render_with(serving, request, "chat", renderer.render_chat)
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    request = _validate(CompletionRequest, query.body or {}, "completion")
    if request.prompt_embeds is not None:
        raise ProbeRequestError(
            "prompt_embeds are not supported by the prefix probe yet", param="completion"
        )
    serving = getattr(state, "openai_serving_completion", None)
    return await _render_with(serving, request, "completion", renderer.render_completion)
