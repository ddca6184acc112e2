"""One benchmark invocation: every requested mode on the same workload, each on fresh replicas.

Modes:
- `direct`: no proxy; session i goes to replica i mod R (round-robin);
- `sticky`: kvgate with `gate.mode: off` (sticky routing only);
- `kvgate-watermark`: kvgate enforcing the watermark policy;
- `kvgate-working_set`: kvgate enforcing the working_set policy;
- `kvgate-priority`: the same, on replicas that schedule by priority (vLLM's
  `--scheduling-policy priority`), forwarding the turns it would hold at low priority
  (`gate.held_priority`, 1 unless the settings say otherwise).

With simulated replicas every mode starts its own replicas (and proxy), so no mode
inherits another's cache. With `--replica-url` the servers are given and cannot be
restarted: before every mode the runner asks each for `POST /reset_prefix_cache`
(vLLM answers it when started with `VLLM_SERVER_DEV_MODE=1`) and records whether that
worked; if not, restart the servers and run one mode per invocation instead.

While a mode runs, a sampler reads the replicas' counters every `sample_interval_s`
for the hit-rate-over-time plot.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from kvgate.bench.agentic.driver import WorkloadDriver
from kvgate.bench.agentic.report import summarize_mode
from kvgate.bench.agentic.scrape import Counters, fetch_counters, fetch_probe_totals, sum_counters
from kvgate.bench.agentic.topologies import TOPOLOGY_MODES, gate_conflicts, start_topology, topology_gate
from kvgate.bench.agentic.workload import Workload
from kvgate.bench.processes import ReplicaShape, ServerGroup, process_cpu_seconds

MODES = ("direct", "sticky", "kvgate-watermark", "kvgate-working_set", "kvgate-priority")
# Mode names of earlier releases, refused with the new name.
RENAMED_MODES = {"kvgate": "kvgate-watermark", "kvgate-contract": "kvgate-working_set"}


def gate_config(mode: str, settings: dict) -> dict | None:
    """The `gate:` config of a mode (None: no proxy). `settings` are shared gate settings."""
    if mode == "direct":
        return None
    if mode == "sticky":
        return {"mode": "off"}
    if mode == "kvgate-watermark":
        return {**settings, "mode": "enforce", "policy": "watermark"}
    if mode == "kvgate-working_set":
        return {**settings, "mode": "enforce", "policy": "working_set"}
    if mode == "kvgate-priority":
        return {"held_priority": 1, **settings, "mode": "enforce", "policy": "working_set"}
    if mode in TOPOLOGY_MODES:
        return topology_gate(mode, settings)
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")


def replica_shape(mode: str, shape: ReplicaShape) -> ReplicaShape:
    """The simulated replicas' shape in `mode`: `kvgate-priority` runs them with priority
    scheduling, every other mode as vLLM runs by default (fcfs)."""
    return replace(shape, scheduling_policy="priority") if mode == "kvgate-priority" else shape


@dataclass
class RunPlan:
    workload: Workload
    modes: tuple[str, ...]
    out_dir: Path
    shape: ReplicaShape = field(default_factory=ReplicaShape)
    num_replicas: int = 2
    replica_urls: tuple[str, ...] = ()  # given servers: no simulated replicas are started
    gate_settings: dict = field(default_factory=dict)
    model: str | None = None
    request_timeout_s: float = 300.0
    sample_interval_s: float = 1.0
    api: str = "chat"  # the client API every turn speaks (bench.agentic.apis)
    cost_preset: str | None = None  # the replicas' cost preset (simulator/cost_presets.py), if any
    token_scale: float = 1.0  # one workload token stands for this many (trace regimes)

    @property
    def block_size(self) -> int:
        return self.shape.block_size


@dataclass
class ModeRun:
    summary: dict
    timeline: list[dict]  # {"t": s, "queries": cumulative delta, "hits": cumulative delta}
    attempts: list
    turns: list


async def _snapshot(http: aiohttp.ClientSession, urls: list[str]) -> Counters:
    return sum_counters(await asyncio.gather(*(fetch_counters(http, u) for u in urls)))


async def model_name(http: aiohttp.ClientSession, url: str) -> str:
    try:
        async with http.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            data = await resp.json()
            return data["data"][0]["id"]
    except (TimeoutError, aiohttp.ClientError, KeyError, IndexError, ValueError) as exc:
        raise RuntimeError(f"could not read the model name from {url}/v1/models ({exc!r}); pass --model") from exc


async def _reset_prefix_cache(http: aiohttp.ClientSession, urls: list[str], attempts: int = 25) -> str:
    """POST /reset_prefix_cache to every server; vLLM refuses while requests run, so retry a while."""
    results = []
    for url in urls:
        outcome = "not tried"
        for _ in range(attempts):
            try:
                async with http.post(url + "/reset_prefix_cache", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    outcome = f"{resp.status}"
                    if resp.status == 200:
                        break
                    if resp.status in (404, 405):
                        break  # not enabled (vLLM needs VLLM_SERVER_DEV_MODE=1): retrying cannot help
            except (TimeoutError, aiohttp.ClientError) as exc:
                outcome = type(exc).__name__
            await asyncio.sleep(0.2)
        results.append(f"{url}: {outcome}")
    return "; ".join(results)


async def _sample(http, urls, start: Counters, t0: float, interval: float, into: list[dict]) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            now = (await _snapshot(http, urls)).minus(start)
        except RuntimeError:
            continue  # a missed sample only thins the plot
        into.append({"t": time.perf_counter() - t0, "queries": now.queries, "hits": now.hits})


async def run_mode(plan: RunPlan, mode: str, ceiling_hit_rate: float) -> ModeRun:
    """Run the workload once in `mode` and summarise it."""
    gate = gate_config(mode, plan.gate_settings)
    mode_dir = plan.out_dir / "logs" / mode
    async with (
        ServerGroup(mode_dir) as servers,
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        ) as http,
    ):
        reset = None
        if plan.replica_urls:
            urls = list(plan.replica_urls)
            reset = await _reset_prefix_cache(http, urls)
            if any(not part.endswith(": 200") for part in reset.split("; ")):
                print(
                    f"[agentic] warning: could not reset the prefix cache before {mode} ({reset}); "
                    "this mode starts with whatever the servers cached before: restart them and run one "
                    "mode per invocation, or start vLLM with VLLM_SERVER_DEV_MODE=1"
                )
        else:
            urls = list(
                await asyncio.gather(
                    *(
                        servers.start_replica(f"replica{i}", replica_shape(mode, plan.shape))
                        for i in range(plan.num_replicas)
                    )
                )
            )
        model = plan.model or await model_name(http, urls[0])
        kvgates: list[str] = []
        proxy_url: str | None = None  # the one kvgate of a single-proxy mode
        if gate is None:

            def target(session, urls=urls):
                return urls[session.index % len(urls)]
        elif mode in TOPOLOGY_MODES:
            entry_points, kvgates = await start_topology(servers, mode, urls, plan.gate_settings)

            def target(session, entry_points=entry_points):
                return entry_points[session.index % len(entry_points)]
        else:
            proxy_url = url = await servers.start_kvgate("kvgate", urls, gate)

            def target(session, url=url):
                return url

        before = await _snapshot(http, urls)
        driver = WorkloadDriver(plan.workload, target, model, http, plan.request_timeout_s, plan.api)
        timeline: list[dict] = []
        proxies = {name: pid for name, pid in servers.pids().items() if not name.startswith("replica")}
        cpu_before = cpu_seconds(proxies)
        load_cpu_before = time.process_time()
        t0 = time.perf_counter()
        sampler = asyncio.create_task(_sample(http, urls, before, t0, plan.sample_interval_s, timeline))
        try:
            makespan = await driver.run()
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        load_cpu = time.process_time() - load_cpu_before
        proxy_cpu = cpu_seconds(proxies) - cpu_before if proxies else None
        delta = (await _snapshot(http, urls)).minus(before)
        # the gate's probes over the run (a fresh kvgate per mode: its totals are the run's)
        probes = await fetch_probe_totals(http, proxy_url) if proxy_url is not None else None
        conflicts = await gate_conflicts(http, kvgates) if kvgates else None
        timeline.append({"t": time.perf_counter() - t0, "queries": delta.queries, "hits": delta.hits})
    summary = summarize_mode(
        mode, driver.attempts, driver.turns, delta, makespan, ceiling_hit_rate, plan.workload.num_turns
    )
    summary["gate"] = gate
    summary["cpu_s"] = cpu_summary(proxy_cpu, delta.cpu_seconds, load_cpu)
    if probes is not None:
        summary["gate_probes"] = probes
    summary["api"] = plan.api
    if conflicts is not None:  # kvgate_gate_conflict summed over replicas, per kvgate the clients used
        summary["gate_conflicts"] = list(conflicts.values())
    if reset is not None:
        summary["prefix_cache_reset"] = reset
    return ModeRun(summary, timeline, driver.attempts, driver.turns)


def cpu_seconds(pids: dict[str, int]) -> float:
    """CPU seconds the processes `pids` have used so far (summed; a gone process counts 0)."""
    return sum(process_cpu_seconds(pid) or 0.0 for pid in pids.values())


def cpu_summary(proxy: float | None, servers: float | None, load: float) -> dict[str, float | None]:
    """CPU seconds a mode's run took, by process: the kvgate proxies (None: no proxy), the
    replicas' server processes (`process_cpu_seconds_total` of their /metrics: vLLM's API
    server, not its engine core; None when they do not export it), the load generator."""
    return {"kvgate": proxy, "replica_server": servers, "load_generator": load}


def median_run(runs: list[ModeRun]) -> ModeRun:
    """The run with the median makespan (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: r.summary["makespan_s"])
    return ordered[(len(ordered) - 1) // 2]


async def run_plan(plan: RunPlan, ceiling_hit_rate: float, repeat: int = 1, log=print) -> dict[str, ModeRun]:
    """Run every mode of `plan`, `repeat` rounds (modes interleaved, so drift in the machine's
    load hits every mode alike); returns per mode its median-makespan run, whose summary
    also lists every round's makespan and hit rate."""
    rounds: dict[str, list[ModeRun]] = {mode: [] for mode in plan.modes}
    for round_index in range(repeat):
        for mode in plan.modes:
            label = f"mode {mode}" + (f" (round {round_index + 1}/{repeat})" if repeat > 1 else "")
            log(f"[agentic] {label}: {len(plan.workload.sessions)} sessions, {plan.workload.num_turns} turns ...")
            started = time.perf_counter()
            run = await run_mode(plan, mode, ceiling_hit_rate)
            rounds[mode].append(run)
            s = run.summary
            log(
                f"[agentic] {label}: hit rate {s['hit_rate']:.3f}, makespan {s['makespan_s']:.1f}s, "
                f"failed turns {s['turns_failed'] + s['turns_not_run']} "
                f"(wall {time.perf_counter() - started:.0f}s)"
            )
    chosen: dict[str, ModeRun] = {}
    for mode, runs in rounds.items():
        chosen[mode] = median_run(runs)
        chosen[mode].summary["rounds"] = [
            {
                "makespan_s": r.summary["makespan_s"],
                "hit_rate": r.summary["hit_rate"],
                "turns_failed": r.summary["turns_failed"],
            }
            for r in runs
        ]
    return chosen
