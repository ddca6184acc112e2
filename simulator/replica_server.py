"""The simulated vLLM replica: the real-time engine model behind vLLM's HTTP surface.

Routes (docs/ARCHITECTURE.md seam 3): POST /v1/chat/completions, POST /v1/completions
(streaming and not), POST /v1/messages (Anthropic, as vLLM serves it), POST /v1/responses
(streaming and not, with `previous_response_id` state held in this replica's memory),
GET /v1/models, GET /health, GET /metrics, the probe API (`kvgate.wire.probe_api`,
docs/reference.md), answered from the engine model without side effects, the owner
record (`kvgate.wire.owner_record`), and KV pins (`kvgate.wire.kv_pins`): a generation
body's `kv_transfer_params.kvgate_pin`, proved with the replica key, pins its session's
blocks when the turn ends; `POST /v1/kvgate/release` (guarded like the probe API) ends them.

A client that disconnects aborts its request in the engine: streaming handlers see the
failed write, non-streaming handlers are cancelled (the runner is built with
`handler_cancellation=True`); either way the `finally` aborts the request, freeing its blocks,
and the failed write is not logged as an error (`client_gone_middleware`).

Entry points: `build_replica_app(...)` (one app, for tests and benchmarks),
`SimulatedReplica.start(...)` (one bound server) and `start_simulated_replicas(count)`
(seam 2, used by `kvgate serve`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, replace

import orjson
from aiohttp import web

from kvgate.simulator import anthropic_api, responses_api
from kvgate.simulator.async_engine import AsyncEngine, RequestHandle
from kvgate.simulator.config import CostModel, EngineConfig
from kvgate.simulator.openai_api import (
    ApiError,
    GenerationParams,
    chat_chunk,
    chat_response,
    chat_tool_call_delta,
    completion_chunk,
    completion_response,
    models_response,
    parse_generation,
    render_prompt,
    usage,
    usage_chunk,
)
from kvgate.simulator.replica_metrics import CONTENT_TYPE, render_metrics
from kvgate.simulator.reply_model import ReplyModel, ReplyPlan, arguments_slice, plan_reply
from kvgate.simulator.tokenizer import MAX_TOKEN_BYTES, VOCAB_SIZE, decode_token
from kvgate.wire.kv_pins import RELEASE_PATH, TRANSFER_PARAMS_FIELD, Pin, PinError, ReleaseQuery, pin_of
from kvgate.wire.owner_record import OWNER_PATH, OwnerBook, OwnerClaimError
from kvgate.wire.probe_api import (
    KV_PATH,
    PREFIX_PATH,
    PrefixQuery,
    ProbeQueryError,
    check_prompt_length,
    merge_kv,
    merge_prefix,
)
from kvgate.wire.replica_auth import REPLICA_KEY_HEADER, UNAUTHORIZED_MESSAGE, allowed
from kvgate.wire.routes import REPLICA_API_PREFIX

DEFAULT_MODEL_NAME = "kvgate-sim"
MAX_BODY_BYTES = 64 * 1024 * 1024
ENGINE_CONFIG_KEYS = (
    "num_blocks",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "scheduling_policy",
    "cpu_blocks",
)
APP_OPTION_KEYS = ("time_scale", "cost_model", "model_name", "replica_api_key", "reply_model")


@dataclass(frozen=True)
class ReplicaInfo:
    model_name: str
    created: int
    replica_key: str | None = None  # proves KV pins (`kvgate.wire.kv_pins`); None: any pin goes


ENGINE_KEY = web.AppKey("kvgate_sim_engine", AsyncEngine)
INFO_KEY = web.AppKey("kvgate_sim_info", ReplicaInfo)
RESPONSES_KEY = web.AppKey("kvgate_sim_responses", responses_api.ResponseStore)
REPLY_KEY = web.AppKey("kvgate_sim_reply", ReplyModel)


def _json(body, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error(error: ApiError) -> web.Response:
    return _json(error.body(), status=error.status)


async def _read_json(request: web.Request):
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}") from None


# -- generation -------------------------------------------------------------------------


def _text(token_ids: list[int]) -> str:
    return "".join(decode_token(token) for token in token_ids)


async def _until_finished(handle: RequestHandle) -> None:
    while not handle.finished:
        await handle.changed.wait()
        handle.changed.clear()


def _error_for(kind: str, error: ApiError) -> web.Response:
    body = anthropic_api.anthropic_error_body(error) if kind == "messages" else error.body()
    return _json(body, status=error.status)


def _parse(kind: str, body, model_name: str, max_model_len: int) -> GenerationParams:
    if kind == "messages":
        return anthropic_api.parse_messages(body, model_name, max_model_len)
    return parse_generation(kind, body, model_name, max_model_len)


def _pin(app: web.Application, body) -> Pin | None:
    """The KV pin a generation body carries in `kv_transfer_params`, if it is well formed and
    proved with this replica's key; otherwise the turn is served unpinned (`wire.kv_pins`)."""
    if not isinstance(body, dict):
        return None
    try:
        pin = pin_of(body.get(TRANSFER_PARAMS_FIELD))
    except PinError:
        return None
    return pin if pin is not None and pin.valid_for(app[INFO_KEY].replica_key) else None


def _start(app: web.Application, params: GenerationParams, body) -> tuple[ReplyPlan, RequestHandle]:
    """Plan the reply (`reply_model`) and queue its tokens in the engine, with the body's pin."""
    plan = plan_reply(
        app[REPLY_KEY],
        params.prompt_token_ids,
        params.max_tokens,
        params.offer,
        params.fixed_length,
        params.max_tokens_given,
        params.min_tokens,
    )
    engine = app[ENGINE_KEY]
    return plan, engine.add_request(
        params.prompt_token_ids, plan.tokens, params.cache_salt, params.priority, _pin(app, body)
    )


class ReplyPieces:
    """What a stream shows of a reply as its tokens are generated: their text, or the
    matching share of the tool call's arguments (`reply_model.arguments_slice`)."""

    def __init__(self, plan: ReplyPlan, handle: RequestHandle) -> None:
        self.plan = plan
        self.request = handle.request
        self.sent = 0

    def next(self) -> str:
        tokens = self.request.output_token_ids
        now, sent = len(tokens), self.sent
        self.sent = now
        call = self.plan.tool_call
        if call is None:
            return _text(tokens[sent:now])
        return arguments_slice(call, sent, now, self.plan.tokens)


ABORTED = ApiError("the request was aborted: the replica is shutting down", 503, "ServiceUnavailableError")
ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-", "messages": "msg_"}


def _finished_body(kind: str, params: GenerationParams, plan: ReplyPlan, handle: RequestHandle, ids, block_size: int):
    request_id, created = ids
    sim_request = handle.request
    text = _text(sim_request.output_token_ids)
    prompt, output, cached = (
        sim_request.num_prompt_tokens,
        sim_request.num_output_tokens,
        sim_request.num_cached_prompt_tokens,
    )
    if kind == "messages":
        message_usage = anthropic_api.message_usage(prompt, output, cached, block_size)
        return anthropic_api.message_response(
            request_id, params.model, text, plan.finish_reason, message_usage, plan.tool_call
        )
    if kind == "chat":
        return chat_response(
            request_id, created, params.model, text, plan.finish_reason, usage(prompt, output, cached), plan.tool_call
        )
    return completion_response(
        request_id, created, params.model, text, plan.finish_reason, usage(prompt, output, cached)
    )


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    info = request.app[INFO_KEY]
    try:
        body = await _read_json(request)
        params = _parse(kind, body, info.model_name, engine.config.effective_max_model_len)
        plan, handle = _start(request.app, params, body)
    except ApiError as error:
        return _error_for(kind, error)
    except ValueError as error:
        return _error_for(kind, ApiError(str(error)))
    request_id = ID_PREFIX[kind] + uuid.uuid4().hex
    created = int(time.time())
    try:
        if params.stream:
            return await _stream(request, params, plan, handle, request_id, created)
        await _until_finished(handle)
        if handle.finish_reason == "abort":
            return _error_for(kind, ABORTED)
        return _json(_finished_body(kind, params, plan, handle, (request_id, created), engine.config.block_size))
    finally:
        if not handle.finished:
            engine.abort(handle.request.request_id)


def _sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _opening_events(params: GenerationParams, plan: ReplyPlan, request_id: str, created: int) -> list[bytes]:
    if params.kind == "messages":
        return anthropic_api.stream_opening(request_id, params.model, len(params.prompt_token_ids), plan.tool_call)
    if params.kind == "chat":
        return [_sse(chat_chunk(request_id, created, params.model, {"role": "assistant", "content": ""}, None))]
    return []


def _delta_events(
    params: GenerationParams, plan: ReplyPlan, request_id: str, created: int, piece: str, first: bool, last: bool
) -> list[bytes]:
    """Events for the next `piece` of the reply (`ReplyPieces`); the last chat or
    completion chunk carries the finish reason."""
    call = plan.tool_call
    finish_reason = plan.finish_reason if last else None
    if params.kind == "messages":
        if not piece:
            return []
        return [anthropic_api.stream_json_delta(piece) if call else anthropic_api.stream_delta(piece)]
    if params.kind == "chat":
        if call is not None:
            delta = chat_tool_call_delta(call, piece, first) if piece or first else {}
        else:
            delta = {"content": piece} if piece else {}
        return [_sse(chat_chunk(request_id, created, params.model, delta, finish_reason))]
    return [_sse(completion_chunk(request_id, created, params.model, piece, finish_reason))]


def _closing_events(
    params: GenerationParams, plan: ReplyPlan, ids: tuple[str, int], handle: RequestHandle, block_size: int
) -> list[bytes]:
    request_id, created = ids
    sim_request = handle.request
    if handle.finish_reason == "abort":
        if params.kind == "messages":
            return [anthropic_api.event("error", anthropic_api.anthropic_error_body(ABORTED))]
        return [_sse(ABORTED.body()), b"data: [DONE]\n\n"]
    if params.kind == "messages":
        message_usage = anthropic_api.message_usage(
            sim_request.num_prompt_tokens,
            sim_request.num_output_tokens,
            sim_request.num_cached_prompt_tokens,
            block_size,
        )
        return anthropic_api.stream_closing(plan.finish_reason, message_usage)
    events = []
    if params.include_usage:
        usage_body = usage(
            sim_request.num_prompt_tokens, sim_request.num_output_tokens, sim_request.num_cached_prompt_tokens
        )
        events.append(_sse(usage_chunk(request_id, created, params.model, params.kind, usage_body)))
    events.append(b"data: [DONE]\n\n")
    return events


async def _stream(
    request: web.Request,
    params: GenerationParams,
    plan: ReplyPlan,
    handle: RequestHandle,
    request_id: str,
    created: int,
) -> web.StreamResponse:
    """Relay tokens as they are generated: one event per engine step (one token per step)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in _opening_events(params, plan, request_id, created):
        await response.write(chunk)
    pieces = ReplyPieces(plan, handle)
    while True:
        await handle.changed.wait()
        handle.changed.clear()
        first, last = pieces.sent == 0, handle.finish_reason == "length"
        if len(handle.request.output_token_ids) > pieces.sent or last:
            piece = pieces.next()
            for chunk in _delta_events(params, plan, request_id, created, piece, first, last):
                await response.write(chunk)
        if handle.finished:
            break
    block_size = request.app[ENGINE_KEY].config.block_size
    for chunk in _closing_events(params, plan, (request_id, created), handle, block_size):
        await response.write(chunk)
    await response.write_eof()
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def messages(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "messages")


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses: generation as for chat; the answer is a Responses object or its
    event stream; with `store` (the default) the turn is kept for `previous_response_id`."""
    engine = request.app[ENGINE_KEY]
    store = request.app[RESPONSES_KEY]
    try:
        body = await _read_json(request)
        params = responses_api.parse_responses(
            body, request.app[INFO_KEY].model_name, engine.config.effective_max_model_len, store
        )
        generation = params.generation
        plan, handle = _start(request.app, generation, body)
    except ApiError as error:
        return _error(error)
    except ValueError as error:
        return _error(ApiError(str(error)))
    created = int(time.time())
    try:
        if generation.stream:
            stream, text = await _stream_response(request, params, plan, handle, created)
        else:
            await _until_finished(handle)
            if handle.finish_reason == "abort":
                return _error(ABORTED)
            text = _text(handle.request.output_token_ids)
        if params.store and handle.finish_reason != "abort":
            store.put(params.response_id, responses_api.StoredResponse(params.messages, text, plan.tool_call))
        if generation.stream:
            return stream
        sim_request = handle.request
        usage_body = responses_api.response_usage(
            sim_request.num_prompt_tokens, sim_request.num_output_tokens, sim_request.num_cached_prompt_tokens
        )
        item = responses_api.output_item(f"msg_{uuid.uuid4().hex}", text, plan.tool_call)
        status = responses_api.final_status(plan.finish_reason)
        return _json(responses_api.response_object(params, created, status, [item], usage_body))
    finally:
        if not handle.finished:
            engine.abort(handle.request.request_id)


async def _stream_response(
    request: web.Request, params, plan: ReplyPlan, handle: RequestHandle, created: int
) -> tuple[web.StreamResponse, str]:
    """Relay a response's events as tokens are generated; returns the response and the text."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    events = responses_api.ResponseStream(params, created, plan.tool_call)
    for chunk in events.opening():
        await response.write(chunk)
    pieces = ReplyPieces(plan, handle)
    while not handle.finished:
        await handle.changed.wait()
        handle.changed.clear()
        if len(handle.request.output_token_ids) > pieces.sent:
            for chunk in events.delta(pieces.next()):
                await response.write(chunk)
    sim_request = handle.request
    if handle.finish_reason == "abort":
        closing = events.failed(ABORTED)
    else:
        usage_body = responses_api.response_usage(
            sim_request.num_prompt_tokens, sim_request.num_output_tokens, sim_request.num_cached_prompt_tokens
        )
        closing = events.closing(plan.finish_reason, usage_body)
    for chunk in closing:
        await response.write(chunk)
    await response.write_eof()
    return response, "".join(events.text_parts)


# -- plain routes ----------------------------------------------------------------------------


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens (Anthropic; vLLM serves it too): the prompt's tokens,
    rendered as for /v1/messages, with nothing scheduled."""
    try:
        body = await _read_json(request)
        prompt_ids, _ = anthropic_api.render_messages(body)
    except ApiError as error:
        return _error_for("messages", error)
    except ValueError as error:
        return _error_for("messages", ApiError(str(error)))
    return _json({"input_tokens": len(prompt_ids)})


async def responses_retrieve(request: web.Request) -> web.Response:
    """GET /v1/responses/{response_id}: a stored response (vLLM, with its response store
    enabled, serves it from the memory of the one server that produced it; 404 elsewhere)."""
    response_id = request.match_info["response_id"]
    stored = request.app[RESPONSES_KEY].get(response_id)
    if stored is None:
        return _error(responses_api.not_found(response_id))
    return _json(responses_api.stored_response_object(response_id, stored, request.app[INFO_KEY].model_name))


async def models(request: web.Request) -> web.Response:
    info = request.app[INFO_KEY]
    return _json(models_response(info.model_name, info.created, request.app[ENGINE_KEY].config.effective_max_model_len))


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    manager = engine.scheduler.kv_cache_manager
    text = render_metrics(
        request.app[INFO_KEY].model_name,
        engine.config.block_size,
        engine.config.num_blocks,
        engine.kv_answer().to_json(),
        engine.scheduler.counters,
        manager.prefix_cache_stats,
        manager.block_pool.num_evictions,
    )
    return web.Response(text=text, headers={"Content-Type": CONTENT_TYPE})


# -- probe API (docs/reference.md) ---------------------------------------------------------------


async def kv_route(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    answer = merge_kv([await engine.between_steps(engine.kv_answer)])
    answer = replace(
        answer,
        max_model_len=engine.config.effective_max_model_len,
        max_token_bytes=MAX_TOKEN_BYTES,
        scheduling_policy=engine.config.scheduling_policy,
    )
    return _json(answer.to_json())


async def release_route(request: web.Request) -> web.Response:
    """POST /v1/kvgate/release: end the named sessions' KV pins (`wire.kv_pins.ReleaseQuery`)."""
    try:
        query = ReleaseQuery.parse(await _read_json(request))
    except ApiError as error:
        return _error(error)
    except PinError as error:
        return _error(ApiError(str(error), param="sessions"))
    engine = request.app[ENGINE_KEY]
    return _json((await engine.between_steps(lambda: engine.release_pins(query.sessions))).to_json())


def parse_prefix_probe(
    body, store: responses_api.ResponseStore | None = None, max_model_len: int | None = None
) -> tuple[list[int], str | None]:
    """Token ids and cache_salt of a prefix probe body (a `PrefixQuery`), rendered as
    generation renders it; a `responses` body continuing a response reads `store` (404 if
    this replica does not hold it). A prompt over `max_model_len` tokens is a 400
    `prompt_too_long` (`token_ids` before its ids are read), so no probe costs more than the
    turn it prices."""
    try:
        query = PrefixQuery.parse(body, max_model_len)
        if query.kind == "token_ids":
            token_ids = query.token_ids or []
            if not all(token < VOCAB_SIZE for token in token_ids):
                raise ApiError(f"'token_ids' must be a list of integers in [0, {VOCAB_SIZE})", param="token_ids")
            return token_ids, query.cache_salt
        request_body = query.body or {}
        if query.kind == "messages":
            token_ids, salt = anthropic_api.render_messages(request_body)
        elif query.kind == "responses":
            token_ids, _messages, salt = responses_api.render_responses(
                request_body, store if store is not None else responses_api.ResponseStore()
            )
        else:
            token_ids, salt = render_prompt(query.kind, request_body)
        check_prompt_length(len(token_ids), max_model_len)
    except ProbeQueryError as error:
        raise ApiError(error.message, error.status, param=error.param, code=error.code) from None
    return token_ids, salt


async def prefix_route(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        token_ids, cache_salt = parse_prefix_probe(
            await _read_json(request), request.app[RESPONSES_KEY], engine.config.effective_max_model_len
        )
    except ApiError as error:
        return _error(error)
    answer = await engine.between_steps(lambda: engine.prefix_answer(token_ids, cache_salt))
    return _json(merge_prefix([answer]).to_json())


def replica_key_middleware(key: str | None):
    """The replica API (the probe API and the owner record) answers only requests with the
    replica key (`kvgate.wire.replica_auth`); every other route is vLLM's and unaffected."""

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith(REPLICA_API_PREFIX) and not allowed(request.headers.get(REPLICA_KEY_HEADER), key):
            return _error(ApiError(UNAUTHORIZED_MESSAGE, 401, "AuthenticationError", code="invalid_replica_key"))
        return await handler(request)

    return check


CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection (never reaches it)


@web.middleware
async def client_gone_middleware(request: web.Request, handler):
    """A client that resets while its answer streams is gone, not a server error: without
    this, aiohttp logs the failed write's traceback as a 500 (the handler's `finally` has
    already aborted the engine request). The placeholder answer fails to write, which
    aiohttp takes as the premature disconnection it is."""
    try:
        return await handler(request)
    except ConnectionResetError:
        return web.Response(status=CLIENT_CLOSED, text="client closed the connection")


# -- owner record (conflict detection: kvgate.wire.owner_record) ---------------------------

OWNER_KEY = web.AppKey("kvgate_sim_owner", OwnerBook)


async def owner_claim(request: web.Request) -> web.Response:
    try:
        return _json(request.app[OWNER_KEY].claim(await _read_json(request)))
    except ApiError as error:
        return _error(error)
    except OwnerClaimError as error:
        return _error(ApiError(error.message, param=error.param))


async def owner_read(request: web.Request) -> web.Response:
    return _json(request.app[OWNER_KEY].read())


# -- app and servers -------------------------------------------------------------------------------


def build_replica_app(
    config: EngineConfig | None = None,
    *,
    time_scale: float = 1.0,
    cost_model: CostModel | None = None,
    model_name: str = DEFAULT_MODEL_NAME,
    replica_api_key: str | None = None,
    reply_model: ReplyModel | None = None,
) -> web.Application:
    """One simulated replica as an aiohttp app; its engine starts and stops with the app.

    The engine is `app[ENGINE_KEY]` (tests read its scheduler and counters directly).
    `replica_api_key`: the probe and owner routes answer only requests that carry it
    (None: anyone, as a vLLM server without the key). `reply_model`: reply lengths and
    tool calls (`simulator.reply_model`; default `ReplyModel()`). Raises
    simulator.config.ConfigError for an invalid configuration.
    """
    engine = AsyncEngine(config or EngineConfig(), cost_model or CostModel(), time_scale)
    app = web.Application(
        client_max_size=MAX_BODY_BYTES, middlewares=[client_gone_middleware, replica_key_middleware(replica_api_key)]
    )
    app[ENGINE_KEY] = engine
    app[INFO_KEY] = ReplicaInfo(model_name, int(time.time()), replica_api_key)
    app[RESPONSES_KEY] = responses_api.ResponseStore()
    app[REPLY_KEY] = (reply_model or ReplyModel()).validate()

    async def start_engine(_app: web.Application) -> None:
        engine.start()

    async def stop_engine(_app: web.Application) -> None:
        await engine.stop()

    app.on_startup.append(start_engine)
    app.on_cleanup.append(stop_engine)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/responses/{response_id}", responses_retrieve)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get(KV_PATH, kv_route)
    app.router.add_post(PREFIX_PATH, prefix_route)
    app.router.add_post(RELEASE_PATH, release_route)
    app[OWNER_KEY] = OwnerBook(time.monotonic)
    app.router.add_post(OWNER_PATH, owner_claim)
    app.router.add_get(OWNER_PATH, owner_read)
    return app


def split_options(options: dict) -> tuple[EngineConfig, dict]:
    """Split keyword options into an EngineConfig and the app's other settings
    (time_scale, cost_model, model_name, replica_api_key, reply_model); unknown keys raise TypeError naming them."""
    engine_keys = {key: options[key] for key in ENGINE_CONFIG_KEYS if key in options and options[key] is not None}
    app_keys = {key: options[key] for key in APP_OPTION_KEYS if key in options}
    unknown = set(options) - set(ENGINE_CONFIG_KEYS) - set(app_keys)
    if unknown:
        raise TypeError(f"unknown simulated replica option(s): {', '.join(sorted(unknown))}")
    return EngineConfig(**engine_keys).validate(), app_keys


class SimulatedReplica:
    """A running simulated replica bound to a port: `.name`, `.url`, `.engine`, `await .stop()`."""

    def __init__(self, name: str, url: str, app: web.Application, runner: web.AppRunner) -> None:
        self.name = name
        self.url = url
        self.app = app
        self._runner: web.AppRunner | None = runner  # None once stopped

    @property
    def engine(self) -> AsyncEngine:
        return self.app[ENGINE_KEY]

    @classmethod
    async def start(cls, name: str = "sim0", host: str = "127.0.0.1", port: int = 0, **options) -> SimulatedReplica:
        config, app_options = split_options(options)
        app = build_replica_app(config, **app_options)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        bound_host, bound_port = runner.addresses[0][:2]
        url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
        return cls(name, f"http://{url_host}:{bound_port}", app, runner)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def __repr__(self) -> str:
        return f"SimulatedReplica({self.name}, {self.url})"


async def start_simulated_replicas(count: int, host: str = "127.0.0.1", **engine_options) -> list[SimulatedReplica]:
    """Start `count` replicas named sim0, sim1, ... on free ports of `host` (seam 2).

    engine_options: num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
    max_model_len, scheduling_policy, time_scale, cost_model, model_name, replica_api_key,
    reply_model. If
    one fails to start, the ones already started are stopped and the error propagates.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1 (got {count})")
    replicas: list[SimulatedReplica] = []
    try:
        for index in range(count):
            replicas.append(await SimulatedReplica.start(f"sim{index}", host, 0, **engine_options))
    except BaseException:
        await asyncio.gather(*(replica.stop() for replica in replicas), return_exceptions=True)
        raise
    return replicas
