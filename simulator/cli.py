"""`kvgate replica` and `kvgate sim admission` (docs/reference.md, Command line)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from kvgate.simulator.config import ConfigError, CostModel, EngineConfig, cpu_blocks_of, cpu_load_block_seconds
from kvgate.simulator.cost_presets import PCIE_GEN5_GBPS
from kvgate.simulator.reply_model import REPLY_LENGTHS, ReplyModel
from kvgate.wire.probe_api import KV_PATH, PREFIX_PATH, SCHEDULING_POLICIES


def _add_engine_options(parser: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=defaults.num_blocks,
        help=f"usable KV cache blocks (default {defaults.num_blocks})",
    )
    parser.add_argument(
        "--block-size", type=int, default=defaults.block_size, help=f"tokens per block (default {defaults.block_size})"
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=defaults.max_num_seqs,
        help=f"sequence slots per step (default {defaults.max_num_seqs})",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        help=f"token budget per step (default {defaults.max_num_batched_tokens})",
    )


def add_replica_command(subparsers) -> None:
    """`kvgate replica` (`kvgate sim`: simulator/experiment_cli.py)."""
    parser = subparsers.add_parser(
        "replica",
        help="run one simulated vLLM replica (engine model behind vLLM's HTTP API and the probe API)",
        description="Run one simulated vLLM replica: the simulator's engine model (paged KV cache, prefix "
        "cache, continuous-batching scheduler) in real time behind vLLM's OpenAI routes, /metrics with vLLM "
        f"metric names, and the kvgate probe API ({KV_PATH}, {PREFIX_PATH}). The probe and owner "
        "routes answer only the replica key of KVGATE_REPLICA_API_KEY or KVGATE_REPLICA_API_KEY_FILE, when set "
        "(never a command-line argument: any local user can read those).",
    )
    defaults = EngineConfig()
    costs = CostModel()
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8100, help="port to bind; 0 picks a free one (default 8100)")
    parser.add_argument("--name", default="sim0", help="replica name used in logs (default sim0)")
    parser.add_argument("--model-name", default="kvgate-sim", help="served model name (default kvgate-sim)")
    _add_engine_options(parser, defaults)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens; longer requests get a 400 (default: the whole cache)",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=defaults.scheduling_policy,
        help="vLLM's --scheduling-policy: fcfs (arrival order) or priority (a request's `priority` "
        f"field first, lower served first; the lowest is preempted first) (default {defaults.scheduling_policy})",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiplies the cost model's step times; 0 = as fast as possible (default 1.0)",
    )
    parser.add_argument(
        "--step-overhead-s",
        type=float,
        default=costs.step_overhead_s,
        help=f"cost model: fixed seconds per step (default {costs.step_overhead_s})",
    )
    parser.add_argument(
        "--prefill-token-s",
        type=float,
        default=costs.prefill_token_s,
        help=f"cost model: seconds per prompt token computed (default {costs.prefill_token_s})",
    )
    parser.add_argument(
        "--decode-seq-s",
        type=float,
        default=costs.decode_seq_s,
        help=f"cost model: seconds per decoding sequence (default {costs.decode_seq_s})",
    )
    parser.add_argument(
        "--context-token-s",
        type=float,
        default=costs.context_token_s,
        help=f"cost model: seconds per context token read by attention (default {costs.context_token_s})",
    )
    _add_cpu_tier_options(parser)
    _add_reply_options(parser, ReplyModel())
    parser.set_defaults(func=run_replica)


def _add_cpu_tier_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-offloading-size",
        type=float,
        default=0.0,
        help="vLLM's --kv-offloading-size: a CPU tier of this many GiB of KV (vLLM's native offloading: "
        "blocks stored as they are computed, LRU, loaded back instead of recomputed); 0 = none (default 0)",
    )
    parser.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=128 * 1024,
        help="KV bytes of one token, to size the CPU tier and price a load (default 131072: an 8B model; "
        "327680 for a 70B)",
    )
    parser.add_argument(
        "--cpu-load-gbps",
        type=float,
        default=PCIE_GEN5_GBPS,
        help=f"host-to-device GB/s of a CPU-tier load (default {PCIE_GEN5_GBPS:g}: PCIe Gen5 x16)",
    )


def _add_reply_options(parser: argparse.ArgumentParser, defaults: ReplyModel) -> None:
    parser.add_argument(
        "--reply-lengths",
        choices=REPLY_LENGTHS,
        default=defaults.lengths,
        help="sampled: each reply draws its length and ends on its own, max_tokens only caps it; "
        "max_tokens: every reply is exactly max_tokens long, never a tool call (what the benchmarks use) "
        f"(default {defaults.lengths})",
    )
    parser.add_argument(
        "--reply-median-tokens",
        type=int,
        default=defaults.median_tokens,
        help=f"median of the lognormal reply length, in tokens (default {defaults.median_tokens})",
    )
    parser.add_argument(
        "--reply-sigma",
        type=float,
        default=defaults.sigma,
        help=f"sigma (shape) of the lognormal reply length (default {defaults.sigma})",
    )
    parser.add_argument(
        "--tool-call-rate",
        type=float,
        default=defaults.tool_call_rate,
        help="share of replies to a request offering tools that call one, with schema-valid arguments "
        f"(default {defaults.tool_call_rate})",
    )
    parser.add_argument(
        "--reply-seed",
        type=int,
        default=defaults.seed,
        help="seed of reply lengths and tool calls; a reply is a function of it and the prompt "
        f"(default {defaults.seed})",
    )


def reply_model_of(args: argparse.Namespace) -> ReplyModel:
    return ReplyModel(
        args.reply_lengths, args.reply_median_tokens, args.reply_sigma, args.tool_call_rate, args.reply_seed
    ).validate()


def run_replica(args: argparse.Namespace) -> int:
    from kvgate.wire.replica_auth import OPEN_WARNING, ReplicaKeyError, replica_key_from_env

    try:
        replica_api_key = replica_key_from_env(os.environ)
    except ReplicaKeyError as error:
        print(f"kvgate replica: error: {error}", file=sys.stderr)
        return 2
    if replica_api_key is None:
        print(OPEN_WARNING, file=sys.stderr)
    try:
        config = EngineConfig(
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            scheduling_policy=args.scheduling_policy,
            cpu_blocks=cpu_blocks_of(args.kv_offloading_size, args.kv_bytes_per_token, args.block_size),
        ).validate()
        cost_model = CostModel(
            args.step_overhead_s,
            args.prefill_token_s,
            args.decode_seq_s,
            args.context_token_s,
            cpu_load_block_seconds(args.kv_bytes_per_token, args.block_size, args.cpu_load_gbps),
        ).validate()
        reply_model = reply_model_of(args)
        if args.time_scale < 0:
            raise ConfigError(f"time_scale must be >= 0 (got {args.time_scale})")
        if not 0 <= args.port <= 65535:
            raise ConfigError(f"port must be in 0..65535 (got {args.port})")
    except ConfigError as error:
        print(f"kvgate replica: error: {error}", file=sys.stderr)
        return 2
    return asyncio.run(_serve_replica(args, config, cost_model, replica_api_key, reply_model))


async def _serve_replica(
    args: argparse.Namespace,
    config: EngineConfig,
    cost_model: CostModel,
    replica_api_key: str | None = None,
    reply_model: ReplyModel | None = None,
) -> int:
    from kvgate.simulator.replica_server import SimulatedReplica

    try:
        replica = await SimulatedReplica.start(
            args.name,
            args.host,
            args.port,
            time_scale=args.time_scale,
            cost_model=cost_model,
            model_name=args.model_name,
            replica_api_key=replica_api_key,
            reply_model=reply_model,
            **vars_of(config),
        )
    except OSError as error:
        print(
            f"kvgate replica: error: cannot bind {args.host}:{args.port}: {error.strerror or error}; "
            "choose another --port (0 picks a free one)",
            file=sys.stderr,
        )
        return 1
    print(
        f"kvgate replica {args.name}: simulated vLLM serving '{args.model_name}' on {replica.url} "
        f"(num_blocks={config.num_blocks}, block_size={config.block_size}, max_num_seqs={config.max_num_seqs}, "
        f"max_num_batched_tokens={config.max_num_batched_tokens}, max_model_len={config.effective_max_model_len}, "
        f"time_scale={args.time_scale}, scheduling_policy={config.scheduling_policy}, cpu_blocks={config.cpu_blocks}, "
        f"reply_lengths={args.reply_lengths})",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await replica.stop()
    return 0


def vars_of(config: EngineConfig) -> dict:
    return {
        "num_blocks": config.num_blocks,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_model_len": config.max_model_len,
        "scheduling_policy": config.scheduling_policy,
        "cpu_blocks": config.cpu_blocks,
    }
