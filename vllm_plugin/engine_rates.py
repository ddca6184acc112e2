"""The engine's measured speed, read from vLLM's own Prometheus counters in the API server.

`GET /v1/kvgate/kv` reports two optional figures (docs/reference.md, docs/gate.md):
`prefill_tokens_per_sec` and `decode_step_sec`, the inputs of the gate's
work-conserving rule. vLLM's API server process holds its request metrics in the
prometheus-client registry (the ones `/metrics` serves), so the plugin reads them
in-process, no HTTP:

- prefill throughput: the engine's marginal cost of a token, fitted from its own
  scheduler steps (`step_costs`, reported by the engine core) when it has a fit
  (`prefill_rate`); else, from the counters, prompt tokens computed (`vllm:prompt_tokens` minus
  `vllm:prefix_cache_hits`) / the engine's prefill time, over windows of at least
  `PREFILL_WINDOW_SEC`. The prefill time is `vllm:request_prefill_time_seconds`
  (sum) capped at the window's wall time: requests prefilled in one batch, or
  chunk by chunk beside others' decodes, each count the whole span, so their sum
  over-counts the engine's time several times over under load, and the gate would
  over-price re-prefill and hold turns that cost it more to hold. Capped, the figure
  is still a lower bound (the window also holds decode-only time), so the gate errs
  towards holding. The window is long against one request's prefill because the
  counters move when a prefill ends: a short window would credit it with tokens
  computed before it began.
- decode step = `vllm:request_decode_time_seconds` (sum) / `vllm:generation_tokens`,
  between two reads: the mean time between a request's output tokens.
- prefill share = prefill seconds / (prefill + decode seconds) of the requests, between
  two reads: how much of the engine's time goes to prefill.

`RateMeter.update(totals, now)` is pure (totals and the time in, figures out, smoothed by an EWMA);
`read_totals(registry)` is the only part that touches prometheus-client. A figure
stays None until its counters moved: no measurement yet. Reading the registry walks
every vLLM metric (about 1.7 ms of the API server's CPU, two thirds of a kv probe's),
so the plugin reads it at most every `READ_INTERVAL_SEC` (`RateMeter.due`) and
answers the probes between with the last figures (`RateMeter.figures`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# sample name -> the key of `totals`
SAMPLES = {
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prefix_cache_hits_total": "hit_tokens",
    "vllm:request_prefill_time_seconds_sum": "prefill_sec",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:request_decode_time_seconds_sum": "decode_sec",
}


PREFILL_WINDOW_SEC = 3.0
# The counters are read at most this often: the figures are EWMAs over windows of
# seconds, and the gate asks for them every few tens of milliseconds under load.
READ_INTERVAL_SEC = 0.5


def _delta(totals: dict[str, float], last: dict[str, float]) -> dict[str, float]:
    return {key: totals.get(key, 0.0) - last.get(key, 0.0) for key in SAMPLES.values()}


@dataclass
class RateMeter:
    weight: float = 0.3
    prefill_tokens_per_sec: float | None = None
    decode_step_sec: float | None = None
    prefill_share: float | None = None
    _last: dict[str, float] = field(default_factory=dict)
    _window: tuple[float, dict[str, float]] | None = None  # (start, totals then) of the prefill window
    _read_at: float | None = None  # when `update` last ran

    def due(self, now: float) -> bool:
        """Whether the counters should be read again (`now`: a monotonic clock's reading):
        never read yet, or last read at least READ_INTERVAL_SEC ago."""
        return self._read_at is None or now - self._read_at >= READ_INTERVAL_SEC

    def figures(self) -> dict:
        """The current figures (None: not measured yet)."""
        return {
            "prefill_tokens_per_sec": self.prefill_tokens_per_sec,
            "decode_step_sec": self.decode_step_sec,
            "prefill_share": self.prefill_share,
        }

    def update(self, totals: dict[str, float], now: float) -> dict:
        """Fold the counters' growth since the last call (`now`: a monotonic clock's
        reading) into the figures; return them."""
        self._read_at = now
        last, self._last = self._last, dict(totals)
        if self._window is None:
            self._window = (now, dict(totals))
        start, at_start = self._window
        if now - start >= PREFILL_WINDOW_SEC:
            self._window = (now, dict(totals))
            window = _delta(totals, at_start)
            computed = window["prompt_tokens"] - window["hit_tokens"]
            busy = min(now - start, window["prefill_sec"])
            if busy > 0 and computed > 0:
                self.prefill_tokens_per_sec = self._smooth(self.prefill_tokens_per_sec, computed / busy)
        if last:
            delta = _delta(totals, last)
            if delta["decode_sec"] > 0 and delta["generation_tokens"] > 0:
                self.decode_step_sec = self._smooth(
                    self.decode_step_sec, delta["decode_sec"] / delta["generation_tokens"]
                )
            busy = delta["prefill_sec"] + delta["decode_sec"]
            if busy > 0 and delta["prefill_sec"] >= 0 and delta["decode_sec"] >= 0:
                self.prefill_share = self._smooth(self.prefill_share, delta["prefill_sec"] / busy)
        return self.figures()

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)


def prefill_rate(counter_rate: float | None, token_sec: float | None) -> float | None:
    """The prefill throughput to report: 1 / the marginal seconds per token fitted from
    the engine's steps (`step_costs.marginal_token_sec`) when there is a fit, else the
    counters' figure (a lower bound: see the module docstring)."""
    if token_sec:
        return 1.0 / token_sec
    return counter_rate


def read_totals(registry: Any = None) -> dict[str, float]:
    """The counters of `SAMPLES`, summed over engines and models, from a prometheus-client
    registry (default: the process's). Missing ones read 0."""
    if registry is None:
        from prometheus_client import REGISTRY as registry  # noqa: N811 (the library's name)
    totals = {key: 0.0 for key in SAMPLES.values()}
    for metric in registry.collect():
        for sample in metric.samples:
            key = SAMPLES.get(sample.name)
            if key is not None:
                totals[key] += float(sample.value)
    return totals
