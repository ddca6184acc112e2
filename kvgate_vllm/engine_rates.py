"""The engine's measured speed, read from vLLM's own Prometheus counters in the API server.

`GET /v1/kvgate/kv` reports two optional figures (SPEC.md section 6, docs/gate.md):
`prefill_tokens_per_sec` and `decode_step_sec`, the inputs of the gate's
work-conserving rule. vLLM's API server process holds its request metrics in the
prometheus-client registry (the ones `/metrics` serves), so the plugin reads them
in-process, no HTTP:

- prefill throughput = prompt tokens computed (`vllm:prompt_tokens` minus
  `vllm:prefix_cache_hits`) / `vllm:request_prefill_time_seconds` (sum), between two
  reads. Requests prefilled in one batch each count the batch's time, so this
  under-states the engine's throughput under load (the gate then over-prices
  re-prefill: it holds a little more, never less).
- decode step = `vllm:request_decode_time_seconds` (sum) / `vllm:generation_tokens`,
  between two reads: the mean time between a request's output tokens.
- prefill share = prefill seconds / (prefill + decode seconds) of the requests, between
  two reads: how much of the engine's time goes to prefill.

`RateMeter.update(totals)` is pure (totals in, figures out, smoothed by an EWMA);
`read_totals(registry)` is the only part that touches prometheus-client. A figure
stays None until its counters moved: no measurement yet.
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


@dataclass
class RateMeter:
    weight: float = 0.3
    prefill_tokens_per_sec: float | None = None
    decode_step_sec: float | None = None
    prefill_share: float | None = None
    _last: dict[str, float] = field(default_factory=dict)

    def update(self, totals: dict[str, float]) -> dict:
        """Fold the counters' growth since the last call into the figures; return them."""
        last, self._last = self._last, dict(totals)
        if last:
            delta = {key: totals.get(key, 0.0) - last.get(key, 0.0) for key in SAMPLES.values()}
            computed = delta["prompt_tokens"] - delta["hit_tokens"]
            if delta["prefill_sec"] > 0 and computed > 0:
                self.prefill_tokens_per_sec = self._smooth(self.prefill_tokens_per_sec,
                                                           computed / delta["prefill_sec"])
            if delta["decode_sec"] > 0 and delta["generation_tokens"] > 0:
                self.decode_step_sec = self._smooth(self.decode_step_sec,
                                                    delta["decode_sec"] / delta["generation_tokens"])
            busy = delta["prefill_sec"] + delta["decode_sec"]
            if busy > 0 and delta["prefill_sec"] >= 0 and delta["decode_sec"] >= 0:
                self.prefill_share = self._smooth(self.prefill_share, delta["prefill_sec"] / busy)
        return {"prefill_tokens_per_sec": self.prefill_tokens_per_sec, "decode_step_sec": self.decode_step_sec,
                "prefill_share": self.prefill_share}

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)


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
