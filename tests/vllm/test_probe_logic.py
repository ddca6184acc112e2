"""The plugin's pure parts, in the main venv (no vLLM needed, so not marked ``vllm``)."""

from __future__ import annotations

import sys

import pytest

from kvgate.wire.probe_api import KvAnswer, PrefixAnswer, PrefixQuery, ProbeQueryError, merge_kv, merge_prefix


def test_importing_the_plugin_does_not_import_vllm():
    import kvgate.vllm_plugin.endpoint_plugin  # noqa: F401
    import kvgate.vllm_plugin.engine_plugin  # noqa: F401
    import kvgate.vllm_plugin.engine_probes  # noqa: F401
    import kvgate.vllm_plugin.pin_keeper  # noqa: F401
    import kvgate.vllm_plugin.rendering  # noqa: F401

    assert "vllm" not in sys.modules


def test_kv_usage_excludes_the_null_block():
    result = KvAnswer.of_engine(
        num_gpu_blocks=65, num_free_blocks=48, num_cached_blocks=30, block_size=32, num_running=2, num_waiting=1
    )
    assert (result.num_total_blocks, result.num_gpu_blocks) == (64, 65)
    assert result.kv_cache_usage == pytest.approx(16 / 64)
    assert (result.num_running, result.num_waiting, result.version) == (2, 1, 1)


def test_prefix_answer_splits_in_use_and_evictable():
    result = PrefixAnswer.of_engine(total_tokens=100, block_size=32, hit_block_ref_counts=[2, 1, 0], hit_tokens=64)
    assert (result.total_blocks, result.hit_blocks) == (3, 3)
    assert (result.hit_blocks_in_use, result.hit_blocks_evictable) == (2, 1)
    assert result.hit_ratio == 1.0 and result.hit_tokens == 64


def test_prefix_answer_without_a_full_block_has_ratio_zero():
    result = PrefixAnswer.of_engine(total_tokens=31, block_size=32, hit_block_ref_counts=[], hit_tokens=0)
    assert (result.total_blocks, result.hit_ratio) == (0, 0.0)


def test_merge_kv_usage_sums_engines_and_recomputes_usage():
    a = KvAnswer.of_engine(
        num_gpu_blocks=11, num_free_blocks=10, num_cached_blocks=1, block_size=16, num_running=0, num_waiting=0
    )
    b = KvAnswer.of_engine(
        num_gpu_blocks=11, num_free_blocks=0, num_cached_blocks=4, block_size=16, num_running=3, num_waiting=2
    )
    merged = merge_kv([a, b])
    assert merged.num_total_blocks == 20 and merged.num_free_blocks == 10
    assert merged.num_gpu_blocks == 22
    assert merged.kv_cache_usage == pytest.approx(0.5)
    assert (merged.num_running, merged.num_waiting) == (3, 2)
    assert [engine.engine for engine in merged.engines] == [0, 1]
    assert merged.engines[1].kv_cache_usage == 1.0


def test_merge_prefix_reports_the_engine_with_fewest_hits():
    hot = PrefixAnswer.of_engine(total_tokens=128, block_size=32, hit_block_ref_counts=[0, 0, 0, 0], hit_tokens=96)
    cold = PrefixAnswer.of_engine(total_tokens=128, block_size=32, hit_block_ref_counts=[0], hit_tokens=32)
    merged = merge_prefix([hot, cold])
    assert merged.hit_blocks == 1 and merged.hit_ratio == 0.25
    assert [engine.hit_blocks for engine in merged.engines] == [4, 1]


def test_merge_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        merge_kv([])
    with pytest.raises(ValueError):
        merge_prefix([])


def test_parse_token_ids_query():
    query = PrefixQuery.parse({"token_ids": [1, 2, 3], "cache_salt": "s", "model": "m"})
    assert query == PrefixQuery(kind="token_ids", token_ids=[1, 2, 3], cache_salt="s", model="m")


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_parse_request_body_queries(kind):
    body = {"model": "m", "messages": []} if kind == "chat" else {"prompt": "x"}
    assert PrefixQuery.parse({kind: body}) == PrefixQuery(kind=kind, body=body)


@pytest.mark.parametrize(
    "body,param",
    [
        ([1], None),
        ({}, None),
        ({"token_ids": [1], "chat": {}}, None),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, True]}, "token_ids"),
        ({"token_ids": [1, -2]}, "token_ids"),
        ({"token_ids": [1.0]}, "token_ids"),
        ({"token_ids": [1], "cache_salt": 3}, "cache_salt"),
        ({"token_ids": [1], "model": ["m"]}, "model"),
        ({"chat": []}, "chat"),
        ({"completion": "x"}, "completion"),
    ],
)
def test_parse_rejects_bad_bodies_naming_the_field(body, param):
    with pytest.raises(ProbeQueryError) as caught:
        PrefixQuery.parse(body)
    assert caught.value.status == 400 and caught.value.param == param and caught.value.message


def test_token_ids_over_max_model_len_are_refused_before_any_id_is_read():
    assert PrefixQuery.parse({"token_ids": [1, 2, 3]}, max_model_len=3).token_ids == [1, 2, 3]
    # a list whose ids are not even integers: refused for its length, so none was checked
    with pytest.raises(ProbeQueryError) as err:
        PrefixQuery.parse({"token_ids": ["x"] * 4}, max_model_len=3)
    assert (err.value.code, err.value.status) == ("prompt_too_long", 400)


def test_vllms_context_length_refusal_is_prompt_too_long():
    from kvgate.vllm_plugin.rendering import _render_refusal

    too_long = _render_refusal("This model's maximum context length is 2016 tokens. However, ...", "chat")
    assert (too_long.code, too_long.param) == ("prompt_too_long", "chat")
    assert _render_refusal("messages: must be a list", "chat").code == "invalid_request"


class _Thinking:
    def __init__(self, kind: str):
        self.type = kind


class _AnthropicBody:
    def __init__(self, thinking: str | None):
        self.thinking = _Thinking(thinking) if thinking else None


class _Resolver:
    """vLLM >= 0.33's DisabledThinkingEffortResolver: it decides from the whole request."""

    def __init__(self):
        self.asked: list = []

    async def resolve_for(self, request):
        self.asked.append(request)
        return "low" if request.thinking is not None else "none"


class _ServingWithResolver:
    def __init__(self):
        self.disabled_thinking_effort_resolver = _Resolver()


class _ServingWithMethod:
    """vLLM 0.32's AnthropicServingMessages: a method, asked for thinking.type "disabled" only."""

    async def _get_disabled_thinking_effort(self):
        return "minimal"


async def test_the_disabled_thinking_effort_comes_from_the_resolver_since_vllm_0_33():
    from kvgate.vllm_plugin.rendering import _disabled_thinking_effort

    serving = _ServingWithResolver()
    between_tools = _AnthropicBody("between_tools")  # 0.34 maps this one too: the resolver decides
    assert await _disabled_thinking_effort(serving, between_tools) == "low"
    assert await _disabled_thinking_effort(serving, _AnthropicBody(None)) == "none"
    assert serving.disabled_thinking_effort_resolver.asked[0] is between_tools


async def test_the_disabled_thinking_effort_on_vllm_0_32_asks_the_method_for_disabled_only():
    from kvgate.vllm_plugin.rendering import _disabled_thinking_effort

    serving = _ServingWithMethod()
    assert await _disabled_thinking_effort(serving, _AnthropicBody("disabled")) == "minimal"
    assert await _disabled_thinking_effort(serving, _AnthropicBody("enabled")) == "none"
    assert await _disabled_thinking_effort(serving, _AnthropicBody(None)) == "none"
