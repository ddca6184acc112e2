"""The engine model's knobs: cache and scheduler shape (`EngineConfig`) and the
real-time step cost (`CostModel`).

Names follow vLLM's engine arguments (`--num-gpu-blocks-override`, `--block-size`,
`--max-num-seqs`, `--max-num-batched-tokens`, `--max-model-len`) so a reader can map a
simulated replica onto a real one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.wire.probe_api import SCHEDULING_POLICIES  # vLLM's `--scheduling-policy` values


class ConfigError(ValueError):
    """An invalid engine or experiment parameter; the message names the parameter."""


@dataclass(frozen=True)
class EngineConfig:
    """Shape of one simulated engine.

    `num_blocks` counts *usable* KV blocks. vLLM's `num_gpu_blocks` also counts one
    reserved null block, so the replica reports `num_blocks + 1` in
    `vllm:cache_config_info`, as a real server would.
    `max_model_len` None means the whole cache (`num_blocks * block_size`).
    """

    num_blocks: int = 4096
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    # vLLM's `--scheduling-policy`: "fcfs" serves waiting requests in arrival order and
    # preempts the newest running one; "priority" orders both by (priority, arrival).
    scheduling_policy: str = "fcfs"
    # vLLM's native KV offloading (`--kv-offloading-size`): a CPU tier of this many blocks
    # (`kvgate.simulator.cpu_tier`); 0 = no CPU tier.
    cpu_blocks: int = 0

    @property
    def cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def effective_max_model_len(self) -> int:
        return self.cache_tokens if self.max_model_len is None else self.max_model_len

    def validate(self) -> EngineConfig:
        """Return self, or raise ConfigError naming the first bad parameter."""
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1 (got {self.block_size})")
        if self.num_blocks < 1:
            raise ConfigError(
                f"num_blocks must be >= 1: the cache must hold at least one block (got {self.num_blocks})"
            )
        if self.cpu_blocks < 0:
            raise ConfigError(f"cpu_blocks must be >= 0, 0 for no CPU tier (got {self.cpu_blocks})")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1 (got {self.max_num_seqs})")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)} (got {self.scheduling_policy!r})"
            )
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1 (got {self.max_num_batched_tokens})")
        if self.max_model_len is not None:
            if self.max_model_len < 2:
                raise ConfigError(f"max_model_len must be >= 2 (got {self.max_model_len})")
            if self.max_model_len > self.cache_tokens:
                raise ConfigError(
                    f"max_model_len {self.max_model_len} exceeds the KV cache "
                    f"(num_blocks x block_size = {self.cache_tokens} tokens): lower max_model_len "
                    "or raise num_blocks"
                )
        return self


@dataclass(frozen=True)
class CostModel:
    """Seconds one engine step takes, before `time_scale`.

    step = step_overhead_s
         + prefill_token_s   x prompt tokens computed in the step
         + decode_seq_s      x sequences decoding one token
         + context_token_s   x tokens of KV read by attention (context of every scheduled request)
         + cpu_load_block_s  x blocks loaded from the CPU tier (`EngineConfig.cpu_blocks`)

    Defaults resemble an 8B model (Llama-3-8B, bf16) on one H100-class GPU: ~6 ms to
    stream the weights once per step, ~20k prompt tokens/s of prefill, a small per-sequence
    sampling cost, and 128 KiB of KV per context token read at ~3 TB/s (~40 ns/token).
    A CPU-tier load moves a block's bytes over PCIe: 16 tokens x 128 KiB at 50 GB/s (PCIe
    Gen5 x16 in practice) is ~42 us (`cpu_load_block_seconds`).
    """

    step_overhead_s: float = 0.006
    prefill_token_s: float = 0.00005
    decode_seq_s: float = 0.00005
    context_token_s: float = 0.00000004
    cpu_load_block_s: float = 16 * 128 * 1024 / 50e9

    def validate(self) -> CostModel:
        for name in ("step_overhead_s", "prefill_token_s", "decode_seq_s", "context_token_s", "cpu_load_block_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"cost model {name} must be >= 0 (got {getattr(self, name)})")
        return self

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, loaded_blocks: int = 0) -> float:
        return (
            self.step_overhead_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
            + self.context_token_s * context_tokens
            + self.cpu_load_block_s * loaded_blocks
        )


def cpu_load_block_seconds(kv_bytes_per_token: int, block_size: int, load_gbps: float) -> float:
    """Seconds to load one block of `block_size` tokens from the CPU tier: its bytes over
    the host-to-device bandwidth (GB/s, 1e9 bytes)."""
    if kv_bytes_per_token < 1 or load_gbps <= 0:
        raise ConfigError(
            f"kv bytes per token must be >= 1 and the load bandwidth > 0 (got {kv_bytes_per_token}, {load_gbps})"
        )
    return kv_bytes_per_token * block_size / (load_gbps * 1e9)


def cpu_blocks_of(offloading_gib: float, kv_bytes_per_token: int, block_size: int) -> int:
    """Blocks a CPU tier of `offloading_gib` GiB holds (vLLM's `--kv-offloading-size`)."""
    if offloading_gib < 0:
        raise ConfigError(f"kv offloading size must be >= 0 GiB, 0 for none (got {offloading_gib})")
    return int(offloading_gib * 2**30 // (kv_bytes_per_token * block_size))
