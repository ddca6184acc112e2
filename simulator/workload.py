"""The admission experiment's synthetic workload: deterministic for a seed.

A Poisson stream of ordinary requests (short prompts, moderate outputs) plus, every
`burst_interval` steps, a burst of `burst_size` long prompts arriving together: the
pattern that makes a naive admission policy over-commit the KV cache. Every
`oversize_every`-th request has a prompt that can never fit the cache, to show that such
requests are rejected, not looped.

Prompt token ids are distinct per request (no cross-request prefix sharing), so every
prefix-cache hit in the experiment is a request re-using its own blocks after a preemption.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from kvgate.simulator.config import ConfigError


@dataclass(frozen=True)
class WorkloadParams:
    num_requests: int = 1000
    arrival_rate: float = 0.12  # ordinary requests per step
    prompt_len_min: int = 32
    prompt_len_max: int = 768
    output_len_min: int = 16
    output_len_max: int = 128
    burst_interval: int = 400  # steps between bursts of long prompts
    burst_size: int = 12
    long_prompt_len_min: int = 1536
    long_prompt_len_max: int = 4096
    oversize_every: int = 500  # 0 = no oversize prompts

    def validate(self) -> WorkloadParams:
        for name in ("num_requests", "burst_interval"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("burst_size", "oversize_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (got {getattr(self, name)})")
        if not self.arrival_rate > 0:
            raise ConfigError(f"arrival_rate must be > 0 (got {self.arrival_rate})")
        for low, high in (
            ("prompt_len_min", "prompt_len_max"),
            ("output_len_min", "output_len_max"),
            ("long_prompt_len_min", "long_prompt_len_max"),
        ):
            if getattr(self, low) < 1:
                raise ConfigError(f"{low} must be >= 1 (got {getattr(self, low)})")
            if getattr(self, high) < getattr(self, low):
                raise ConfigError(f"{high} must be >= {low} (got {getattr(self, high)} < {getattr(self, low)})")
        return self

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    arrival_step: int
    prompt_len: int
    output_len: int
    kind: str  # "short" | "long" | "oversize"


def generate_workload(params: WorkloadParams, seed: int, cache_tokens: int) -> list[WorkloadRequest]:
    """Requests in arrival order (FCFS); same params and seed -> same list."""
    rng = random.Random(seed)
    requests: list[WorkloadRequest] = []
    time = 0.0
    next_burst = float(params.burst_interval)

    def add(arrival: int, kind: str) -> None:
        index = len(requests)
        if params.oversize_every and index % params.oversize_every == params.oversize_every - 1:
            kind = "oversize"
            prompt_len = cache_tokens + 1  # more than the whole cache holds
        elif kind == "long":
            prompt_len = rng.randint(params.long_prompt_len_min, params.long_prompt_len_max)
        else:
            prompt_len = rng.randint(params.prompt_len_min, params.prompt_len_max)
        output_len = rng.randint(params.output_len_min, params.output_len_max)
        requests.append(WorkloadRequest(index, arrival, prompt_len, output_len, kind))

    while len(requests) < params.num_requests:
        time += rng.expovariate(params.arrival_rate)
        while params.burst_size and next_burst <= time and len(requests) < params.num_requests:
            for _ in range(min(params.burst_size, params.num_requests - len(requests))):
                add(int(next_burst), "long")
            next_burst += params.burst_interval
        if len(requests) < params.num_requests:
            add(int(time), "short")
    return requests
