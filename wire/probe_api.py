"""The probe API (docs/reference.md): what a replica tells the gate about its KV cache, typed once.

    GET  KV_PATH                  -> KvAnswer      (the replica's KV usage; cheap, constant time)
    POST PREFIX_PATH PrefixQuery  -> PrefixAnswer  (how much of one prompt is resident)

Errors are OpenAI-shaped (`wire.errors.openai_error`): 400 a bad query (naming the field),
404 a Responses body whose `previous_response_id` the replica does not hold, 501 the engine
cannot answer, 503 engine error, 504 timeout.

Two servers implement the API, the vLLM plugin and the simulated replica; the gate is its
client. Each server builds its answers with `KvAnswer.of_engine` / `PrefixAnswer.of_engine`
(one per engine) and `merge_kv` / `merge_prefix` (one per server, with the engines listed
under `engines`), then sends `to_json()`; the gate reads them with `parse`. Invariants:

- `parse(x.to_json()) == x` for every answer `parse` accepts, and `to_json()` writes every
  field: a server cannot send a field this module does not know, nor drop one it does;
- `parse` accepts exactly the answers that are consistent (usage and ratios in [0, 1],
  counts non-negative integers, free blocks at most total blocks, hits at most the prompt's
  full blocks) and raises `ProbeAnswerError` naming the first field that is not. Only the
  fields the gate cannot decide without are required, so a replica that measures less
  still answers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Literal, cast, get_args

from kvgate.wire.routes import PROMPT_KINDS, REPLICA_API_PREFIX

PROBE_API_VERSION = 1
KV_PATH = REPLICA_API_PREFIX + "kv"
PREFIX_PATH = REPLICA_API_PREFIX + "prefix"


class ProbeAnswerError(ValueError):
    """A replica answered a probe with something that is not a valid answer."""


# ------------------------------------------------------------------ field checks


def _object(doc: object, what: str) -> dict:
    if not isinstance(doc, dict):
        raise ProbeAnswerError(f"the {what} must be a JSON object, got {type(doc).__name__}")
    return doc


def _ratio(doc: dict, key: str, required: bool = True) -> float | None:
    value = doc.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProbeAnswerError(f"field {key!r} must be a number, got {value!r:.80}")
    value = float(value)
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        raise ProbeAnswerError(f"field {key!r} must lie in [0, 1], got {value}")
    return value


def _count(doc: dict, key: str, required: bool = False) -> int | None:
    value = doc.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProbeAnswerError(f"field {key!r} must be a non-negative integer, got {value!r:.80}")
    return value


def _at_least_one(doc: dict, key: str) -> int | None:
    """An optional size: a positive integer, or None (absent, null: not known)."""
    value = _count(doc, key)
    if value == 0:
        raise ProbeAnswerError(f"field {key!r} must be a positive integer or null, got 0")
    return value


def _positive(doc: dict, key: str) -> float | None:
    """An optional measurement: a positive finite number, or None (absent, null: not measured yet)."""
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ProbeAnswerError(f"field {key!r} must be a positive number or null, got {value!r:.80}")
    return float(value)


def _version(doc: dict) -> int:
    version = doc.get("version", PROBE_API_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ProbeAnswerError(f"field 'version' must be a positive integer, got {version!r:.80}")
    return version


def _engines(doc: dict, parse_one) -> tuple:
    """The per-engine answers of a whole-server answer (each with its `engine` index, none nested)."""
    entries = doc.get("engines", [])
    if not isinstance(entries, list):
        raise ProbeAnswerError(f"field 'engines' must be a list, got {entries!r:.80}")
    parsed = tuple(parse_one(entry) for entry in entries)
    if any(entry.engine is None or entry.engines for entry in parsed):
        raise ProbeAnswerError("each 'engines' entry needs its 'engine' index and no 'engines' of its own")
    return parsed


def _to_json(answer) -> dict:
    """Every field, None as null; `engine` only on an engine's entry, `engines` only on a whole answer."""
    doc: dict = {}
    for field in fields(answer):
        value = getattr(answer, field.name)
        if field.name == "engine" and value is None:
            continue
        if field.name == "engines":
            if value:
                doc["engines"] = [entry.to_json() for entry in value]
            continue
        doc[field.name] = value
    return doc


# ------------------------------------------------------------------------ KV answer


@dataclass(frozen=True, slots=True)
class KvAnswer:
    """`GET KV_PATH`: a replica's KV-cache usage, the whole server's or one engine's.

    `num_total_blocks` is the blocks requests can use; `num_gpu_blocks` is vLLM's own figure
    (what `vllm:cache_config_info` reports), one more: vLLM's reserved null block.
    `kv_cache_usage` is vLLM's `BlockPool.get_usage()`: blocks held by live requests over
    usable blocks (cached blocks no request holds count as free). The block counts come
    together or not at all; the measurements are None until measured:
    `prefill_tokens_per_sec` (prompt tokens the engine computes per second of prefill),
    `decode_step_sec` (seconds per decode step), `prefill_share` (the share of recent busy
    time spent prefilling), `token_sec` (an engine's marginal seconds per scheduled token,
    fitted from its steps), `busy_share` (the share of recent wall time the engine spent
    in scheduler steps, `kvgate.wire.busy_share`).

    Two figures are the server's, not an engine's (set on the whole answer only; None from
    a server that does not know them): `max_model_len`, the longest prompt the server
    serves, in tokens; `max_token_bytes`, an upper bound on the UTF-8 bytes of text any one
    token of its vocabulary stands for. Together they let a client refuse a prompt without
    sending it: a text of `n` bytes renders to at least `n / max_token_bytes` tokens.
    `scheduling_policy` is the server's `--scheduling-policy` ("fcfs" or "priority"): under
    "priority" a request's `priority` field orders it (lower first) and picks preemption victims.

    Pins (`wire.kv_pins`; None from a server that keeps none): `num_pinned_blocks` are
    the blocks pins hold, each once (never free: counted in `kv_cache_usage`), `num_pinned_sessions`
    the sessions holding a pin, `num_pin_yields` the pins released since start because a
    request needed their blocks.

    The CPU tier (vLLM's KV offloading, `--kv-offloading-size`; None from a server without
    one): `num_cpu_blocks` is its capacity and `num_cpu_cached_blocks` what it holds, both
    in blocks of `block_size` tokens; `cpu_load_sec_per_block` the seconds to load one
    block back into GPU memory (its bytes over the host-to-device bandwidth).
    """

    kv_cache_usage: float
    num_total_blocks: int | None = None
    num_free_blocks: int | None = None
    num_gpu_blocks: int | None = None
    num_cached_blocks: int | None = None
    block_size: int | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    prefill_tokens_per_sec: float | None = None
    decode_step_sec: float | None = None
    prefill_share: float | None = None
    token_sec: float | None = None
    busy_share: float | None = None
    max_model_len: int | None = None
    max_token_bytes: int | None = None
    scheduling_policy: str | None = None
    num_pinned_blocks: int | None = None
    num_pinned_sessions: int | None = None
    num_pin_yields: int | None = None
    num_cpu_blocks: int | None = None
    num_cpu_cached_blocks: int | None = None
    cpu_load_sec_per_block: float | None = None
    engine: int | None = None
    engines: tuple[KvAnswer, ...] = ()
    version: int = PROBE_API_VERSION

    @classmethod
    def of_engine(
        cls,
        *,
        num_gpu_blocks: int,
        num_free_blocks: int,
        num_cached_blocks: int,
        block_size: int,
        num_running: int,
        num_waiting: int,
        prefill_tokens_per_sec: float | None = None,
        decode_step_sec: float | None = None,
        prefill_share: float | None = None,
        token_sec: float | None = None,
        busy_share: float | None = None,
        num_pinned_blocks: int | None = None,
        num_pinned_sessions: int | None = None,
        num_pin_yields: int | None = None,
        num_cpu_blocks: int | None = None,
        num_cpu_cached_blocks: int | None = None,
        cpu_load_sec_per_block: float | None = None,
    ) -> KvAnswer:
        """One engine's answer from its raw figures (`num_gpu_blocks` with the null block)."""
        num_total_blocks = max(num_gpu_blocks - 1, 0)
        return cls(
            kv_cache_usage=1.0 - num_free_blocks / num_total_blocks if num_total_blocks else 0.0,
            num_total_blocks=num_total_blocks,
            num_free_blocks=num_free_blocks,
            num_gpu_blocks=num_gpu_blocks,
            num_cached_blocks=num_cached_blocks,
            block_size=block_size,
            num_running=num_running,
            num_waiting=num_waiting,
            prefill_tokens_per_sec=prefill_tokens_per_sec,
            decode_step_sec=decode_step_sec,
            prefill_share=prefill_share,
            token_sec=token_sec,
            busy_share=busy_share,
            num_pinned_blocks=num_pinned_blocks,
            num_pinned_sessions=num_pinned_sessions,
            num_pin_yields=num_pin_yields,
            num_cpu_blocks=num_cpu_blocks,
            num_cpu_cached_blocks=num_cpu_cached_blocks,
            cpu_load_sec_per_block=cpu_load_sec_per_block,
        )

    @property
    def has_blocks(self) -> bool:
        return self.num_total_blocks is not None and self.num_free_blocks is not None

    def to_json(self) -> dict:
        return _to_json(self)

    @classmethod
    def parse(cls, doc: object) -> KvAnswer:
        """The answer in `doc` (decoded JSON), or ProbeAnswerError naming the bad field."""
        doc = _object(doc, "kv probe answer")
        usage = _ratio(doc, "kv_cache_usage")
        assert usage is not None
        total, free = _count(doc, "num_total_blocks"), _count(doc, "num_free_blocks")
        if (total is None) != (free is None):
            raise ProbeAnswerError("num_total_blocks and num_free_blocks must come together")
        if total is not None and free is not None and free > total:
            raise ProbeAnswerError(f"num_free_blocks {free} exceeds num_total_blocks {total}")
        return cls(
            kv_cache_usage=usage,
            num_total_blocks=total,
            num_free_blocks=free,
            num_gpu_blocks=_count(doc, "num_gpu_blocks"),
            num_cached_blocks=_count(doc, "num_cached_blocks"),
            block_size=_count(doc, "block_size"),
            num_running=_count(doc, "num_running"),
            num_waiting=_count(doc, "num_waiting"),
            prefill_tokens_per_sec=_positive(doc, "prefill_tokens_per_sec"),
            decode_step_sec=_positive(doc, "decode_step_sec"),
            prefill_share=_ratio(doc, "prefill_share", required=False),
            token_sec=_positive(doc, "token_sec"),
            busy_share=_ratio(doc, "busy_share", required=False),
            max_model_len=_at_least_one(doc, "max_model_len"),
            max_token_bytes=_at_least_one(doc, "max_token_bytes"),
            scheduling_policy=_scheduling_policy(doc),
            num_pinned_blocks=_count(doc, "num_pinned_blocks"),
            num_pinned_sessions=_count(doc, "num_pinned_sessions"),
            num_pin_yields=_count(doc, "num_pin_yields"),
            num_cpu_blocks=_count(doc, "num_cpu_blocks"),
            num_cpu_cached_blocks=_count(doc, "num_cpu_cached_blocks"),
            cpu_load_sec_per_block=_positive(doc, "cpu_load_sec_per_block"),
            engine=_count(doc, "engine"),
            engines=_engines(doc, cls.parse),
            version=_version(doc),
        )


SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's `--scheduling-policy` values


def _scheduling_policy(doc: dict) -> str | None:
    value = doc.get("scheduling_policy")
    if value is None:
        return None
    if value not in SCHEDULING_POLICIES:
        raise ProbeAnswerError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {value!r}")
    return value


def _summed(per_engine: Sequence, key: str) -> int | None:
    values = [getattr(answer, key) for answer in per_engine]
    return None if None in values else sum(values)


def _slowest(values: Iterator[float | None], pick) -> float | None:
    known = [value for value in values if value is not None]
    return pick(known) if known else None


def merge_kv(per_engine: Sequence[KvAnswer]) -> KvAnswer:
    """The whole server's answer from one answer per engine (data parallelism), listing them.

    Block and request counts add up; usage is recomputed over the summed usable blocks, so
    it stays "held blocks over usable blocks". The block size is the engines' common one.
    The measurements are the slowest engine's (a turn may land on any of them): the lowest
    prefill throughput, the longest decode step and marginal token cost, the largest
    prefill share and busy share. The server's own figures (`max_model_len`, `max_token_bytes`) are the
    server's to add (`dataclasses.replace`).
    """
    if not per_engine:
        raise ValueError("merge_kv needs at least one engine answer")
    usable, free = _summed(per_engine, "num_total_blocks"), _summed(per_engine, "num_free_blocks")
    return KvAnswer(
        kv_cache_usage=1.0 - free / usable if usable and free is not None else 0.0,
        num_total_blocks=usable,
        num_free_blocks=free,
        num_gpu_blocks=_summed(per_engine, "num_gpu_blocks"),
        num_cached_blocks=_summed(per_engine, "num_cached_blocks"),
        num_running=_summed(per_engine, "num_running"),
        num_waiting=_summed(per_engine, "num_waiting"),
        num_pinned_blocks=_summed(per_engine, "num_pinned_blocks"),
        num_pinned_sessions=_summed(per_engine, "num_pinned_sessions"),
        num_pin_yields=_summed(per_engine, "num_pin_yields"),
        num_cpu_blocks=_summed(per_engine, "num_cpu_blocks"),
        num_cpu_cached_blocks=_summed(per_engine, "num_cpu_cached_blocks"),
        cpu_load_sec_per_block=_slowest((a.cpu_load_sec_per_block for a in per_engine), max),
        block_size=per_engine[0].block_size,
        prefill_tokens_per_sec=_slowest((a.prefill_tokens_per_sec for a in per_engine), min),
        decode_step_sec=_slowest((a.decode_step_sec for a in per_engine), max),
        prefill_share=_slowest((a.prefill_share for a in per_engine), max),
        token_sec=_slowest((a.token_sec for a in per_engine), max),
        busy_share=_slowest((a.busy_share for a in per_engine), max),
        engines=tuple(replace(answer, engine=index, engines=()) for index, answer in enumerate(per_engine)),
    )


# -------------------------------------------------------------------- prefix answer


@dataclass(frozen=True, slots=True)
class PrefixAnswer:
    """`POST PREFIX_PATH`: how much of one prompt is resident in a replica's prefix cache.

    Invariants: 0 <= hit_blocks <= total_blocks (the prompt's full blocks); 0 <= hit_ratio
    <= 1; hit_blocks == hit_blocks_in_use + hit_blocks_evictable when both are given (in
    use: held by a live request; evictable: cached, held by none). `hit_tokens` is what the
    scheduler would reuse if the prompt were admitted now (vLLM recomputes the last prompt
    token, so it can be a block less than `hit_blocks * block_size`). A whole server's
    answer is its engine with the fewest hits (`merge_prefix`).

    `hit_blocks_cpu` (None from a server without a CPU tier): the prompt's full blocks
    right after the GPU hit that the CPU tier holds, in one run: loading them costs
    `KvAnswer.cpu_load_sec_per_block` each instead of their prefill. hit_blocks +
    hit_blocks_cpu <= total_blocks.
    """

    total_blocks: int
    hit_blocks: int
    hit_ratio: float
    total_tokens: int | None = None
    block_size: int | None = None
    hit_tokens: int | None = None
    hit_blocks_in_use: int | None = None
    hit_blocks_evictable: int | None = None
    hit_blocks_cpu: int | None = None
    engine: int | None = None
    engines: tuple[PrefixAnswer, ...] = ()
    version: int = PROBE_API_VERSION

    @classmethod
    def of_engine(
        cls,
        *,
        total_tokens: int,
        block_size: int,
        hit_block_ref_counts: Sequence[int],
        hit_tokens: int,
        hit_blocks_cpu: int | None = None,
    ) -> PrefixAnswer:
        """One engine's answer for one prompt of `total_tokens` tokens.

        `hit_block_ref_counts` are the reference counts of the prompt's leading full blocks
        found in the prefix cache (the longest resident run, in order): a block with ref
        count > 0 is held by a live request, the others are evictable. `hit_ratio` is hit
        full blocks over full blocks, 0 when the prompt has no full block.
        `hit_blocks_cpu`: the CPU tier's run after the GPU hit (None: no CPU tier).
        """
        total_blocks = total_tokens // block_size if block_size else 0
        hit_blocks = min(len(hit_block_ref_counts), total_blocks)
        if hit_blocks_cpu is not None:
            hit_blocks_cpu = min(hit_blocks_cpu, total_blocks - hit_blocks)
        in_use = hit_blocks - hit_block_ref_counts[:hit_blocks].count(0)  # ref counts are never negative
        return cls(
            total_blocks=total_blocks,
            hit_blocks=hit_blocks,
            hit_ratio=hit_blocks / total_blocks if total_blocks else 0.0,
            total_tokens=total_tokens,
            block_size=block_size,
            hit_tokens=hit_tokens,
            hit_blocks_in_use=in_use,
            hit_blocks_evictable=hit_blocks - in_use,
            hit_blocks_cpu=hit_blocks_cpu,
        )

    @property
    def new_blocks(self) -> int:
        """Blocks this prompt must allocate: its full blocks that are not resident."""
        return self.total_blocks - self.hit_blocks

    def to_json(self) -> dict:
        return _to_json(self)

    @classmethod
    def parse(cls, doc: object) -> PrefixAnswer:
        """The answer in `doc` (decoded JSON), or ProbeAnswerError naming the bad field."""
        doc = _object(doc, "prefix probe answer")
        total, hit = _count(doc, "total_blocks", required=True), _count(doc, "hit_blocks", required=True)
        assert total is not None and hit is not None
        if hit > total:
            raise ProbeAnswerError(f"hit_blocks {hit} exceeds total_blocks {total}")
        ratio = _ratio(doc, "hit_ratio")
        assert ratio is not None
        in_use, evictable = _count(doc, "hit_blocks_in_use"), _count(doc, "hit_blocks_evictable")
        if in_use is not None and evictable is not None and in_use + evictable != hit:
            raise ProbeAnswerError(f"hit_blocks_in_use {in_use} + hit_blocks_evictable {evictable} != hit_blocks {hit}")
        cpu = _count(doc, "hit_blocks_cpu")
        if cpu is not None and hit + cpu > total:
            raise ProbeAnswerError(f"hit_blocks {hit} + hit_blocks_cpu {cpu} exceeds total_blocks {total}")
        return cls(
            total_blocks=total,
            hit_blocks=hit,
            hit_ratio=ratio,
            total_tokens=_count(doc, "total_tokens"),
            block_size=_count(doc, "block_size"),
            hit_tokens=_count(doc, "hit_tokens"),
            hit_blocks_in_use=in_use,
            hit_blocks_evictable=evictable,
            hit_blocks_cpu=cpu,
            engine=_count(doc, "engine"),
            engines=_engines(doc, cls.parse),
            version=_version(doc),
        )


def merge_prefix(per_engine: Sequence[PrefixAnswer]) -> PrefixAnswer:
    """The whole server's answer: the engine with the fewest hit blocks, listing them all.

    vLLM's data-parallel balancer routes a request by load, not by cache content, so the
    only hit a gate can count on is the smallest one.
    """
    if not per_engine:
        raise ValueError("merge_prefix needs at least one engine answer")
    worst = min(per_engine, key=lambda answer: (answer.hit_blocks, answer.hit_tokens or 0))
    engines = tuple(replace(answer, engine=index, engines=()) for index, answer in enumerate(per_engine))
    return replace(worst, engine=None, engines=engines)


# --------------------------------------------------------------------- prefix query

QueryKind = Literal["token_ids", "chat", "completion", "messages", "responses"]
QUERY_KINDS: tuple[QueryKind, ...] = get_args(QueryKind)


PROMPT_TOO_LONG = "prompt_too_long"  # the error code of a prompt over the server's max_model_len


class ProbeQueryError(ValueError):
    """A prefix query a server cannot answer: `status` is the HTTP status to send, `code` the
    error's code, `param` the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def too_long(num_tokens: int, max_model_len: int) -> ProbeQueryError:
    """The refusal of a prompt the server can never serve: a probe costs no more than its turn."""
    return ProbeQueryError(
        f"the prompt has {num_tokens} tokens, more than this server's max_model_len ({max_model_len}); "
        "it can never be served here",
        code=PROMPT_TOO_LONG,
    )


def check_prompt_length(num_tokens: int, max_model_len: int | None) -> None:
    """`too_long` when a rendered prompt of `num_tokens` exceeds `max_model_len` (None: no bound)."""
    if max_model_len is not None and num_tokens > max_model_len:
        raise too_long(num_tokens, max_model_len)


@dataclass(frozen=True)
class PrefixQuery:
    """`POST PREFIX_PATH`'s body: a prompt, as token ids or as the request body of a route.

    Exactly one of:
    `{"token_ids": [int, ...], "cache_salt"?: str, "model"?: str}`, or `{kind: body}` with
    kind a prompt route kind (`wire.routes.PROMPT_KINDS`) and body that route's request
    body, which the server renders exactly as for generation.
    """

    kind: QueryKind
    token_ids: list[int] | None = None
    cache_salt: str | None = None
    model: str | None = None
    body: dict | None = None

    @classmethod
    def of_request(cls, kind: str, body: Mapping[str, object]) -> PrefixQuery:
        """The query for a request of route kind `kind` (one of PROMPT_KINDS) with `body`."""
        if kind not in PROMPT_KINDS:
            raise ProbeQueryError(f"a {kind!r} request has no prompt to probe", kind)
        return cls(cast(QueryKind, kind), body=body if isinstance(body, dict) else dict(body))

    def to_json(self) -> dict:
        if self.kind != "token_ids":
            return {self.kind: self.body}
        doc: dict = {"token_ids": self.token_ids}
        if self.cache_salt is not None:
            doc["cache_salt"] = self.cache_salt
        if self.model is not None:
            doc["model"] = self.model
        return doc

    @classmethod
    def parse(cls, doc: object, max_model_len: int | None = None) -> PrefixQuery:
        """The validated query, or ProbeQueryError naming the offending field. `token_ids`
        longer than `max_model_len` are refused (PROMPT_TOO_LONG) before a single id is read."""
        if not isinstance(doc, dict):
            raise ProbeQueryError("the prefix probe body must be a JSON object")
        present = [kind for kind in QUERY_KINDS if kind in doc]
        if len(present) != 1:
            raise ProbeQueryError(
                "give exactly one of 'token_ids', 'chat' (a /v1/chat/completions body), "
                "'completion' (a /v1/completions body), 'messages' (an Anthropic /v1/messages body) "
                f"or 'responses' (a /v1/responses body); got {present or 'none'}"
            )
        kind = present[0]
        if kind == "token_ids":
            token_ids = doc["token_ids"]
            if isinstance(token_ids, list):
                check_prompt_length(len(token_ids), max_model_len)
            if (
                not isinstance(token_ids, list)
                or not token_ids
                or not all(type(token) is int and token >= 0 for token in token_ids)
            ):
                raise ProbeQueryError("'token_ids' must be a non-empty list of non-negative integers", "token_ids")
            return cls("token_ids", token_ids, _optional_str(doc, "cache_salt"), _optional_str(doc, "model"))
        body = doc[kind]
        if not isinstance(body, dict):
            raise ProbeQueryError(f"'{kind}' must be a JSON object (a request body)", kind)
        return cls(kind, body=body)


def _optional_str(doc: dict, key: str) -> str | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, str):
        raise ProbeQueryError(f"'{key}' must be a string", key)
    return value
