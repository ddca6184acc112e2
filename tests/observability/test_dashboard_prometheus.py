"""A real Prometheus scrapes kvgate and two simulated replicas under a short thrash load;
every query of the Grafana dashboard (parsed out of docker/grafana/kvgate.json) must
return data through Prometheus's HTTP API, and the alert rules must load and evaluate.

This is what catches a metric renamed in the code but not in the dashboard, the names
agreed with other branches included (`kvgate_window_ends_total`, `kvgate_gate_conflict`,
the `work_conserving` reason: this load admits work-conserving turns every run). Queries are
run as Grafana would run them, with the dashboard's variables substituted: `$replica`
by the "All" value `.*`, `$__rate_interval` by RATE_INTERVAL.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import yaml

from kvgate.balancer.settings import BalancerSettings, HealthSettings, ReplicaSettings
from kvgate.bench.agentic.driver import WorkloadDriver
from kvgate.bench.agentic.workload import WorkloadSpec, generate_workload
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.settings import Settings
from kvgate.simulator.replica_server import start_simulated_replicas
from kvgate.simulator.reply_model import FIXED_LENGTHS
from tests.observability.helpers import ALERT_RULES, DASHBOARD, dashboard_queries

RATE_INTERVAL = "1m"
SCRAPE_INTERVAL_SEC = 0.5
SCRAPE_INTERVAL = f"{SCRAPE_INTERVAL_SEC * 1000:.0f}ms"  # as often as the mirror refreshes

# A thrash load in a few seconds: 8 concurrent sessions whose prompts need about twice
# the two replicas' caches, growing every turn, with retries (409s) and short tool calls.
WORKLOAD = WorkloadSpec(
    sessions=24,
    concurrency=8,
    turns_min=4,
    turns_max=6,
    system_prompt_words=150,
    shared_system_prompt=False,
    task_words=40,
    tool_result_words_min=60,
    tool_result_words_max=120,
    reply_tokens=4,
    tool_latency_median_s=0.05,
    tool_latency_sigma=0.3,
    retry_prob=0.1,
)
SUMMARY = {
    "admissions": "sum by (reason) (kvgate_admissions_total)",
    "reprefill_tokens_estimated": "sum(kvgate_reprefill_tokens_estimated_total)",
    "max_pending": "max by (replica) (max_over_time(kvgate_waiters[1m]))",
    "max_oldest_waiter_s": "max by (replica) (max_over_time(kvgate_oldest_waiter_seconds[1m]))",
    "hit_rate": "sum by (replica) (kvgate_replica_prefix_cache_hits_total)"
    " / sum by (replica) (kvgate_replica_prefix_cache_queries_total)",
    "upstream_errors": "sum by (kind) (kvgate_upstream_errors_total)",
    "window_ends": "sum by (cause) (kvgate_window_ends_total)",
}
# Replies of exactly max_tokens: the workload's reply lengths make the thrash load.
REPLICA_SHAPE = dict(
    num_blocks=96,
    block_size=16,
    max_num_seqs=16,
    max_num_batched_tokens=512,
    max_model_len=1536,
    time_scale=1.0,
    reply_model=FIXED_LENGTHS,
)


def as_grafana_runs_it(expr: str) -> str:
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$replica", ".*")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus_config(kvgate: str, replicas: dict[str, str]) -> dict:
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [str(ALERT_RULES)],
        "scrape_configs": [
            {"job_name": "kvgate", "static_configs": [{"targets": [kvgate]}]},
            {
                "job_name": "vllm",
                "static_configs": [
                    {"targets": [address], "labels": {"replica": name}} for name, address in replicas.items()
                ],
            },
        ],
    }


class Prometheus:
    """A Prometheus server in a subprocess, on a free loopback port, storing under `root`."""

    def __init__(self, binary: str, root: Path, config: dict) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = root / "prometheus.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={root / 'prometheus.yml'}",
                    f"--storage.tsdb.path={root / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    async def wait_ready(self, http: aiohttp.ClientSession, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited:\n{self.log.read_text()[-2000:]}"
            try:
                async with http.get(self.url + "/-/ready") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        raise AssertionError(f"prometheus not ready after {timeout_s}s:\n{self.log.read_text()[-2000:]}")

    async def wait_scraping(self, http: aiohttp.ClientSession, targets: int, timeout_s: float = 30.0) -> None:
        """Until every target has been scraped successfully once (discovery takes ~5 s)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            active = (await self.api(http, "targets"))["activeTargets"]
            if len(active) == targets and all(t["health"] == "up" for t in active):
                return
            await asyncio.sleep(0.25)
        raise AssertionError(f"prometheus does not scrape all {targets} targets: {active}")

    async def api(self, http: aiohttp.ClientSession, path: str, **params) -> dict:
        async with http.get(self.url + "/api/v1/" + path, params=params) as resp:
            doc = await resp.json()
        assert doc.get("status") == "success", f"{path} {params}: {doc}"
        return doc["data"]

    async def query(self, http: aiohttp.ClientSession, expr: str) -> list[dict]:
        return (await self.api(http, "query", query=expr))["result"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def finite_values(result: list[dict]) -> list[float]:
    return [float(r["value"][1]) for r in result if math.isfinite(float(r["value"][1]))]


async def disconnect_mid_stream(http: aiohttp.ClientSession, kvgate: str, session: str) -> None:
    """A client that reads the first chunk of a streamed turn and hangs up."""
    body = {
        "model": "sim",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 400,
        "stream": True,
    }
    resp = await http.post(kvgate + "/v1/chat/completions", json=body, headers={"x-session-id": session})
    try:
        assert resp.status == 200
        await resp.content.readany()
    finally:
        resp.close()


async def test_every_dashboard_query_returns_data_from_a_real_prometheus(prometheus_tools, tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 20
    replicas = await start_simulated_replicas(2, host="127.0.0.1", **REPLICA_SHAPE)
    settings = replace(
        Settings(),
        gate=GateSettings(idle_grace_sec=1.0, wait_poll_sec=0.1, max_wait_sec=20.0),
        balancer=BalancerSettings(health=HealthSettings(interval_sec=0.5, timeout_sec=2.0)),
    )
    app = create_app(settings, replicas=[ReplicaSettings(r.name, r.url) for r in replicas])
    prometheus = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        try:
            host, port = await app.start("127.0.0.1", 0)
            kvgate = f"http://{host}:{port}"
            prometheus = Prometheus(
                prometheus_tools.prometheus,
                tmp_path,
                prometheus_config(f"{host}:{port}", {r.name: r.url.removeprefix("http://") for r in replicas}),
            )
            await prometheus.wait_ready(http)
            await prometheus.wait_scraping(http, targets=3)

            driver = WorkloadDriver(generate_workload(WORKLOAD, seed=13), lambda s: kvgate, "sim", http, 60.0)
            disconnects = [disconnect_mid_stream(http, kvgate, f"leaver-{i}") for i in range(3)]
            started = time.monotonic()
            await asyncio.gather(driver.run(), *disconnects)
            print(f"load: {len(driver.turns)} turns in {time.monotonic() - started:.1f}s")
            ok = [t for t in driver.turns if t.ok]
            assert len(ok) >= len(driver.turns) * 0.9, "the load itself failed; see the kvgate log"

            # ---- every dashboard query returns data, and the mirror caught up -------------------
            # The last changes reach the mirror (every 0.5 s) and Prometheus (every 0.5 s) a
            # second or two after the load, more on a loaded machine: ask again until every panel has
            # data, the mirrored counters equal the replicas' own and the admissions counted reach
            # those the clients saw, for up to a minute; a panel whose query can never have data,
            # or a counter that drifts, stays so and fails below.
            async def mirror_pairs() -> list[tuple]:
                pairs = []
                for r in replicas:
                    for source, mirror in (
                        ("vllm:prefix_cache_hits_total", "kvgate_replica_prefix_cache_hits_total"),
                        ("vllm:prefix_cache_queries_total", "kvgate_replica_prefix_cache_queries_total"),
                    ):
                        own = finite_values(await prometheus.query(http, f'sum({source}{{replica="{r.name}"}})'))
                        mirrored = finite_values(
                            await prometheus.query(http, f'sum({mirror}{{job="kvgate", replica="{r.name}"}})')
                        )
                        pairs.append((r.name, source, own, mirrored))
                return pairs

            # Every admission the clients saw (an answer's header, or a stream cut mid-way), which
            # the scraped counter must reach.
            admitted = sum(1 for a in driver.attempts if a.admission) + len(disconnects)

            async def admissions_counted() -> list[float]:
                return finite_values(await prometheus.query(http, "sum(kvgate_admissions_total)"))

            deadline = time.monotonic() + 60
            while True:
                empty = []
                for title, expr in queries:
                    result = await prometheus.query(http, as_grafana_runs_it(expr))  # valid PromQL or fails
                    if not finite_values(result):
                        empty.append(f"{title}: {expr} -> {result}")
                mirrored_pairs = await mirror_pairs()
                caught_up = all(own and own == mirrored for _, _, own, mirrored in mirrored_pairs)
                caught_up = caught_up and sum(await admissions_counted()) >= admitted
                if (not empty and caught_up) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(SCRAPE_INTERVAL_SEC)
            targets = (await prometheus.api(http, "targets"))["activeTargets"]
            assert not empty, "dashboard panels without data:\n" + "\n".join(empty) + f"\ntargets: {targets}"

            summary = {}
            for label, q in SUMMARY.items():  # printed with -s: what the load did to the gate
                summary[label] = {
                    ",".join(r["metric"].values()) or "all": round(float(r["value"][1]), 3)
                    for r in await prometheus.query(http, q)
                }
            print("under the load:", json.dumps(summary))

            # ---- the replica variable lists both replicas ---------------------------------
            variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "replica")
            metric = re.fullmatch(r"label_values\((\w+), replica\)", variable["definition"]).group(1)
            names = await prometheus.api(http, "label/replica/values", **{"match[]": metric})
            assert set(names) >= {r.name for r in replicas}

            # ---- the mirror equals the replicas' own counters --------------------------------
            for name, source, own, mirrored in mirrored_pairs:
                assert own and own == mirrored and own[0] > 0, (name, source, own, mirrored)

            # ---- the thrash load showed what the dashboard is for ---------------------------
            hit_rate = finite_values(await prometheus.query(http, as_grafana_runs_it(queries[0][1])))
            assert hit_rate and all(0 <= v <= 1 for v in hit_rate)
            waits = finite_values(await prometheus.query(http, "sum(kvgate_admission_reason_wait_seconds_count)"))
            admissions = await admissions_counted()
            assert waits == admissions and waits[0] >= admitted, (waits, admissions, admitted)
            errors = await prometheus.query(http, 'kvgate_upstream_errors_total{kind="client_disconnect"}')
            assert sum(finite_values(errors)) >= 1

            # ---- Prometheus loaded and evaluates the alert rules ----------------------------
            groups = (await prometheus.api(http, "rules"))["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            assert {rule["name"] for rule in rules} >= {"KvgateSessionsStarving", "KvgateGateConflict"}
            assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules]
        finally:
            if prometheus is not None:
                prometheus.stop()
            await app.close()
            for r in replicas:
                await r.stop()
    assert app.admission.counts() == {"leases": 0, "windows": 0, "waiters": 0, "attempts": 0, "sessions": 0}
