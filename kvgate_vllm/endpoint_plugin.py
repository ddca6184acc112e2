"""``vllm.endpoint_plugins`` entry point: ``GET /v1/kvgate/kv``, ``POST /v1/kvgate/prefix``
and ``POST /v1/kvgate/release``.

vLLM instantiates ``KvgateEndpointPlugin`` in the API server only, and only when
``kvgate`` is named in ``VLLM_PLUGINS``; it calls ``attach_router(app)`` while
building the app and ``init_state(engine_client, state, args)`` once the engine
client exists. The routes live under ``/v1`` so vLLM's ``--api-key`` guards them, and
they answer only requests carrying the replica key (``kvgate.wire.replica_auth``: 401 otherwise;
every route of the plugin, when ``KVGATE_REPLICA_API_KEY[_FILE]`` is set). A prompt
longer than the server's ``max_model_len`` is refused (400 ``prompt_too_long``) before
the engine is called, ``token_ids`` before a single id is read. The kv answer carries
``max_model_len`` and the vocabulary's ``max_token_bytes`` (read once at start), so a gate
refuses such a prompt without sending it.

Each probe is one UTILITY call per engine (``call_utility_all_async``: under data
parallelism the single-engine call would answer for engine 0 only), bounded by
``KVGATE_PROBE_TIMEOUT_SEC`` (default 5). Status codes: 200 answer; 400 bad body
(OpenAI-shaped error naming the field); 501 the engine cannot answer (prefix
caching off, unsupported vLLM build; a release on a server without the retention
connector, code ``pins_not_kept``); 503 engine error; 504 timeout; 404 a Responses
body whose ``previous_response_id`` this server does not hold.
"""

# No "from __future__ import annotations": FastAPI must see the real ``Request``
# class on the route closures defined in ``attach_router``.
import asyncio
import logging
import os
import time
from dataclasses import replace
from typing import Any

from kvgate.vllm_plugin import jsonio
from kvgate.vllm_plugin.engine_plugin import KV_ANSWER_METHOD, PREFIX_ANSWER_METHOD, RELEASE_METHOD
from kvgate.vllm_plugin.engine_rates import RateMeter, prefill_rate, read_totals
from kvgate.wire.errors import openai_error
from kvgate.wire.kv_pins import RELEASE_PATH, PinError, ReleaseAnswer, ReleaseQuery
from kvgate.wire.owner_record import OWNER_PATH
from kvgate.wire.probe_api import (
    KV_PATH,
    PREFIX_PATH,
    SCHEDULING_POLICIES,
    KvAnswer,
    PrefixAnswer,
    PrefixQuery,
    ProbeAnswerError,
    ProbeQueryError,
    check_prompt_length,
    merge_kv,
    merge_prefix,
)
from kvgate.wire.replica_auth import (
    OPEN_WARNING,
    REPLICA_KEY_HEADER,
    UNAUTHORIZED_MESSAGE,
    allowed,
    replica_key_from_env,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SEC = 5.0
_STATE_ATTR = "kvgate_probes"
_OWNER_ATTR = "kvgate_owner"
_KEY_ATTR = "kvgate_replica_key"


def probe_timeout_sec() -> float:
    """``KVGATE_PROBE_TIMEOUT_SEC`` as a positive float, else the default."""
    raw = os.environ.get("KVGATE_PROBE_TIMEOUT_SEC", "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_TIMEOUT_SEC
    return value if value > 0 else DEFAULT_TIMEOUT_SEC


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    """OpenAI-shaped error with vLLM's type names, as vLLM answers."""
    error_type = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(
        status, "ServiceUnavailableError"
    )
    return openai_error(message, error_type, code, param)


class ProbeUnavailable(RuntimeError):
    """The engine could not answer; ``status`` and ``code`` go to the client."""

    def __init__(self, message: str, status: int, code: str):
        super().__init__(message)
        self.status = status
        self.code = code


class ProbeService:
    """The imperative shell: engine utility calls with a timeout, per-engine merge."""

    def __init__(
        self,
        engine_client: Any,
        state: Any,
        timeout_sec: float,
        max_model_len: int | None = None,
        max_token_bytes: int | None = None,
        scheduling_policy: str | None = None,
    ):
        self.engine_client = engine_client
        self.state = state
        self.timeout_sec = timeout_sec
        self.max_model_len = max_model_len  # longer prompts are refused before the engine sees them
        self.max_token_bytes = max_token_bytes  # read once from the tokenizer's vocabulary (`max_token_bytes`)
        self.scheduling_policy = scheduling_policy  # the server's --scheduling-policy (fcfs | priority)
        self.rates = RateMeter()

    async def _call_all_engines(self, method: str, *args: Any, unsupported: str = "probe_unsupported") -> list[dict]:
        engine_core = getattr(self.engine_client, "engine_core", None)
        if engine_core is None:
            raise ProbeUnavailable("this vLLM server has no engine core to probe", 501, "no_engine")
        if hasattr(engine_core, "call_utility_all_async"):
            call = engine_core.call_utility_all_async(method, *args)
        else:
            call = _as_list(engine_core.call_utility_async(method, *args))
        try:
            results = await asyncio.wait_for(call, self.timeout_sec)
        except TimeoutError as exc:
            raise ProbeUnavailable(
                f"the engine did not answer {method} within {self.timeout_sec}s "
                "(raise KVGATE_PROBE_TIMEOUT_SEC if the engine is busy with long steps)",
                504,
                "probe_timeout",
            ) from exc
        except Exception as exc:  # the engine reports failures as exceptions
            raise ProbeUnavailable(
                f"the engine failed {method}: {exc}. Is the kvgate general plugin loaded in "
                "the engine core? Start vLLM with VLLM_PLUGINS=kvgate.",
                503,
                "engine_error",
            ) from exc
        for result in results:
            if isinstance(result, dict) and "error" in result:
                raise ProbeUnavailable(result["error"], 501, unsupported)
        return list(results)

    async def kv_answer(self) -> KvAnswer:
        merged = merge_kv(_parsed(await self._call_all_engines(KV_ANSWER_METHOD), KvAnswer.parse))
        rates: dict = self.rates.figures()
        try:
            now = time.monotonic()
            if self.rates.due(now):  # reading the registry is most of a kv probe's cost: not on every probe
                rates = self.rates.update(read_totals(), now)
        except Exception:  # the figures are optional: a registry surprise must not fail the probe
            logger.debug("kvgate: could not read vLLM's rate counters", exc_info=True)
        return replace(
            merged,
            prefill_tokens_per_sec=prefill_rate(rates.get("prefill_tokens_per_sec"), merged.token_sec),
            decode_step_sec=rates.get("decode_step_sec"),
            prefill_share=rates.get("prefill_share"),
            max_model_len=self.max_model_len,
            max_token_bytes=self.max_token_bytes,
            scheduling_policy=self.scheduling_policy,
        )

    async def prefix_answer(self, body: object) -> PrefixAnswer:
        from kvgate.vllm_plugin.rendering import render_prefix_query

        query = PrefixQuery.parse(body, self.max_model_len)
        prompt = await render_prefix_query(self.state, query)
        check_prompt_length(len(prompt.token_ids), self.max_model_len)
        results = await self._call_all_engines(PREFIX_ANSWER_METHOD, prompt.token_ids, prompt.cache_salt, prompt.lora)
        return merge_prefix(_parsed(results, PrefixAnswer.parse))

    async def release(self, body: object) -> ReleaseAnswer:
        """End the KV pins of the body's sessions on every engine (a session's pin is on the
        engine that served its turn); what they held, summed. PinError on a bad body."""
        query = ReleaseQuery.parse(body)
        results = await self._call_all_engines(RELEASE_METHOD, list(query.sessions), unsupported="pins_not_kept")
        answers = _parsed(results, ReleaseAnswer.parse)
        return ReleaseAnswer(
            sum(answer.released_sessions for answer in answers), sum(answer.released_blocks for answer in answers)
        )


def scheduling_policy(engine_client: Any, args: Any) -> str | None:
    """The server's ``--scheduling-policy`` (``fcfs`` or ``priority``), from its scheduler
    config, else its arguments; None when neither says (the gate then never asks for priorities)."""
    config = getattr(getattr(engine_client, "vllm_config", None), "scheduler_config", None)
    for value in (getattr(config, "policy", None), getattr(args, "scheduling_policy", None)):
        value = getattr(value, "value", value)  # an enum in some vLLM releases
        if value in SCHEDULING_POLICIES:
            return value
    return None


def max_token_bytes(vocabulary: Any) -> int | None:
    """The most UTF-8 bytes of any token's string in ``vocabulary`` (``tokenizer.get_vocab()``:
    token string -> id), None when it is empty or not a mapping.

    A token's string holds at least as many bytes as the text the token stands for: a
    byte-level BPE writes each byte as one character (1 or 2 bytes in UTF-8), SentencePiece
    writes a space as ``▁`` (3 bytes) and a fallback byte as ``<0x0A>`` (6), and added
    tokens are their own text. So no token stands for more text than this.
    """
    if not isinstance(vocabulary, dict) or not vocabulary:
        return None
    return max((len(token.encode("utf-8")) for token in vocabulary if isinstance(token, str)), default=0) or None


def _vocabulary_bound(engine_client: Any) -> int | None:
    """``max_token_bytes`` of the server's tokenizer, None without one (``--skip-tokenizer-init``)."""
    try:
        tokenizer = getattr(engine_client, "tokenizer", None)
        return max_token_bytes(tokenizer.get_vocab()) if tokenizer is not None else None
    except Exception:  # an unusual tokenizer: the kv answer then goes without the figure
        logger.warning("kvgate: could not read the tokenizer's vocabulary; max_token_bytes unknown", exc_info=True)
        return None


def _parsed(results: list[dict], parse: Any) -> list:
    """The engines' answers, typed; an engine answering something else is a plugin mismatch (503)."""
    try:
        return [parse(result) for result in results]
    except (ProbeAnswerError, PinError) as exc:
        raise ProbeUnavailable(
            f"an engine answered the probe with an invalid answer ({exc}); "
            "the API server and the engine core must run the same kvgate version",
            503,
            "engine_error",
        ) from exc


async def _as_list(awaitable: Any) -> list:
    return [await awaitable]


def _json_response(status: int, payload: dict):
    from starlette.responses import Response

    return Response(content=jsonio.dumps(payload), status_code=status, media_type="application/json")


def _service(request: Any) -> ProbeService | None:
    return getattr(request.app.state, _STATE_ATTR, None)


def _unauthorized(raw_request: Any):
    """The 401 of a request without the replica key, or None when it may use the replica API."""
    key = getattr(raw_request.app.state, _KEY_ATTR, None)
    if allowed(raw_request.headers.get(REPLICA_KEY_HEADER), key):
        return None
    return _json_response(401, error_body(401, UNAUTHORIZED_MESSAGE, "invalid_replica_key"))


def _not_ready():
    return _json_response(503, error_body(503, "the kvgate probes are not initialised yet; retry shortly", "not_ready"))


async def kv_route(raw_request: Any):
    if (refused := _unauthorized(raw_request)) is not None:
        return refused
    service = _service(raw_request)
    if service is None:
        return _not_ready()
    try:
        return _json_response(200, (await service.kv_answer()).to_json())
    except ProbeUnavailable as exc:
        return _json_response(exc.status, error_body(exc.status, str(exc), exc.code))


async def _answer_body(raw_request: Any, answer: Any):
    """A route with a JSON body: the replica key, the service, the body, then ``answer(service,
    body)``'s message; each refusal OpenAI-shaped."""
    if (refused := _unauthorized(raw_request)) is not None:
        return refused
    service = _service(raw_request)
    if service is None:
        return _not_ready()
    try:
        body = jsonio.loads(await raw_request.body())
    except ValueError as exc:
        return _json_response(400, error_body(400, f"the body is not valid JSON: {exc}", "invalid_json"))
    try:
        return _json_response(200, (await answer(service, body)).to_json())
    except ProbeQueryError as exc:
        return _json_response(exc.status, error_body(exc.status, exc.message, exc.code, exc.param))
    except PinError as exc:  # the release body
        return _json_response(400, error_body(400, str(exc), "invalid_request", "sessions"))
    except ProbeUnavailable as exc:
        return _json_response(exc.status, error_body(exc.status, str(exc), exc.code))


async def prefix_route(raw_request: Any):
    return await _answer_body(raw_request, lambda service, body: service.prefix_answer(body))


async def release_route(raw_request: Any):
    return await _answer_body(raw_request, lambda service, body: service.release(body))


def _owner_book(request: Any):
    """The server's owner record, made on first use (conflict detection, kvgate.wire.owner_record).

    Kept in this API server process: with ``--api-server-count`` > 1 each API server
    process has its own record (docs/vllm-plugin.md, limits)."""
    import time

    from kvgate.wire.owner_record import OwnerBook

    book = getattr(request.app.state, _OWNER_ATTR, None)
    if book is None:
        book = OwnerBook(time.monotonic)
        setattr(request.app.state, _OWNER_ATTR, book)
    return book


async def owner_claim_route(raw_request: Any):
    from kvgate.wire.owner_record import OwnerClaimError

    if (refused := _unauthorized(raw_request)) is not None:
        return refused
    try:
        body = jsonio.loads(await raw_request.body())
    except ValueError as exc:
        return _json_response(400, error_body(400, f"the body is not valid JSON: {exc}", "invalid_json"))
    try:
        return _json_response(200, _owner_book(raw_request).claim(body))
    except OwnerClaimError as exc:
        return _json_response(400, error_body(400, exc.message, "invalid_request", exc.param))


async def owner_read_route(raw_request: Any):
    if (refused := _unauthorized(raw_request)) is not None:
        return refused
    return _json_response(200, _owner_book(raw_request).read())


class KvgateEndpointPlugin:
    """The endpoint plugin object vLLM's ``load_endpoint_plugins`` instantiates."""

    name = "kvgate"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter, Request

        # Read once, at start: a key file that cannot be read stops the server here, saying why.
        key = replica_key_from_env(os.environ)
        setattr(app.state, _KEY_ATTR, key)
        if key is None:
            logger.warning(OPEN_WARNING)

        router = APIRouter()

        @router.get(KV_PATH)
        async def kvgate_kv(raw_request: Request):
            return await kv_route(raw_request)

        @router.post(PREFIX_PATH)
        async def kvgate_prefix(raw_request: Request):
            return await prefix_route(raw_request)

        @router.post(RELEASE_PATH)
        async def kvgate_release(raw_request: Request):
            return await release_route(raw_request)

        @router.post(OWNER_PATH)
        async def kvgate_owner_claim(raw_request: Request):
            return await owner_claim_route(raw_request)

        @router.get(OWNER_PATH)
        async def kvgate_owner_read(raw_request: Request):
            return await owner_read_route(raw_request)

        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        if engine_client is None:
            logger.warning("kvgate: no engine client (render-only server); probes disabled")
            return
        max_model_len = getattr(getattr(engine_client, "model_config", None), "max_model_len", None)
        if not isinstance(max_model_len, int):
            max_model_len = getattr(getattr(args, "model_config", None), "max_model_len", None)
        service = ProbeService(
            engine_client,
            state,
            probe_timeout_sec(),
            max_model_len if isinstance(max_model_len, int) else None,
            _vocabulary_bound(engine_client),
            scheduling_policy(engine_client, args),
        )
        setattr(state, _STATE_ATTR, service)
        logger.info("kvgate: probe endpoints %s and %s ready", KV_PATH, PREFIX_PATH)
