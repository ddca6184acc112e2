"""The real-vLLM regimes' CPU servers, as a simulation stands for them.

A real-vLLM regime (`Regime.vllm_model`) runs against a vLLM CPU server that serves one of
the random-weight models of tests/vllm_plugin/scripts/build_tiny_model.py. Its
`ReplicaShape` is that server's: block size, step budget and longest context in the
model's own tokens. A simulation of the regime (`kvgate sim cluster --regime vllm-...`,
or the agentic benchmark without `--replica-url`) does not run that model. The simulator's
tokenizer makes about one token of a short word where the models' small BPE makes several,
and its default cost model is a GPU's. `CpuEngine` holds what it needs to stand for the
server instead, measured on the server (tests/vllm_plugin/scripts/fit_cpu_engine.py):

- `tokens_per_sim_token`: the server's prompt tokens for each of the simulator's, over the
  regime's whole workload (chat templates included);
- `step_overhead_s`, `token_s`: one scheduler step takes step_overhead_s + token_s x the
  tokens it schedules, prompt or decode (on a CPU a decoding sequence costs about what one
  prompt token does), the least-squares line through the server's timed steps
  (`kvgate.wire.step_fit`).

`CpuEngine.simulated` turns the server's shape into the simulated replica's: every
prompt-token count divided by the tokens per simulated token (the block size, the step
budget, the longest context), the number of blocks kept, and a prompt token's cost
multiplied by it. A decoding sequence's cost is not: a reply's `max_tokens` counts the
server's tokens, one decode step each, in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvgate.bench.agentic.ceiling import simulator_token_model, workload_requests
from kvgate.bench.agentic.workload import Workload
from kvgate.bench.processes import ReplicaShape
from kvgate.wire.step_fit import fit_step_seconds


@dataclass(frozen=True)
class CpuEngine:
    """One real-vLLM CPU server as measured (module docstring)."""

    step_overhead_s: float
    token_s: float
    tokens_per_sim_token: float

    def __post_init__(self) -> None:
        if self.step_overhead_s < 0 or self.token_s <= 0 or self.tokens_per_sim_token < 1:
            raise ValueError(
                f"a CPU engine needs step_overhead_s >= 0, token_s > 0 and tokens_per_sim_token >= 1 (got {self})"
            )

    def simulated(self, server: ReplicaShape) -> ReplicaShape:
        """The simulated replica that stands for `server` (module docstring)."""
        scale = self.tokens_per_sim_token
        block_size = max(1, round(server.block_size / scale))
        longest = server.max_model_len if server.max_model_len is not None else server.num_blocks * server.block_size
        return replace(
            server,
            block_size=block_size,
            max_num_batched_tokens=max(server.max_num_seqs + 1, math.ceil(server.max_num_batched_tokens / scale)),
            max_model_len=min(server.num_blocks * block_size, math.ceil(longest / scale)),
            time_scale=1.0,
            step_overhead_s=self.step_overhead_s,
            prefill_token_s=self.token_s * scale,
            decode_seq_s=self.token_s,
            context_token_s=0.0,
        )


def measured_engine(
    steps: list[tuple[float, int]], server_prompt_tokens: int, simulated_prompt_tokens: int
) -> CpuEngine | None:
    """The CpuEngine of a server whose timed `steps` are (seconds, scheduled tokens), and that
    counted `server_prompt_tokens` for prompts the simulator's tokenizer makes
    `simulated_prompt_tokens` of; None if the steps give no fit."""
    fit = fit_step_seconds(steps)
    if fit is None or simulated_prompt_tokens <= 0:
        return None
    overhead, token_s = fit
    return CpuEngine(
        step_overhead_s=round(max(0.0, overhead), 5),
        token_s=float(f"{token_s:.3g}"),
        tokens_per_sim_token=round(max(1.0, server_prompt_tokens / simulated_prompt_tokens), 2),
    )


def simulated_prompt_tokens(workload: Workload) -> int:
    """The prompt tokens the simulator's tokenizer makes of every turn of `workload` (each
    reply its max_tokens long, as the real-vLLM regimes' servers answer)."""
    model = simulator_token_model()
    assert model is not None, "the simulator is part of kvgate"
    return sum(len(prompt) for prompt, _ in workload_requests(workload, model))
