"""Regime presets: a workload, a replica shape and gate settings that put the cache in one regime.

Sizing rules (so a regime runs in about 1-3 minutes of wall time per invocation on a
2-core machine, and the simulated cost model, not Python overhead, dominates a turn):
- cache per replica = `num_blocks * block_size` tokens; the "active prompt tokens" of a
  regime are `concurrency` sessions at their average prompt length;
- replies are short (agent turns are mostly tool calls) and tool results long, so a
  turn's cost is dominated by prefill, the part a prefix-cache hit saves;
- `time_scale` stretches the cost model until one turn costs tens of milliseconds of
  simulated engine time, well above the proxy's and the simulator's own overhead.

`tiny` exists for the end-to-end test: seconds, not minutes.

Regimes that can catch a gate that loses run the gate with its *defaults*
(no gate settings): `*-no-finish` regimes send no `x-session-finish` (sessions end
silently, as an OpenAI-SDK agent's do); `cheap-prefill` makes holding back unable to
pay (short contexts, prefill 10x cheaper than the default cost model: a turn is mostly
decode); `prefill-bound` makes one full re-prefill of a session's context cost about
its turn's decode (long contexts, longer replies); `silent-burst` is a burst of silent
sessions on caches that hold about one session's context, where re-prefill is cheap;
`calm` is two sessions and room for both. `--send-finish no` turns any regime into its silent-finish form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvgate.bench.agentic.cpu_engines import CpuEngine
from kvgate.bench.agentic.workload import WorkloadSpec
from kvgate.bench.processes import ReplicaShape
from kvgate.simulator.agent_trace import AgentTraceSpec
from kvgate.simulator.cost_presets import get_cost_preset


@dataclass(frozen=True)
class Regime:
    name: str
    description: str
    workload: WorkloadSpec | AgentTraceSpec  # words-based sessions, or an agent trace
    shape: ReplicaShape
    replicas: int = 2
    gate: dict = field(default_factory=dict)  # gate settings shared by the kvgate modes
    # For --replica-url regimes: the random-weight model preset of
    # tests/vllm_plugin/scripts/build_tiny_model.py the vLLM server should serve ("tiny" or
    # "prefill"); `shape` then gives the server's cache flags (num_blocks + 1 blocks,
    # one is vLLM's null block). tests/vllm_plugin/scripts/run_vllm_bench.py starts it.
    vllm_model: str | None = None
    # Trace regimes: the replicas come from a cost preset coarsened by the trace's
    # token_scale (`preset_shape`), and the last turn carries x-session-finish only if
    # `send_finish` (agents on plain SDKs end sessions silently).
    cost_preset: str | None = None
    kv_fraction: float = 1.0  # share of the preset's KV cache a replica gets
    send_finish: bool = False
    # For --replica-url regimes: their vLLM CPU server as measured, which a simulation of the
    # regime stands for (`simulated_shape`; bench/agentic/cpu_engines.py).
    cpu_engine: CpuEngine | None = None

    def simulated_shape(self) -> ReplicaShape:
        """The shape of a simulated replica of this regime: `shape`, or for a real-vLLM regime
        with a measured `cpu_engine`, the simulated replica that stands for its server."""
        return self.shape if self.cpu_engine is None else self.cpu_engine.simulated(self.shape)


def preset_shape(preset: str, token_scale: float, time_scale: float, kv_fraction: float = 1.0) -> ReplicaShape:
    """The `kvgate replica` shape of cost preset `preset` coarsened by `token_scale`, with
    `kv_fraction` of its cache (simulator/cost_presets.py)."""
    engine, cost = get_cost_preset(preset).scaled(token_scale)
    num_blocks = max(1, math.floor(engine.num_blocks * kv_fraction))
    return ReplicaShape(
        num_blocks=num_blocks,
        block_size=engine.block_size,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_model_len=min(engine.effective_max_model_len, num_blocks * engine.block_size),
        time_scale=time_scale,
        prefill_token_s=cost.prefill_token_s,
        step_overhead_s=cost.step_overhead_s,
        decode_seq_s=cost.decode_seq_s,
        context_token_s=cost.context_token_s,
    )


def _thrash_workload(**changes) -> WorkloadSpec:
    base = WorkloadSpec(
        sessions=36,
        concurrency=18,
        turns_min=8,
        turns_max=12,
        system_prompt_words=300,
        shared_system_prompt=False,
        task_words=100,
        tool_result_words_min=300,
        tool_result_words_max=600,
        reply_tokens=8,
        tool_latency_median_s=0.05,
        tool_latency_sigma=0.5,
    )
    return base.replace(**changes)


_ROOMY_CACHE = ReplicaShape(
    num_blocks=4096, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=8192, time_scale=1.5
)
_SMALL_CACHE = ReplicaShape(
    num_blocks=512, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=8192, time_scale=1.5
)

# The real-vLLM regimes' server: 64 blocks of 32 tokens (63 usable), 8 sequences.
_VLLM_CACHE = ReplicaShape(
    num_blocks=63, block_size=32, max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2016, time_scale=1.0
)
# The prefill-bound model's engine steps are capped at 512 tokens (chunked prefill): an
# uncapped step of 2,048 prompt tokens takes 1-4 s on 2 shared cores, and the gate's
# probes, answered between steps, would time out (probe.timeout_sec 1) and admit `open`.
_VLLM_PREFILL_CACHE = replace(_VLLM_CACHE, max_num_batched_tokens=512)
# The default gate but for one setting: the engine core answers the gate's probes between two
# scheduler steps, and on a few shared CPU cores one step takes seconds, longer than the
# default probe.timeout_sec of 1 s (sized for GPU steps of tens of ms). A prefix probe
# that times out decides as if the probe were unavailable.
_VLLM_CPU_GATE = {"probe": {"timeout_sec": 5.0}}
_VLLM_SMALL_WORKLOAD = WorkloadSpec(
    sessions=16,
    concurrency=8,
    turns_min=5,
    turns_max=7,
    system_prompt_words=20,
    shared_system_prompt=False,
    task_words=10,
    tool_result_words_min=40,
    tool_result_words_max=60,
    reply_tokens=8,
    tool_latency_median_s=0.05,
    tool_latency_sigma=0.5,
)
# Contexts of ~250 tokens growing ~170 a turn to ~1,100: one full re-prefill (~0.3-1 s
# on 2 cores) outweighs a turn's 8 decode steps; tool calls of ~0.3 s.
_VLLM_PREFILL_WORKLOAD = WorkloadSpec(
    sessions=12,
    concurrency=6,
    turns_min=4,
    turns_max=6,
    system_prompt_words=40,
    shared_system_prompt=False,
    task_words=10,
    tool_result_words_min=25,
    tool_result_words_max=40,
    reply_tokens=8,
    tool_latency_median_s=0.3,
    tool_latency_sigma=0.5,
)

# The two servers measured on the 2-core CI machine, engine pinned to its own CPU
# (`tests/vllm_plugin/scripts/fit_cpu_engine.py --regime vllm-small-no-finish`, and
# `vllm-prefill-no-finish`): the models share one BPE, ~3.6 tokens of the simulator's one.
_TINY_ON_CPU = CpuEngine(step_overhead_s=0.00238, token_s=8.25e-06, tokens_per_sim_token=3.58)
_PREFILL_ON_CPU = CpuEngine(step_overhead_s=0.00915, token_s=0.000322, tokens_per_sim_token=3.58)


def _real_vllm_pair(
    name: str, description: str, workload: WorkloadSpec, model: str, shape: ReplicaShape, engine: CpuEngine
) -> dict[str, Regime]:
    """`name` (the last turn carries x-session-finish) and `name`-no-finish (no turn does: an
    agent on a plain OpenAI SDK), both against one given vLLM server with the default gate
    but for the probe deadline (`_VLLM_CPU_GATE`), simulated as `engine`."""
    regime = Regime(
        name, description, workload, shape, replicas=1, gate=_VLLM_CPU_GATE, vllm_model=model, cpu_engine=engine
    )
    silent = replace(
        regime,
        name=f"{name}-no-finish",
        description=f"{name}, and no turn carries x-session-finish (an agent on a plain OpenAI SDK)",
        workload=workload.replace(send_finish=False),
    )
    return {name: regime, silent.name: silent}


REGIMES: dict[str, Regime] = {
    "no-pressure": Regime(
        "no-pressure",
        "every active session's prompt fits in its replica's cache: the gate must cost nothing",
        _thrash_workload(),
        _ROOMY_CACHE,
        gate={"idle_grace_sec": 5.0, "wait_poll_sec": 0.25},
    ),
    "calm": Regime(
        "calm",
        "two sessions at once on no-pressure replicas, default gate settings: the gate must cost nothing",
        _thrash_workload(sessions=2, concurrency=2),
        _ROOMY_CACHE,
    ),
    "thrash": Regime(
        "thrash",
        "active sessions' prompts need >= 3x the cache: sticky routing thrashes",
        _thrash_workload(),
        _SMALL_CACHE,
        gate={"idle_grace_sec": 5.0, "wait_poll_sec": 0.25},
    ),
    "heavy-tail": Regime(
        "heavy-tail",
        "thrash sizes, and 15% of tool calls outlast idle_grace_sec (windows expire mid-session)",
        _thrash_workload(tool_tail_prob=0.15, tool_tail_s=2.0),
        _SMALL_CACHE,
        gate={"idle_grace_sec": 1.0, "wait_poll_sec": 0.25},
    ),
    "retry-storm": Regime(
        "retry-storm",
        "thrash sizes, and 10% of turns are re-sent 5-50 ms after the first attempt",
        _thrash_workload(retry_prob=0.10),
        _SMALL_CACHE,
        gate={"idle_grace_sec": 5.0, "wait_poll_sec": 0.25},
    ),
    **_real_vllm_pair(
        "vllm-small",
        "for --replica-url against the tiny real-vLLM CPU server (block 32, 64 blocks, ~3 tokens "
        "per word): 8 sessions at once need ~2.5x its 2016-token cache",
        _VLLM_SMALL_WORKLOAD,
        "tiny",
        _VLLM_CACHE,
        _TINY_ON_CPU,
    ),
    **_real_vllm_pair(
        "vllm-prefill",
        "for --replica-url against the prefill-bound real-vLLM CPU server (8 layers of width 512, "
        "block 32, 64 blocks, ~4.5 tokens per word): a cold re-prefill of a context costs more than "
        "a turn's decode, and 6 sessions at once need ~2x the 2016-token cache",
        _VLLM_PREFILL_WORKLOAD,
        "prefill",
        _VLLM_PREFILL_CACHE,
        _PREFILL_ON_CPU,
    ),
    "tiny": Regime(
        "tiny",
        "a few short sessions on small replicas: seconds, for the end-to-end test",
        WorkloadSpec(
            sessions=4,
            concurrency=4,
            turns_min=3,
            turns_max=4,
            system_prompt_words=40,
            task_words=20,
            tool_result_words_min=20,
            tool_result_words_max=40,
            reply_tokens=4,
            tool_latency_median_s=0.01,
            tool_latency_sigma=0.3,
            retry_prob=0.2,
        ),
        ReplicaShape(
            num_blocks=64,
            block_size=16,
            max_num_seqs=16,
            max_num_batched_tokens=512,
            max_model_len=1024,
            time_scale=0.0,
        ),
        gate={"idle_grace_sec": 2.0, "wait_poll_sec": 0.1},
    ),
}


def _cheap_prefill_workload(**changes) -> WorkloadSpec:
    return _thrash_workload(
        system_prompt_words=100, task_words=50, tool_result_words_min=60, tool_result_words_max=120, reply_tokens=16
    ).replace(**changes)


def _prefill_bound_workload(**changes) -> WorkloadSpec:
    return _thrash_workload(system_prompt_words=1000, task_words=200, reply_tokens=32).replace(**changes)


# cheap-prefill: ~700-token contexts, 9 sessions per replica need ~3x the 2048-token cache;
# prefill 5 us/token (10x cheaper): a full re-prefill (~5 ms) is a fraction of a turn's
# 16-token decode (~0.15 s), so holding a session back can only lose.
_CHEAP_PREFILL_CACHE = ReplicaShape(
    num_blocks=128,
    block_size=16,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    max_model_len=2048,
    time_scale=1.5,
    prefill_token_s=0.000005,
)
# prefill-bound: contexts grow from ~1,300 to ~6,000 tokens; 9 sessions per replica need ~3x
# the 10,240-token cache; a full re-prefill of a ~3,600-token context (~0.27 s at the default
# 50 us/token x 1.5) costs about a turn's 32-token decode (~0.3 s).
_PREFILL_BOUND_CACHE = ReplicaShape(
    num_blocks=640, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=8192, time_scale=1.5
)


def _silent(base: Regime, why: str = "") -> Regime:
    """`base` with sessions that end silently (no x-session-finish) and the gate's default settings."""
    return Regime(
        base.name + "-no-finish",
        f"{base.name}, sessions end silently (no x-session-finish), default gate settings{why}",
        base.workload.replace(send_finish=False),
        base.shape,
        base.replicas,
    )


REGIMES.update(
    {
        "cheap-prefill": Regime(
            "cheap-prefill",
            "short contexts (~700 tokens) need ~3x the cache, prefill 10x cheaper: holding back cannot pay",
            _cheap_prefill_workload(),
            _CHEAP_PREFILL_CACHE,
        ),
        "prefill-bound": Regime(
            "prefill-bound",
            "long contexts (1,300-6,000 tokens) need ~3x the cache; a full re-prefill costs about a turn's decode",
            _prefill_bound_workload(),
            _PREFILL_BOUND_CACHE,
        ),
    }
)
# The cap the capped regimes' turns send: far above their replies, as agent clients send
# one (Claude Code: 32,000), and within the regimes' max_model_len beside their longest prompts.
AGENT_MAX_TOKENS = 1024


def _capped(base: Regime) -> Regime:
    """`base` with every turn sending max_tokens AGENT_MAX_TOKENS, its replies as long as before."""
    assert isinstance(base.workload, WorkloadSpec), "an agent trace's turns send their own replies' lengths"
    return Regime(
        base.name + "-capped",
        f"{base.name}, every turn sending max_tokens {AGENT_MAX_TOKENS} as agent clients send a cap "
        f"far above their replies, which stay {base.workload.reply_tokens} tokens",
        base.workload.replace(max_tokens=AGENT_MAX_TOKENS),
        base.shape,
        base.replicas,
    )


# The share of tool calls that run a subagent in the `-subagents` regimes, and its turns.
SUBAGENT_PROB = 0.3
SUBAGENT_TURNS = 3


def _subagents(base: Regime) -> Regime:
    """`base` with SUBAGENT_PROB of its tool calls running a subagent of SUBAGENT_TURNS turns
    under the session's id, as a coding agent's delegated searches and reviews do."""
    assert isinstance(base.workload, WorkloadSpec), "an agent trace's sessions have one thread"
    return replace(
        base,
        name=base.name + "-subagents",
        description=f"{base.name}, and {SUBAGENT_PROB:.0%} of tool calls run a subagent of {SUBAGENT_TURNS} turns "
        "under the session's id (a thread of its own history): the main thread's prefix waits out its run",
        workload=base.workload.replace(subagent_prob=SUBAGENT_PROB, subagent_turns=SUBAGENT_TURNS),
    )


# The cap of the real-vLLM capped regime: a quarter of its server's 2,016-token context,
# so its longest prompts still fit beside it (vLLM refuses prompt + max_tokens above it).
VLLM_MAX_TOKENS = 512
# Where a random-weight model's sampled text ends a capped reply: characters it meets within a few tokens.
VLLM_STOP = (" ", "e", "a", "t")


def _vllm_capped(base: Regime) -> Regime:
    """Real-vLLM `base` with every turn sending max_tokens VLLM_MAX_TOKENS, its replies as long
    as before: vLLM's min_tokens, then the first of VLLM_STOP the sampled text meets."""
    assert isinstance(base.workload, WorkloadSpec) and base.vllm_model is not None
    return replace(
        base,
        name=base.name + "-capped",
        description=f"{base.name}, every turn sending max_tokens {VLLM_MAX_TOKENS} as agent clients send a cap far "
        f"above their replies, which end just after their {base.workload.reply_tokens} tokens (min_tokens, then a "
        "stop string the sampled text meets)",
        workload=base.workload.replace(max_tokens=VLLM_MAX_TOKENS, stop=VLLM_STOP),
    )


REGIMES.update(
    {
        "vllm-prefill-capped": _vllm_capped(REGIMES["vllm-prefill"]),
        "thrash-subagents": _subagents(REGIMES["thrash"]),
        "prefill-bound-subagents": _subagents(REGIMES["prefill-bound"]),
        "thrash-capped": _capped(REGIMES["thrash"]),
        "prefill-bound-capped": _capped(REGIMES["prefill-bound"]),
        "no-pressure-no-finish": _silent(REGIMES["no-pressure"]),
        "thrash-no-finish": _silent(REGIMES["thrash"], ": windows must end when sessions go quiet"),
        "cheap-prefill-no-finish": _silent(REGIMES["cheap-prefill"]),
        "prefill-bound-no-finish": _silent(REGIMES["prefill-bound"]),
        "silent-burst": Regime(
            "silent-burst",
            "16 sessions x 8 turns all at once, 0.3 s tool calls, no x-session-finish, "
            "2 replicas of 64 blocks x 32 tokens (about one session's context), default cost model and gate: "
            "re-prefill is cheap and holding cannot pay",
            WorkloadSpec(
                sessions=16,
                concurrency=16,
                turns_min=8,
                turns_max=8,
                system_prompt_words=100,
                shared_system_prompt=False,
                task_words=50,
                tool_result_words_min=60,
                tool_result_words_max=120,
                reply_tokens=16,
                tool_latency_median_s=0.3,
                tool_latency_sigma=0.0,
                send_finish=False,
            ),
            ReplicaShape(
                num_blocks=64,
                block_size=32,
                max_num_seqs=64,
                max_num_batched_tokens=2048,
                max_model_len=2048,
                time_scale=1.0,
            ),
        ),
    }
)


def _trace_regime(name: str, description: str, preset: str, kv_fraction: float = 1.0) -> Regime:
    """A closed loop of 24 agents running 48 trace sessions on two replicas of `preset`, tokens
    scaled 8x. Tool times are clamped at 12 s (both fitted quantiles, 1 s and 10 s, lie below
    it): a run's longest chain of sessions, which sets its makespan, stays near 90 s when
    the replicas keep up."""
    spec = AgentTraceSpec(sessions=48, agents=24, token_scale=8.0, tool_time_max_s=12.0)
    shape = preset_shape(preset, spec.token_scale, 1.0, kv_fraction)
    return Regime(name, description, spec, shape, cost_preset=preset, kv_fraction=kv_fraction)


# Trace regimes: agent traffic as published traces describe it (simulator/agent_trace.py)
# on GPU-calibrated replicas (simulator/cost_presets.py). 12 agents per replica at the
# published median context (~7k tokens, ~8.5k on average over a session) fill ~100k
# tokens: a fifth of an 8B H100's cache, half the 70B preset's. The -tight variants
# give each replica a fraction of the preset's cache so that contexts need about twice
# what it holds (the cache per agent of a replica serving 8x or 4x the agents: a 2-core
# machine cannot drive that many); still more than a session's longest context (~45k
# tokens at 100 turns), so no prompt is too long for it.
REGIMES.update(
    {
        "trace-8b": _trace_regime(
            "trace-8b",
            "coding agents (published trace statistics), 24 agents in a closed loop on two "
            "Llama-3.1-8B/H100 replicas (tokens scaled 8x): contexts fit, the gate must cost nothing",
            "h100-8b",
        ),
        "trace-8b-tight": _trace_regime(
            "trace-8b-tight",
            "trace-8b with 1/8 of the H100's KV cache per replica: contexts need ~1.8x the cache",
            "h100-8b",
            kv_fraction=1 / 8,
        ),
        "trace-70b": _trace_regime(
            "trace-70b",
            "coding agents, 24 agents on two 70B-class replicas (two H100s each, tokens scaled 8x): "
            "re-prefill is dear, contexts fill half the cache",
            "h100x2-70b",
        ),
        "trace-70b-tight": _trace_regime(
            "trace-70b-tight",
            "trace-70b with 1/4 of the preset's KV cache per replica: contexts need ~2x the cache, re-prefill is dear",
            "h100x2-70b",
            kv_fraction=1 / 4,
        ),
    }
)


# Regime names of earlier releases, refused with the new name.
RENAMED_REGIMES = {"issue-9": "silent-burst"}


def get_regime(name: str) -> Regime:
    if name in RENAMED_REGIMES:
        raise ValueError(f"regime {name!r} is now called {RENAMED_REGIMES[name]!r}")
    try:
        return REGIMES[name]
    except KeyError:
        raise ValueError(f"unknown regime {name!r}; choose from {', '.join(REGIMES)}") from None
