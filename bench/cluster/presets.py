"""Cluster presets: a workload of agents in a closed loop, a replica shape, a fleet size.

`fleet` is the scale the simulation exists for: 4,096 coding agents for an hour on 64
replicas of Llama-3.1-8B on one H100 each (the `h100-8b` cost preset: 467k tokens of
KV cache per replica, vLLM's default block size, 256 sequences, 8,192-token steps).
The agents share a long system prompt (4,000 words), work 20-40 turns of 200-token
replies on tool results of 300-1,500 words, so contexts grow to about 40k tokens;
tool calls (builds, test runs) take 20 s at the median, 5% of them one to two
minutes. Each session ends on a reply without a tool call, which the gate reads as its
end. The 64 sessions a replica serves need about 2.5x its cache: sticky routing
thrashes. Engine and workload are coarsened 8x (`CostPreset.scaled`: one simulated
token stands for 8, one step for 8; contexts, cache and step times keep their real
ratios), which the report undoes for tokens per second.
`fleet-small` is the same shape at 1/8 of the size, for a quick look.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.bench.agentic.workload import WorkloadSpec
from kvgate.simulator.agent_trace import AgentTraceSpec
from kvgate.simulator.config import CostModel, EngineConfig
from kvgate.simulator.cost_presets import get_cost_preset


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
    token_scale: float = 1.0  # one simulated token stands for this many (engine and workload coarsened alike)


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
    tool_latency_median_s=20.0,
    tool_latency_sigma=1.0,
    tool_tail_prob=0.05,
    tool_tail_s=60.0,
    # Coding agents call tools and end each session's run on a reply that calls none, which
    # the gate reads as the session's end (`session.finish_on_final_reply`, proxy/reply_end.py);
    # the finish header stands for it here.
    send_finish=True,
)

FLEET_TOKEN_SCALE = 8.0
H100_8B, H100_8B_COST = get_cost_preset("h100-8b").scaled(FLEET_TOKEN_SCALE)

CLUSTER_PRESETS: dict[str, ClusterPreset] = {
    "fleet": ClusterPreset(
        "fleet",
        "4,096 coding agents (contexts to ~40k tokens, shared system prompt) on 64 H100-class replicas for an hour",
        CODING_AGENTS,
        H100_8B,
        H100_8B_COST,
        replicas=64,
        agents=4096,
        duration_s=3600.0,
        token_scale=FLEET_TOKEN_SCALE,
    ),
    "fleet-small": ClusterPreset(
        "fleet-small",
        "the fleet at 1/8: 512 coding agents on 8 replicas for 10 minutes",
        CODING_AGENTS,
        H100_8B,
        H100_8B_COST,
        replicas=8,
        agents=512,
        duration_s=600.0,
        token_scale=FLEET_TOKEN_SCALE,
    ),
}
