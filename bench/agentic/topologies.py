"""Scale-out modes of `kvgate bench agentic` (docs/ARCHITECTURE.md, Topologies).

Each runs the same working_set-policy gate as `kvgate-working_set` (one kvgate in front of
every replica), laid out differently; sessions are split over two kvgates by index:

- `tiers`: a replica gate (`role: replica_gate`) beside each replica and two front doors
  (`role: front_door`, gate off) listing those gates: the recommended layout;
- `naive`: two standalone kvgates, each enforcing on every replica, conflict detection
  off (`ownership.ttl_sec: 0`): each prices the replicas' caches as if alone;
- `naive-detected`: the same two with conflict detection on: the late one finds every
  replica owned, shadows them, and says so (`kvgate_gate_conflict`, /ready 503; the run
  waits for that 503, up to `DETECTION_DEADLINE_SEC`, before it routes a client). Clients
  use the kvgates whose /ready is 200, as a Kubernetes Service or any load balancer with
  readiness checks would: so all sessions go through the one gate that owns the replicas.
"""

from __future__ import annotations

import asyncio

import aiohttp

from kvgate.bench.processes import ServerGroup

TOPOLOGY_MODES = ("tiers", "naive", "naive-detected")
FRONT_DOORS = 2
# How long `naive-detected` waits for the late kvgate to find the replicas owned: its claim
# rounds come every third of ownership.ttl_sec (15 s by default).
DETECTION_DEADLINE_SEC = 30.0


def topology_gate(mode: str, settings: dict) -> dict:
    """The `gate:` of the kvgates that gate in `mode` (the front doors of `tiers` run with it off)."""
    if mode not in TOPOLOGY_MODES:
        raise ValueError(f"unknown topology mode {mode!r}; choose from {', '.join(TOPOLOGY_MODES)}")
    return {**settings, "mode": "enforce", "policy": "working_set"}


async def start_topology(
    servers: ServerGroup, mode: str, urls: list[str], settings: dict
) -> tuple[list[str], list[str]]:
    """Start the kvgates of `mode` in front of `urls`: (the URLs clients use, every kvgate's URL)."""
    gate = topology_gate(mode, settings)
    names = [f"r{i}" for i in range(len(urls))]
    if mode == "tiers":
        gates = await asyncio.gather(
            *(
                servers.start_kvgate(f"gate{i}", [url], gate, extra={"role": "replica_gate"}, names=[names[i]])
                for i, url in enumerate(urls)
            )
        )
        doors = list(
            await asyncio.gather(
                *(
                    servers.start_kvgate(
                        f"door{i}", list(gates), {"mode": "off"}, extra={"role": "front_door"}, names=names
                    )
                    for i in range(FRONT_DOORS)
                )
            )
        )
        return doors, doors + list(gates)
    ttl = {"ownership": {"ttl_sec": 0}} if mode == "naive" else None
    doors = [await servers.start_kvgate("kvgate0", urls, gate, extra=ttl)]
    # with detection on, the second one is not ready (it only shadows): wait for it to be alive
    doors.append(
        await servers.start_kvgate(
            "kvgate1", urls, gate, extra=ttl, ready_path="/ready" if mode == "naive" else "/health"
        )
    )
    if mode == "naive-detected":
        await until_not_ready(doors[1], DETECTION_DEADLINE_SEC)
    ready = [url for url, ok in zip(doors, await asyncio.gather(*(is_ready(url) for url in doors))) if ok]
    return ready, doors


async def until_not_ready(url: str, deadline_sec: float) -> None:
    """Wait until the kvgate at `url` answers /ready with anything but 200, or `deadline_sec`.
    A late kvgate learns that the replicas are owned from its claims' answers; a claim that
    times out (1 s, on a loaded machine) leaves it ready until its next round."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_sec
    while await is_ready(url) and loop.time() < give_up:
        await asyncio.sleep(0.2)


async def is_ready(url: str) -> bool:
    async with aiohttp.ClientSession() as http:
        try:
            async with http.get(url + "/ready", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False


async def gate_conflicts(http: aiohttp.ClientSession, kvgate_urls: list[str]) -> dict[str, float]:
    """`kvgate_gate_conflict` summed over replicas, per kvgate URL (0 when it has none)."""
    out = {}
    for url in kvgate_urls:
        total = 0.0
        try:
            async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith("kvgate_gate_conflict{"):
                        total += float(line.rsplit(" ", 1)[1])
        except (TimeoutError, aiohttp.ClientError, ValueError):
            total = float("nan")
        out[url] = total
    return out
