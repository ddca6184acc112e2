"""The probe client: reads one replica's KV usage and a prompt's prefix residency.

`ReplicaProbe` speaks the probe API (`kvgate.wire.probe_api`, docs/reference.md) over the
proxy's aiohttp ClientSession:

- `usage()`: `GET KV_PATH`. Concurrent callers share one in-flight request,
  and a result (or a failure) younger than `gate.probe.usage_max_age_ms` is reused,
  so a burst of acquires costs one probe. An older result is still used while its
  refresh runs in the background (bounded: see `usage`), so an acquire does not
  wait on a probe round trip under steady load;
  `usage(newer_than=T)` insists on a probe started after T. A 404 switches the
  replica to the `/metrics` fallback (`vllm:kv_cache_usage_perc`, no block counts, no prefix probe);
  the probe API is tried again every `KV_RECHECK_SEC`, in case the replica restarts
  with the plugin.
- `prefix(route_kind, body)`: `POST PREFIX_PATH` with `{"chat": body}`,
  `{"completion": body}`, `{"messages": body}` (Anthropic) or `{"responses": body}`,
  so the replica renders the prompt exactly as for generation (a Responses body that
  continues a `previous_response_id` with the state that replica holds; a replica
  that does not hold it answers 404: unavailable). Other kinds have no reading.

Every failure (timeout, connection error, non-200, garbage JSON, values out of range)
counts in `kvgate_probe_errors_total{replica, probe}` and yields None: the policy
treats it as unavailable. Except one: a usage probe that *times out* on a replica that
answered within the last `BUSY_READING_MAX_AGE_SEC` yields that last good reading. The
engine answers probes between scheduler steps, so a timeout usually means a long step
(a CPU engine's chunked prefill lasts seconds): the replica is busiest exactly then,
and deciding `open` would let every turn in.
A prefix answer that contradicts itself (its blocks are not its tokens over the
replica's block size) is such a failure too, never a reading: a replica must not be able
to refuse every turn by claiming a million blocks (`prefix_contradiction`).
Latency goes to `kvgate_probe_seconds`, the last usage to `kvgate_replica_kv_usage`.
Nothing here raises to the gate except cancellation and `PromptTooLong`: the replica
refused to probe a prompt longer than it serves (`400 prompt_too_long`, which the probe
API answers after rendering, before the engine does any work), so the turn is refused
without being forwarded, at the cost of one rendering. (A body that proves itself too
long is refused before it is probed at all: `gate.request_body`.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

import aiohttp
import orjson

from kvgate.gate.errors import PromptTooLong
from kvgate.gate.metrics import GateMetrics
from kvgate.gate.readings import (
    PrefixReading,
    UsageReading,
    parse_kv_answer,
    parse_metrics_usage,
    parse_prefix_answer,
)
from kvgate.gate.settings import ProbeSettings
from kvgate.gate.usage_cache import UsageCache
from kvgate.wire.kv_pins import RELEASE_PATH, Pin, ReleaseQuery, make_pin
from kvgate.wire.probe_api import KV_PATH, PREFIX_PATH, PROMPT_TOO_LONG, PrefixQuery, ProbeAnswerError
from kvgate.wire.replica_auth import replica_headers
from kvgate.wire.routes import PROMPT_KINDS

log = logging.getLogger("kvgate.gate.probe")

METRICS_PATH = "/metrics"
KV_RECHECK_SEC = 30.0
# What a replica without the probe API needs, in every message that reports one (the
# gate's log, /ready, `kvgate check-config --contact-replicas`).
PROBE_API_FIX = (
    "install kvgate's vLLM plugin into that server's environment (docker/install-vllm-plugin.sh "
    "--python <its python>, or run the kvgate-vllm image of docker/vllm.Dockerfile) and restart it "
    "with VLLM_PLUGINS=kvgate"
)


def missing_probe_api(name: str, url: str) -> str:
    """The message that names a replica without the probe API, and the fix."""
    return (
        f"replica {name} ({url}) does not serve kvgate's probe API (GET {KV_PATH} answered 404): the gate "
        f"reads only its /metrics, without block counts or prefix probes; {PROBE_API_FIX}"
    )


BUSY_READING_MAX_AGE_SEC = 30.0  # a timed-out usage probe falls back to a good reading this recent

Clock = Callable[[], float]


class Probe(Protocol):
    """What the gate needs from a probe (the tests' fakes implement the same)."""

    async def usage(self, newer_than: float | None = None) -> UsageReading | None: ...

    async def prefix(self, route_kind: str, body: Mapping[str, object]) -> PrefixReading | None: ...


class _Failed(Exception):
    """A probe failed; the message says how (logged once per replica state change)."""


class _TimedOut(_Failed):
    """The replica did not answer within gate.probe.timeout_sec (busy, or gone)."""


class ReplicaProbe:
    def __init__(
        self,
        name: str,
        url: str,
        http: Callable[[], aiohttp.ClientSession],
        settings: ProbeSettings,
        metrics: GateMetrics,
        api_key: str | None = None,
        clock: Clock = time.monotonic,
        replica_api_key: str | None = None,
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self._http = http
        self._timeout = aiohttp.ClientTimeout(total=settings.timeout_sec)
        self._headers = replica_headers(api_key, replica_api_key)
        self._replica_key = replica_api_key  # proves the KV pins the gate sends (wire.kv_pins)
        self._clock = clock
        self._usage = UsageCache.of(self._read_usage, settings, clock)
        self._fallback_since: float | None = None  # set while the replica has no probe API
        self._seconds = {p: metrics.probe_seconds.labels(name, p) for p in ("kv", "prefix")}
        self._errors = {p: metrics.probe_errors.labels(name, p) for p in ("kv", "prefix")}
        self._usage_gauge = metrics.replica_kv_usage.labels(name)
        # 1 while the replica answers the probe API, 0 on the /metrics fallback (gate degraded);
        # no series until the replica has answered either way.
        self._probe_api_gauge = metrics.replica_probe_api
        self._probe_api: bool | None = None
        self._last_error: str | None = None
        self._last_good: UsageReading | None = None  # the last reading a probe returned, and when
        self._last_good_at = float("-inf")

    @property
    def has_probe_api(self) -> bool:
        return self._fallback_since is None

    @property
    def probe_api(self) -> bool | None:
        """Whether the replica serves the probe API: None until it has answered either way."""
        return self._probe_api

    # ------------------------------------------------------------------ usage

    async def usage(self, newer_than: float | None = None) -> UsageReading | None:
        """The replica's usage; None when unknown (the probe failed). Shared and reused
        by `gate.usage_cache`'s rules (stale-while-revalidate): a busy gate never waits on
        a probe round trip, which on vLLM lasts up to one scheduler step."""
        return await self._usage.usage(newer_than)

    def ready_usage(self) -> UsageReading | None:
        """The reading `usage()` would return without waiting, or None (`UsageCache.ready`)."""
        return self._usage.ready()

    def revalidate_usage(self) -> None:
        """Refresh the usage reading in the background if it is not fresh (`UsageCache.revalidate`)."""
        self._usage.revalidate()

    def close(self) -> None:
        """Cancel a refresh still in flight and drop the replica's series (the gate is going away)."""
        self._usage.close()
        try:  # a replica that is gone must not keep a "probe API missing" alert firing
            self._probe_api_gauge.remove(self.name)
        except KeyError:
            pass

    async def _read_usage(self) -> UsageReading | None:
        started = time.perf_counter()
        try:
            if self._fallback_since is not None and self._clock() - self._fallback_since < KV_RECHECK_SEC:
                reading = await self._usage_from_metrics()
            else:
                reading = await self._usage_from_kv()
        except _Failed as failure:
            self._errors["kv"].inc()
            recent = self._clock() - self._last_good_at < BUSY_READING_MAX_AGE_SEC
            if isinstance(failure, _TimedOut) and recent:
                self._note_error(
                    f"kv probe timed out ({failure}): the replica is busy; deciding with its last reading",
                    unavailable=False,
                )
                return self._last_good
            self._note_error(f"kv probe failed: {failure}")
            return None
        self._last_good, self._last_good_at = reading, self._clock()
        self._seconds["kv"].observe(time.perf_counter() - started)
        self._usage_gauge.set(reading.kv_cache_usage)
        self._last_error = None
        return reading

    async def _usage_from_kv(self) -> UsageReading:
        status, payload = await self._request("GET", KV_PATH, None)
        if status == 404:
            if self._probe_api is not False:
                log.warning("%s", missing_probe_api(self.name, self.url))
            self._probe_api = False
            self._fallback_since = self._clock()
            self._probe_api_gauge.labels(self.name).set(0)
            return await self._usage_from_metrics()
        if self._probe_api is False:
            log.info("replica %s (%s) serves kvgate's probe API again", self.name, self.url)
        self._probe_api = True
        self._fallback_since = None
        self._probe_api_gauge.labels(self.name).set(1)
        return _parse(status, payload, parse_kv_answer)

    async def _usage_from_metrics(self) -> UsageReading:
        status, payload = await self._request("GET", METRICS_PATH, None)
        if status != 200:
            raise _Failed(f"GET {METRICS_PATH} answered {status}")
        try:
            return parse_metrics_usage(payload.decode("utf-8", "replace"))
        except ProbeAnswerError as err:
            raise _Failed(str(err)) from None

    # ----------------------------------------------------------------- prefix

    async def prefix(self, route_kind: str, body: Mapping[str, object]) -> PrefixReading | None:
        """The prompt's residency on the replica; None when unavailable."""
        if route_kind not in PROMPT_KINDS or self._fallback_since is not None:
            return None
        started = time.perf_counter()
        try:
            query = PrefixQuery.of_request(route_kind, body).to_json()
            status, payload = await self._request("POST", PREFIX_PATH, orjson.dumps(query))
            if status == 400:
                refused = _too_long(payload)
                if refused is not None:
                    raise PromptTooLong(f"replica {self.name}: {refused}")
            block_size = self._last_good.block_size if self._last_good is not None else None
            reading = _parse(status, payload, lambda doc: checked_prefix_answer(doc, block_size))
        except _Failed as failure:
            self._errors["prefix"].inc()
            self._note_error(f"prefix probe failed: {failure}")
            return None
        self._seconds["prefix"].observe(time.perf_counter() - started)
        return reading

    # ------------------------------------------------------------------- pins

    def pin(self, session: str, ttl_sec: float) -> Pin:
        """The KV pin a turn of `session` is forwarded with, proved with the replica key."""
        return make_pin(session, ttl_sec, self._replica_key)

    async def release_pins(self, sessions: tuple[str, ...]) -> None:
        """End the KV pins of `sessions` (`POST /v1/kvgate/release`); raises on failure."""
        status, payload = await self._request("POST", RELEASE_PATH, orjson.dumps(ReleaseQuery(sessions).to_json()))
        if status != 200:
            raise _Failed(f"POST {RELEASE_PATH}: HTTP {status}: {payload[:200]!r}")

    # ------------------------------------------------------------------- http

    async def _request(self, method: str, path: str, data: bytes | None) -> tuple[int, bytes]:
        headers = self._headers
        if data is not None:
            headers = {**headers, "Content-Type": "application/json"}
        try:
            async with self._http().request(
                method, self.url + path, data=data, headers=headers, timeout=self._timeout
            ) as resp:
                return resp.status, await resp.read()
        except TimeoutError:
            raise _TimedOut(f"{method} {path} took longer than gate.probe.timeout_sec") from None
        except (aiohttp.ClientError, OSError) as err:
            raise _Failed(f"{method} {path}: {type(err).__name__}: {err}") from None

    def _note_error(self, message: str, unavailable: bool = True) -> None:
        if message != self._last_error:
            log.warning(
                "replica %s (%s): %s%s",
                self.name,
                self.url,
                message,
                "; deciding as if unavailable" if unavailable else "",
            )
        self._last_error = message


Parsed = TypeVar("Parsed")


def prefix_contradiction(reading: PrefixReading, block_size: int | None, has_tokens: bool) -> str | None:
    """Why a prefix answer contradicts itself, or None. A prompt of `total_tokens` tokens has
    exactly `total_tokens // block_size` full blocks, the only ones a prefix cache holds
    (checked when the answer gives its tokens and the replica its block size)."""
    if not has_tokens or not block_size:
        return None
    expected = reading.total_tokens // block_size
    if reading.total_blocks != expected:
        return (
            f"the prefix answer contradicts itself: {reading.total_tokens} tokens make {expected} full blocks "
            f"of {block_size}, not {reading.total_blocks}"
        )
    return None


def checked_prefix_answer(doc: object, block_size: int | None) -> PrefixReading:
    """`parse_prefix_answer`, and ProbeAnswerError when the answer contradicts itself."""
    reading = parse_prefix_answer(doc)
    problem = prefix_contradiction(reading, block_size, isinstance(doc, dict) and "total_tokens" in doc)
    if problem is not None:
        raise ProbeAnswerError(problem)
    return reading


def _too_long(payload: bytes) -> str | None:
    """The message of a `prompt_too_long` refusal (an OpenAI-shaped error), else None."""
    try:
        error = orjson.loads(payload).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if isinstance(error, dict) and error.get("code") == PROMPT_TOO_LONG:
        return str(error.get("message", "the prompt is longer than the replica serves"))[:500]
    return None


def _parse(status: int, payload: bytes, parser: Callable[[object], Parsed]) -> Parsed:
    if status != 200:
        raise _Failed(f"answered HTTP {status}: {payload[:200]!r}")
    try:
        return parser(orjson.loads(payload))
    except orjson.JSONDecodeError as err:
        raise _Failed(f"answered invalid JSON ({err})") from None
    except ProbeAnswerError as err:
        raise _Failed(str(err)) from None
