"""Security conformance table: one row per finding of the red-team pass.

Each row plays the attack as it was reproduced, against real parts on loopback (kvgate
apps, `kvgate replica`'s app, the owner record, aiohttp clients), and states what must
hold instead. `f1_...` is finding 1; finding 7's items are `f7a` to `f7e`, finding 8 is
client authentication. Every row failed on the code before these fixes and passes now.
The vLLM plugin enforces the same replica-side rules as the simulated replica used here:
tests/vllm_plugin/test_replica_security.py checks them on a real vLLM server.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import orjson
import yaml
from aiohttp import web
from security_parts import CLEAN, chat, finish_every_session, renewals, replica_config, until

from kvgate.bench.tiers import start_tiered

REPLICA_KEY = "replica-key-Zq81"  # the gates' credential for the replica API
VLLM_KEY = "vllm-client-key-Hy27"  # the replicas' client key (vLLM --api-key)
CLIENT_KEY = "client-key-Pw55"  # a tenant's key for kvgate (auth.api_keys)
ADMIN_TOKEN = "admin-token-Xk09"
GATE_HEADERS = {"X-Kvgate-Replica-Key": REPLICA_KEY}
SECRETS = (REPLICA_KEY, VLLM_KEY, CLIENT_KEY, ADMIN_TOKEN)
ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    """An upstream that answers every route like a replica and keeps every request's headers."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.paths: list[str] = []

    def app(self) -> web.Application:
        async def any_route(request: web.Request) -> web.Response:
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
            self.paths.append(request.path)
            await request.read()
            if request.path == "/v1/kvgate/kv":
                doc = {"version": 1, "kv_cache_usage": 0.1, "num_total_blocks": 100, "num_free_blocks": 90}
                return web.json_response({**doc, "block_size": 16})
            if request.path == "/v1/kvgate/owner":
                return web.json_response({"version": 1, "held": True, "expires_in_sec": 10.0, "contenders": 0})
            if request.path == "/v1/chat/completions":
                message = {"role": "assistant", "content": "ok"}
                return web.json_response({"id": "c", "choices": [{"index": 0, "message": message}]})
            return web.json_response({"status": "ok"})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", any_route)
        return app

    def saw(self, secret: str) -> bool:
        return any(secret in value for headers in self.headers for value in headers.values())


# ---- finding 1: anyone who could reach a replica could switch its gate off ----------------


async def test_f1_the_owner_record_cannot_be_read_released_or_taken_by_others(parts, http):
    (replica,) = await parts.replicas(replica_api_key=REPLICA_KEY)
    gate = await parts.kvgate(
        replica_config(replica, upstream={"replica_api_key": REPLICA_KEY}, ownership={"ttl_sec": 1.5}),
        health_checks=True,
    )
    owner_url = replica.url + "/v1/kvgate/owner"
    await until(lambda: gate.app.ownership.ownership().get(replica.name, None) is not None, "the first claim")
    claim_id = gate.app.ownership.gate_id
    # a client of vLLM (with its key, without the gates' credential) gets nothing
    vllm_client = {"Authorization": f"Bearer {VLLM_KEY}"}
    async with http.get(owner_url, headers=vllm_client) as resp:
        assert resp.status == 401
    async with http.post(owner_url, json={"gate_id": claim_id, "ttl_sec": 0}, headers=vllm_client) as resp:
        assert resp.status == 401
    # even a holder of the credential: GET names no owner, and the owner's id releases nothing
    async with http.get(owner_url, headers=GATE_HEADERS) as resp:
        assert resp.status == 200 and claim_id not in await resp.text()
    async with http.post(owner_url, json={"gate_id": claim_id, "ttl_sec": 0}, headers=GATE_HEADERS) as resp:
        assert resp.status in (200, 403)
    async with http.post(owner_url, json={"gate_id": "evil", "ttl_sec": 3600}, headers=GATE_HEADERS) as resp:
        taken = await resp.json()
    assert taken["held"] is False
    await renewals(gate, replica.name, 2)
    assert gate.app.ownership.ownership()[replica.name].status == "owner"
    async with http.get(gate.url + "/ready") as resp:
        assert resp.status == 200


# ---- finding 2: the contender list was unbounded, and logged whole ---------------------------


async def test_f2_contenders_are_capped_and_logged_as_counts(parts, http, caplog):
    """Played on a replica without the replica key, where anyone may claim (docs/security.md).

    The owner learns of the contenders at its next renewal, which may fall anywhere in the
    flood of 400 claims on a loaded machine: the count it first logs is whatever had
    arrived by then, so the test waits for renewals that see the cap instead of assuming
    the flood ends before the next one."""
    (replica,) = await parts.replicas()
    caplog.set_level(logging.INFO, logger="kvgate")
    # ttl 3 s (a renewal a second): three renewals in a row must fail before the owner's lease
    # lapses, which a starved event loop does not do, while a lapsed lease would let a flood
    # claim take the record.
    gate = await parts.kvgate(replica_config(replica, ownership={"ttl_sec": 3.0}))
    owner_url = replica.url + "/v1/kvgate/owner"
    await until(lambda: gate.app.ownership.ownership().get(replica.name) is not None, "the first claim")
    ids = [f"{index:d}".rjust(256, "x") for index in range(400)]
    for gate_id in ids:
        async with http.post(owner_url, json={"gate_id": gate_id, "ttl_sec": 3600}) as resp:
            assert resp.status == 200 and len(await resp.read()) < 1024
    async with http.get(owner_url) as resp:
        assert len(await resp.read()) < 1024
    await until(lambda: gate.app.ownership.ownership()[replica.name].contenders == 16, "a renewal seeing the cap")
    await renewals(gate, replica.name, 2)  # more renewals: the count changes nothing more in the log
    conflict_lines = [r.getMessage() for r in caplog.records if "also try to enforce" in r.getMessage()]
    assert len(conflict_lines) == 1 and re.search(r" \d+ other kvgate\(s\)", conflict_lines[0]), conflict_lines
    assert not any(gate_id in record.getMessage() for record in caplog.records for gate_id in ids[:16])
    assert max(len(record.getMessage()) for record in caplog.records) < 2000
    standing = gate.app.ownership.ownership()[replica.name]
    assert (standing.status, standing.contenders) == ("owner", 16)


# ---- finding 3: the prefix probe was an exact cache side channel ------------------------------


async def test_f3_probes_answer_only_gates(parts, http):
    (replica,) = await parts.replicas(replica_api_key=REPLICA_KEY)
    probe = {"chat": chat("my salary is 120000")}
    for headers in ({}, {"Authorization": f"Bearer {VLLM_KEY}"}, {"X-Kvgate-Replica-Key": "guess"}):
        async with http.post(replica.url + "/v1/kvgate/prefix", json=probe, headers=headers) as resp:
            assert resp.status == 401, headers
        async with http.get(replica.url + "/v1/kvgate/kv", headers=headers) as resp:
            assert resp.status == 401, headers
    async with http.post(replica.url + "/v1/kvgate/prefix", json=probe, headers=GATE_HEADERS) as resp:
        assert resp.status == 200


# ---- finding 4: a probe could cost far more than the turn ---------------------------------------


async def test_f4_a_prompt_longer_than_max_model_len_is_refused_before_the_engine(parts, http, monkeypatch):
    from kvgate.simulator import replica_server

    (replica,) = await parts.replicas(num_blocks=64, block_size=16, max_model_len=512)
    turns: list[str] = []
    parse_turn = replica_server._parse

    def counted_turn(kind, *args):
        turns.append(kind)
        return parse_turn(kind, *args)

    monkeypatch.setattr(replica_server, "_parse", counted_turn)
    engine_probes: list[int] = []
    prefix_answer = replica.engine.prefix_answer

    def counted(token_ids, cache_salt=None):
        engine_probes.append(len(token_ids))
        return prefix_answer(token_ids, cache_salt)

    replica.engine.prefix_answer = counted  # type: ignore[method-assign]
    for body in ({"token_ids": [1] * 100_000}, {"chat": chat("word " * 5_000)}):
        async with http.post(replica.url + "/v1/kvgate/prefix", json=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "prompt_too_long"
    assert engine_probes == []
    # through kvgate: the over-long turn is refused, never forwarded, and the engine hashes nothing
    gate = await parts.kvgate(replica_config(replica))
    async with http.post(
        gate.url + "/v1/chat/completions", json=chat("word " * 200_000), headers={"x-session-id": "big"}
    ) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "prompt_too_long"
    assert engine_probes == [] and turns == []


async def test_f4b_kvgate_refuses_an_over_long_body_before_probing_or_forwarding(parts, http, monkeypatch):
    """A 14 MB chat body: the replica's kv answer (max_model_len, max_token_bytes) proves it too
    long, so kvgate answers 400 prompt_too_long and the replica reads no byte of it (no prefix
    probe, no turn): on a session's first turn, its next one, and an anonymous one."""
    from kvgate.simulator import replica_server

    (replica,) = await parts.replicas(num_blocks=256, block_size=16, max_model_len=4096)
    bodies_read: list[str] = []  # the replica's prefix probes and turns, by path
    read_json = replica_server._read_json

    async def counted(request):
        if not request.path.endswith("/owner"):
            bodies_read.append(request.path)
        return await read_json(request)

    monkeypatch.setattr(replica_server, "_read_json", counted)
    gate = await parts.kvgate(replica_config(replica))
    huge = orjson.dumps(chat("word " * 2_800_000))
    assert len(huge) > 14_000_000
    for session in ({"x-session-id": "big"}, {"x-session-id": "big"}, {}):
        headers = {**session, "Content-Type": "application/json"}
        async with http.post(gate.url + "/v1/chat/completions", data=huge, headers=headers) as resp:
            assert resp.status == 400, await resp.text()
            assert (await resp.json())["error"]["code"] == "prompt_too_long"
    assert bodies_read == []
    short = chat("short")
    async with http.post(gate.url + "/v1/chat/completions", json=short, headers={"x-session-id": "big"}) as resp:
        assert resp.status == 200, await resp.text()  # the session goes on with a prompt that fits
    assert "/v1/chat/completions" in bodies_read


# ---- finding 5: Responses chains escaped every bound, and could be taken over ------------------


async def test_f5_response_ids_are_bounded_like_session_ids(parts, http):
    (replica,) = await parts.replicas()
    gate = await parts.kvgate(replica_config(replica))
    long_id = "r" * 200_000
    body = {"model": "kvgate-sim", "input": "hi", "max_output_tokens": 4, "request_id": long_id}
    async with http.post(gate.url + "/v1/responses", json=body, headers={"x-session-id": "s"}) as resp:
        assert resp.status == 200
    follow = {"model": "kvgate-sim", "input": "more", "max_output_tokens": 4, "previous_response_id": long_id}
    async with http.post(gate.url + "/v1/responses", json=follow) as resp:
        assert resp.status == 200
    chains = gate.app.sessions.responses
    assert len(chains) >= 1 and max(len(key) for key in chains._links) <= 512
    state = orjson.dumps(gate.app.admission.state())
    assert long_id[:1000].encode() not in state


async def test_f5_a_session_cannot_take_over_another_sessions_chain(parts, http):
    replicas = await parts.replicas(2)
    gate = await parts.kvgate({"replicas": [{"name": r.name, "url": r.url} for r in replicas]})

    async def turn(session: str, status: int = 200, **fields) -> tuple[str, dict]:
        body = {"model": "kvgate-sim", "input": f"{session} says hi", "max_output_tokens": 4, **fields}
        async with http.post(gate.url + "/v1/responses", json=body, headers={"x-session-id": session}) as resp:
            assert resp.status == status, await resp.text()
            return resp.headers.get("x-kvgate-replica", ""), await resp.json()

    victim_replica, first = await turn("victim")
    attacker = next(
        f"attacker-{i}" for i in range(200) if gate.app.balancer.choose(f"attacker-{i}").name != victim_replica
    )
    # reusing the victim's response id as a request_id is refused before it reaches a replica
    attacker_replica, refused = await turn(attacker, 409, request_id=first["id"])
    assert attacker_replica == "" and refused["error"]["code"] == "response_id_taken"
    replica, _ = await turn("victim", previous_response_id=first["id"])
    assert replica == victim_replica


# ---- finding 6: an admin-token holder could collect the upstream key ------------------------------


async def _add_and_use(parts, http, config: dict, recorder: Recorder) -> None:
    """A kvgate with `config` (and the admin API): an admin adds `recorder`'s server as a replica,
    health checks and metrics reads reach it (ownership claims run beside them), and a client's
    turn goes there."""
    url = await parts.server(recorder.app())
    config = {
        **config,
        "admin": {"token": ADMIN_TOKEN},
        "ownership": {"ttl_sec": 0.6},
        "balancer": {"health": {"interval_sec": 0.1}},
    }
    gate = await parts.kvgate(config, health_checks=True)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with http.post(gate.url + "/admin/replicas", json={"name": "added", "url": url}, headers=admin) as resp:
        assert resp.status == 201
    # every call the gate makes to a replica without a turn (health check, metrics read) reached it
    await until(lambda: {"/health", "/metrics"} <= set(recorder.paths), "the health check and the metrics read", 30)
    async with http.post(gate.url + "/v1/chat/completions", json=chat("plan"), headers={"x-session-id": "s"}) as resp:
        assert resp.status == 200


async def test_f6_replicas_added_at_run_time_get_no_upstream_key(parts, http):
    recorder = Recorder()
    await _add_and_use(parts, http, {"upstream": {"api_key": VLLM_KEY}}, recorder)
    assert "/v1/chat/completions" in recorder.paths and not recorder.saw(VLLM_KEY)


async def test_f6_nor_the_replica_key(parts, http):
    recorder = Recorder()
    config = {"upstream": {"api_key": VLLM_KEY, "replica_api_key": REPLICA_KEY}}
    await _add_and_use(parts, http, config, recorder)
    assert "/v1/kvgate/kv" in recorder.paths  # probed, without credentials; never claimed
    assert "/v1/kvgate/owner" not in recorder.paths
    assert not recorder.saw(VLLM_KEY) and not recorder.saw(REPLICA_KEY)


async def test_f6_a_host_on_the_allow_list_gets_them(parts, http):
    recorder = Recorder()
    url = await parts.server(recorder.app())
    config = {"upstream": {"api_key": VLLM_KEY, "credential_hosts": ["127.0.0.1"]}, "admin": {"token": ADMIN_TOKEN}}
    gate = await parts.kvgate(config)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with http.post(gate.url + "/admin/replicas", json={"name": "ok", "url": url}, headers=admin) as resp:
        assert resp.status == 201
    async with http.post(gate.url + "/v1/chat/completions", json=chat(), headers={"x-session-id": "s"}) as resp:
        assert resp.status == 200
    assert recorder.saw(VLLM_KEY)


# ---- finding 7: the low ones -----------------------------------------------------------------------


async def test_f7a_two_processes_with_one_gate_id_are_a_conflict(parts):
    (replica,) = await parts.replicas()
    config = replica_config(replica, ownership={"gate_id": "g", "ttl_sec": 3})
    first = await parts.kvgate(config, "first")
    second = await parts.kvgate(config, "second")
    await first.app.ownership.round()  # the first renews and learns of the second
    statuses = {
        first.app.ownership.ownership()[replica.name].status,
        second.app.ownership.ownership()[replica.name].status,
    }
    assert statuses == {"owner", "conflict"}
    assert first.app.metrics.registry.get_sample_value("kvgate_gate_conflict", {"replica": replica.name}) == 1


async def test_f7b_tiers_with_different_session_headers_keep_the_session(http):
    """An Anthropic turn carries no `session_id` body field the replica gate could fall back on."""
    topology = await start_tiered(
        1, 1, replica_gate={"session": {"header": "x-b"}}, front_door={"session": {"header": "x-a"}}, time_scale=0.0
    )
    try:
        (door,), (gate,) = topology.front_doors, topology.replica_gates
        await until(lambda: door.app.registry.any_healthy(), "the front door's replica gate healthy")
        body = {"model": "kvgate-sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
        async with http.post(door.url + "/v1/messages", json=body, headers={"x-a": "tenant-7"}) as resp:
            assert resp.status == 200, await resp.text()
        assert b"tenant-7" in orjson.dumps(gate.app.admission.state())
    finally:
        for kvgate in topology.replica_gates + topology.front_doors:
            finish_every_session(kvgate.app.admission)
        counts = topology.gate_counts()
        await topology.close()
    assert counts == CLEAN


async def test_f7c_finish_header_on_models_ends_nothing(parts, http):
    (replica,) = await parts.replicas()
    gate = await parts.kvgate(replica_config(replica))
    async with http.post(gate.url + "/v1/chat/completions", json=chat(), headers={"x-session-id": "victim"}) as resp:
        assert resp.status == 200
    assert gate.app.admission.counts()["sessions"] == 1
    async with http.get(gate.url + "/v1/models", headers={"x-session-id": "victim", "x-session-finish": "true"}) as r:
        assert r.status == 200
    assert gate.app.admission.counts()["sessions"] == 1
    async with http.post(
        gate.url + "/v1/chat/completions",
        json=chat("bye"),
        headers={"x-session-id": "victim", "x-session-finish": "true"},
    ) as resp:
        assert resp.status == 200
    assert gate.app.admission.counts()["sessions"] == 0


async def test_f7d_a_prefix_answer_that_contradicts_itself_is_probe_unavailable(parts, http):
    from tests.gate.fake_replica import ReplicaScript, fake_replica_app

    script = ReplicaScript()
    script.prefix_raw = b'{"version": 1, "total_tokens": 0, "total_blocks": 1000000, "hit_blocks": 0, "hit_ratio": 0}'
    url = await parts.server(fake_replica_app(script))
    gate = await parts.kvgate({"replicas": [{"name": "liar", "url": url}]})
    body = chat("x" * 3000)  # its byte bound (over 100 blocks of 16) needs a prefix probe
    async with http.post(gate.url + "/v1/chat/completions", json=body, headers={"x-session-id": "s"}) as resp:
        assert resp.status == 200, await resp.text()
    assert script.prefix_requests
    errors = gate.app.metrics.registry.get_sample_value(
        "kvgate_probe_errors_total", {"replica": "liar", "probe": "prefix"}
    )
    assert errors and errors >= 1


async def test_f7e_secrets_are_never_printed(parts, http, tmp_path, capsys, caplog):
    from kvgate.cli import main

    config = tmp_path / "bad.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "upstream": {"api_key": VLLM_KEY + "\a", "replica_api_key": [REPLICA_KEY]},
                "admin": {"token": [ADMIN_TOKEN]},
                "auth": {"api_keys": [CLIENT_KEY + "\n"]},
            }
        )
    )
    assert main(["check-config", str(config)]) == 2
    printed = capsys.readouterr()
    assert "upstream.api_key" in printed.err and "admin.token" in printed.err
    assert not any(secret in printed.out + printed.err for secret in SECRETS)
    # a running kvgate shows none of them either
    caplog.set_level(logging.DEBUG)
    (replica,) = await parts.replicas(replica_api_key=REPLICA_KEY)
    gate = await parts.kvgate(
        replica_config(
            replica,
            upstream={"api_key": VLLM_KEY, "replica_api_key": REPLICA_KEY},
            admin={"token": ADMIN_TOKEN},
            auth={"api_keys": [CLIENT_KEY]},
        )
    )
    client = {"Authorization": f"Bearer {CLIENT_KEY}", "x-session-id": "s"}
    async with http.post(gate.url + "/v1/chat/completions", json=chat(), headers=client) as resp:
        assert resp.status == 200
    shown = b""
    for path, headers in (("/admin/state", {"Authorization": f"Bearer {ADMIN_TOKEN}"}), ("/metrics", client)):
        async with http.get(gate.url + path, headers=headers) as resp:
            assert resp.status == 200
            shown += await resp.read()
    shown += "\n".join(record.getMessage() for record in caplog.records).encode()
    assert not any(secret.encode() in shown for secret in SECRETS)


# ---- finding 8: kvgate had no client authentication -------------------------------------------------


async def test_f8_client_keys_guard_every_route_but_health(parts, http):
    recorder = Recorder()
    url = await parts.server(recorder.app())
    gate = await parts.kvgate({"replicas": [{"name": "r", "url": url}], "auth": {"api_keys": ["other", CLIENT_KEY]}})
    for path, method in (
        ("/v1/chat/completions", "POST"),
        ("/v1/models", "GET"),
        ("/metrics", "GET"),
        ("/ready", "GET"),
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": CLIENT_KEY}):
            async with http.request(method, gate.url + path, json=chat(), headers=headers) as resp:
                assert resp.status == 401, (path, headers)
    async with http.get(gate.url + "/health") as resp:
        assert resp.status == 200
    assert "/v1/chat/completions" not in recorder.paths and "/v1/models" not in recorder.paths
    async with http.post(
        gate.url + "/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {CLIENT_KEY}"}
    ) as resp:
        assert resp.status == 200
    async with http.post(gate.url + "/v1/chat/completions", json=chat(), headers={"x-api-key": CLIENT_KEY}) as resp:
        assert resp.status == 200
    assert recorder.headers and not recorder.saw(CLIENT_KEY)  # the client's key goes no further


def _compose_environment(service: dict) -> dict:
    environment = service.get("environment") or {}
    return environment if isinstance(environment, dict) else dict(item.split("=", 1) for item in environment)


def test_f8_tier_examples_let_only_front_doors_reach_replica_gates():
    """compose-tiers and the Kubernetes example: each replica gate takes client keys (its
    front doors'), each front door presents one, and gates and replicas share a replica key."""
    compose = yaml.safe_load((ROOT / "docker/compose-tiers.yaml").read_text())
    services = compose["services"]
    roles = {name: _compose_environment(s).get("KVGATE_ROLE") for name, s in services.items()}
    gates = [name for name, role in roles.items() if role == "replica_gate"]
    doors = [name for name, role in roles.items() if role == "front_door"]
    assert gates and doors
    for name in gates:
        env = _compose_environment(services[name])
        assert any(key.startswith("KVGATE_AUTH__API_KEYS") for key in env), name
        assert any(key.startswith("KVGATE_UPSTREAM__REPLICA_API_KEY") for key in env), name
    for name in doors:
        env = _compose_environment(services[name])
        assert any(key.startswith("KVGATE_UPSTREAM__API_KEY") for key in env), name
    replicas = [name for name, s in services.items() if "replica" in " ".join(map(str, s.get("command") or []))]
    for name in replicas:
        assert any(key.startswith("KVGATE_REPLICA_API_KEY") for key in _compose_environment(services[name])), name
    text = (ROOT / "docker/kubernetes-sidecar.yaml").read_text()
    documents = [doc for doc in yaml.safe_load_all(text) if doc]
    maps = {doc["metadata"]["name"]: doc for doc in documents if doc.get("kind") == "ConfigMap"}
    gate_config = yaml.safe_load(maps["kvgate-replica-gate"]["data"]["kvgate.yaml"])
    door_config = yaml.safe_load(maps["kvgate-front-door"]["data"]["kvgate.yaml"])
    assert gate_config["auth"].get("api_keys_file") and gate_config["upstream"].get("replica_api_key_file")
    assert door_config["upstream"].get("api_key_file")
    assert "KVGATE_REPLICA_API_KEY_FILE" in text
