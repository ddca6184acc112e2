"""Cluster presets: a workload of agents in a closed loop, a replica shape, a fleet size.

`fleet` is the scale the simulation exists for: 4,096 coding agents for an hour on 64
replicas of an 8B model on one H100-class GPU each (the cost model's defaults; about
480k tokens of KV cache per replica, vLLM's default block size, 256 sequences,
8,192-token steps). The agents share a long system prompt (4,000 words), work 20-40
turns of 200-token replies on tool results of 300-1,500 words, so contexts grow to
about 40k tokens; tool calls take 5 s at the median, 5% of them a minute or two. The
64 agents a replica serves need about 2-3x its cache at once: sticky routing thrashes.
`fleet-small` is the same shape at 1/8 of the size, for a quick look.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.bench.agentic.workload import WorkloadSpec
from kvgate.simulator.agent_trace import AgentTraceSpec
from kvgate.simulator.config import CostModel, EngineConfig


@dataclass(frozen=True)
class ClusterPreset:
    name: str
    description: str
    workload: WorkloadSpec | AgentTraceSpec
    engine: EngineConfig
    cost_model: CostModel = CostModel()
    time_scale: float = 1.0
    replicas: int = 2
    gate: dict = field(default_factory=dict)
    agents: int = 0  # 0: the workload's fixed sessions (`sessions`, `concurrency`)
    duration_s: float = 0.0


CODING_AGENTS = WorkloadSpec(
    sessions=1,  # agents run endless sessions: sessions and concurrency are not used
    concurrency=1,
    turns_min=20,
    turns_max=40,
    system_prompt_words=4000,
    shared_system_prompt=True,
    task_words=300,
    tool_result_words_min=300,
    tool_result_words_max=1500,
    reply_tokens=200,
    tool_latency_median_s=5.0,
    tool_latency_sigma=1.0,
    tool_tail_prob=0.05,
    tool_tail_s=60.0,
    send_finish=False,  # agents on a plain OpenAI SDK: sessions end silently
)

H100_8B = EngineConfig(
    num_blocks=30_000, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=131_072
)

CLUSTER_PRESETS: dict[str, ClusterPreset] = {
    "fleet": ClusterPreset(
        "fleet",
        "4,096 coding agents (contexts to ~40k tokens, shared system prompt) on 64 H100-class replicas for an hour",
        CODING_AGENTS,
        H100_8B,
        replicas=64,
        agents=4096,
        duration_s=3600.0,
    ),
    "fleet-small": ClusterPreset(
        "fleet-small",
        "the fleet at 1/8: 512 coding agents on 8 replicas for 10 minutes",
        CODING_AGENTS,
        H100_8B,
        replicas=8,
        agents=512,
        duration_s=600.0,
    ),
}
