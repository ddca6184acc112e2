"""The continuous-batching admission experiment (docs/simulator.md), in virtual time.

The same workload, cache, token budget, sequence limit and seed run through the
scheduler once per admission policy. A step is the unit of time: arrivals of step s
are queued before step s is scheduled; a request whose prefill ends in step s gets its
first token in step s. TTFT = first-token step - arrival step + 1, E2E = finish step -
arrival step + 1, both in steps.

`run_policy` drives the scheduler and records a per-step timeline; `summarize` turns a
run into the metrics of metrics.json. Both are deterministic: no clock, no I/O, integer
step counts, floats rounded when summarised.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kvgate.simulator.admission_policies import POLICY_NAMES, headroom_blocks, make_policy
from kvgate.simulator.config import ConfigError, EngineConfig
from kvgate.simulator.percentiles import percentile
from kvgate.simulator.request import SimRequest
from kvgate.simulator.scheduler import Scheduler, SchedulerCounters
from kvgate.simulator.workload import WorkloadParams, WorkloadRequest, generate_workload

DEFAULT_ENGINE = EngineConfig(num_blocks=1024, block_size=16, max_num_seqs=64, max_num_batched_tokens=512)
PROMPT_BUCKETS = ((0, 512, "<512"), (512, 2048, "512-2047"), (2048, math.inf, ">=2048"))
TIMELINE_COLUMNS = (
    "step",
    "waiting",
    "running",
    "free_blocks",
    "used_blocks",
    "obligation_tokens",
    "admitted",
    "preemptions",
    "recomputed_tokens",
    "scheduled_tokens",
)


@dataclass(frozen=True)
class ExperimentConfig:
    engine: EngineConfig = DEFAULT_ENGINE
    workload: WorkloadParams = WorkloadParams()
    headroom_fraction: float = 0.125
    seed: int = 0

    def validate(self) -> ExperimentConfig:
        self.engine.validate()
        self.workload.validate()
        if not 0 <= self.headroom_fraction < 1:
            raise ConfigError(f"headroom_fraction must be in [0, 1) (got {self.headroom_fraction})")
        return self


@dataclass(frozen=True)
class RequestRecord:
    index: int
    kind: str
    prompt_len: int
    arrival_step: int
    first_token_step: int
    finish_step: int
    num_preemptions: int


@dataclass
class PolicyRun:
    policy: str
    shadow: bool
    records: list[RequestRecord] = field(default_factory=list)
    rejected: list[WorkloadRequest] = field(default_factory=list)
    timeline: list[tuple[int, ...]] = field(default_factory=list)
    counters: SchedulerCounters | None = None
    busy_steps: int = 0
    scheduled_seqs: int = 0  # summed over busy steps
    scheduled_tokens: int = 0
    watermark_violations: int = 0  # steps that ended with fewer free blocks than the headroom


def _output_token(request: SimRequest) -> int:
    return 1


def run_policy(
    config: ExperimentConfig, workload: list[WorkloadRequest], policy: str, shadow: bool = False
) -> PolicyRun:
    engine = config.engine
    shadow_policy = make_policy("reserve_watermark", config.headroom_fraction) if shadow else None
    scheduler = Scheduler(engine, make_policy(policy, config.headroom_fraction), shadow_policy)
    headroom = headroom_blocks(engine.num_blocks, config.headroom_fraction)
    run = PolicyRun(policy, shadow)
    pending = deque(workload)
    by_id: dict[str, WorkloadRequest] = {}
    timeline = run.timeline
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0].arrival_step <= step:
            item = pending.popleft()
            base = (item.index + 1) << 24  # distinct token ids per request
            request = SimRequest(
                str(item.index),
                list(range(base, base + item.prompt_len)),
                item.output_len,
                engine.block_size,
                arrival=item.arrival_step,
            )
            if scheduler.add_request(request):
                by_id[request.request_id] = item
            else:
                run.rejected.append(item)
        output = scheduler.schedule()
        finished = scheduler.update_from_output(output, _output_token)
        for request in finished:
            item = by_id.pop(request.request_id)
            # a finished request has produced its first token and finished
            assert request.first_token_step is not None and request.finish_step is not None
            run.records.append(
                RequestRecord(
                    item.index,
                    item.kind,
                    item.prompt_len,
                    item.arrival_step,
                    request.first_token_step,
                    request.finish_step,
                    request.num_preemptions,
                )
            )
        free = scheduler.num_free_blocks
        num_seqs = len(output.scheduled)
        if num_seqs:
            run.busy_steps += 1
            run.scheduled_seqs += num_seqs
            run.scheduled_tokens += output.num_scheduled_tokens
        if free < headroom:
            run.watermark_violations += 1
        timeline.append(
            (
                step,
                len(scheduler.waiting),
                len(scheduler.running),
                free,
                engine.num_blocks - free,
                scheduler.obligation_tokens(),
                len(output.admitted),
                len(output.preempted),
                output.num_recomputed_tokens,
                output.num_scheduled_tokens,
            )
        )
        step += 1
    run.counters = scheduler.counters
    return run


def _latency_summary(records: list[RequestRecord]) -> dict:
    ttft = sorted(r.first_token_step - r.arrival_step + 1 for r in records)
    e2e = sorted(r.finish_step - r.arrival_step + 1 for r in records)
    return {
        "count": len(records),
        "ttft_p50_steps": percentile(ttft, 50),
        "ttft_p95_steps": percentile(ttft, 95),
        "e2e_p50_steps": percentile(e2e, 50),
        "e2e_p95_steps": percentile(e2e, 95),
    }


def summarize(run: PolicyRun, config: ExperimentConfig, num_requests: int) -> dict:
    counters = run.counters
    assert counters is not None, "summarize() takes a run that run_policy() finished"
    engine = config.engine
    completed = len(run.records)
    num_steps = len(run.timeline)
    by_bucket = {}
    for low, high, label in PROMPT_BUCKETS:
        by_bucket[label] = _latency_summary([r for r in run.records if low <= r.prompt_len < high])
    summary = {
        "completed": completed,
        "rejected": len(run.rejected),
        "all_completed": completed + len(run.rejected) == num_requests,
        "steps": num_steps,
        "preemptions": counters.num_preemptions,
        "preempted_requests": sum(1 for r in run.records if r.num_preemptions),
        "recomputed_tokens": counters.num_recomputed_tokens,
        "recomputed_tokens_per_completed_request": round(counters.num_recomputed_tokens / completed, 4)
        if completed
        else 0.0,
        "computed_prefill_tokens": counters.num_computed_prefill_tokens,
        **_latency_summary(run.records),
        "by_prompt_length": by_bucket,
        "throughput_requests_per_step": round(completed / num_steps, 6) if num_steps else 0.0,
        "sequence_slot_utilisation": round(run.scheduled_seqs / (run.busy_steps * engine.max_num_seqs), 4)
        if run.busy_steps
        else 0.0,
        "token_budget_utilisation": round(run.scheduled_tokens / (run.busy_steps * engine.max_num_batched_tokens), 4)
        if run.busy_steps
        else 0.0,
        "watermark_violation_steps": run.watermark_violations,
    }
    del summary["count"]
    if run.shadow:
        decisions = counters.shadow_decisions
        summary["shadow"] = {
            "shadow_policy": "reserve_watermark",
            "decisions": decisions,
            "disagreements": counters.shadow_disagreements,
            "disagreement_rate": round(counters.shadow_disagreements / decisions, 4) if decisions else 0.0,
        }
    return summary


def run_experiment(
    config: ExperimentConfig, policies: tuple[str, ...] = POLICY_NAMES, shadow: bool = False
) -> tuple[dict, dict[str, PolicyRun]]:
    """Run every policy on the same workload. Returns (metrics.json content, runs by policy).

    `shadow` attaches the reserve_watermark shadow to the naive run (which must be selected).
    """
    config.validate()
    if shadow and "naive" not in policies:
        raise ConfigError("shadow needs the naive policy among the policies (it shadows naive with reserve_watermark)")
    workload = generate_workload(config.workload, config.seed, config.engine.cache_tokens)
    runs = {policy: run_policy(config, workload, policy, shadow=shadow and policy == "naive") for policy in policies}
    kinds = {kind: sum(1 for r in workload if r.kind == kind) for kind in ("short", "long", "oversize")}
    metrics = {
        "seed": config.seed,
        "engine": {
            "num_blocks": config.engine.num_blocks,
            "block_size": config.engine.block_size,
            "max_num_seqs": config.engine.max_num_seqs,
            "max_num_batched_tokens": config.engine.max_num_batched_tokens,
        },
        "headroom_fraction": config.headroom_fraction,
        "headroom_blocks": headroom_blocks(config.engine.num_blocks, config.headroom_fraction),
        "workload": {
            **config.workload.as_dict(),
            "requests_by_kind": kinds,
            "prompt_tokens": sum(r.prompt_len for r in workload),
            "last_arrival_step": workload[-1].arrival_step,
        },
        "policies": {policy: summarize(run, config, len(workload)) for policy, run in runs.items()},
    }
    return metrics, runs
