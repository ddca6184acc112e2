"""Cost presets: a GPU-calibrated engine (cache size, scheduler shape, step cost) per model class.

A preset describes one replica of a real deployment in the simulator's terms
(`EngineConfig`, `CostModel`). `scaled(f)` coarsens it by f: every token count of the
engine (the cache, the step's token budget, the longest context) is divided by f and
every cost (per step, per prefill token, per decoding sequence, per context token) is
multiplied by f. With a workload whose token counts (contexts and replies) are also
divided by f (`AgentTraceSpec.token_scale`), one scaled step stands for f real steps
and one scaled token for f real tokens: a turn's prefill and decode times, the ratio
of contexts to the cache and the engine's total busy time stay those of the real run,
while the simulator, the proxy and the client handle f times fewer tokens and steps.

Presets:
- `h100-8b`: Llama-3.1-8B, bf16, one H100 80GB. step = 5.75 ms + 17.25 us per prefill
  token + 6 us per decoding sequence (a least-squares fit of timed steps); about 467k
  tokens of KV at 128 KiB per token (32 layers x 8 KV heads x 128 x 2 x bf16).
- `h100x2-70b`: a 70B-class model (Llama-3.1-70B, FP8 weights, tensor-parallel over two
  H100s), an estimate from the hardware's limits: 70 GB of weights streamed per step
  at ~80% of 2 x 3.35 TB/s (13 ms), 140 GFLOP per prefill token at ~50% of 2 x 1,979
  dense FP8 TFLOP/s (70 us), 12 us per decoding sequence; 320 KiB of bf16 KV per
  token (80 layers x 8 KV heads x 128 x 2 x 2 bytes) in ~68 GB left after weights and
  activations: about 210k tokens. Dearer per token and a smaller cache than `h100-8b`:
  a re-prefill costs more turns' worth of decode.

A preset's `kv_bytes_per_token` (128 KiB for the 8B, 320 KiB for the 70B) and
`cpu_load_gbps` (PCIe Gen5, 50 GB/s) price a CPU-tier load: one block's bytes over the
bandwidth (~42 us for an 8B block of 16 tokens, ~105 us for a 70B one); `scaled(f)`
multiplies it by f like every other cost (a scaled block stands for f blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvgate.simulator.config import CostModel, EngineConfig, cpu_load_block_seconds

PCIE_GEN5_GBPS = 50.0  # host-to-device bytes per second, in GB/s, that PCIe Gen5 x16 sustains


@dataclass(frozen=True)
class CostPreset:
    name: str
    description: str
    cost: CostModel
    kv_tokens: int  # KV cache capacity of one replica, in tokens
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072
    kv_bytes_per_token: int = 128 * 1024  # KV bytes one token takes (all layers, K and V)
    cpu_load_gbps: float = PCIE_GEN5_GBPS  # host-to-device bandwidth of a CPU-tier load

    @property
    def cpu_load_block_s(self) -> float:
        """Seconds to load one (unscaled) block from the CPU tier."""
        return cpu_load_block_seconds(self.kv_bytes_per_token, self.block_size, self.cpu_load_gbps)

    def scaled(self, factor: float) -> tuple[EngineConfig, CostModel]:
        """The engine and cost model coarsened by `factor` (>= 1): token counts divided by it,
        costs multiplied by it (see the module docstring)."""
        if factor < 1:
            raise ValueError(f"token scale must be >= 1 (got {factor})")
        num_blocks = max(1, math.floor(self.kv_tokens / factor / self.block_size))
        cache_tokens = num_blocks * self.block_size
        engine = EngineConfig(
            num_blocks=num_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            # a decoding sequence takes one token of the budget at any scale: keep room for a full batch
            max_num_batched_tokens=max(math.ceil(self.max_num_batched_tokens / factor), self.max_num_seqs + 1),
            max_model_len=min(cache_tokens, math.ceil(self.max_model_len / factor)),
        ).validate()
        cost = CostModel(
            step_overhead_s=self.cost.step_overhead_s * factor,
            prefill_token_s=self.cost.prefill_token_s * factor,
            decode_seq_s=self.cost.decode_seq_s * factor,
            context_token_s=self.cost.context_token_s * factor,
            cpu_load_block_s=self.cpu_load_block_s * factor,
        ).validate()
        return engine, cost


COST_PRESETS: dict[str, CostPreset] = {
    preset.name: preset
    for preset in (
        CostPreset(
            "h100-8b",
            "Llama-3.1-8B on one H100: step 5.75 ms + 17.25 us/prefill token + 6 us/decoding sequence, 467k KV tokens",
            CostModel(step_overhead_s=0.00575, prefill_token_s=0.00001725, decode_seq_s=0.000006, context_token_s=0.0),
            kv_tokens=467_000,
        ),
        CostPreset(
            "h100x2-70b",
            "a 70B-class model on two H100s: step 13 ms + 70 us/prefill token + 12 us/decoding sequence, "
            "210k KV tokens",
            CostModel(step_overhead_s=0.013, prefill_token_s=0.00007, decode_seq_s=0.000012, context_token_s=0.0),
            kv_tokens=210_000,
            kv_bytes_per_token=320 * 1024,
        ),
    )
}


def get_cost_preset(name: str) -> CostPreset:
    try:
        return COST_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cost preset {name!r}; choose from {', '.join(COST_PRESETS)}") from None
