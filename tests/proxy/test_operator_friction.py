"""What an operator meets first: a vLLM without the plugin named at start with the fix, a
mistyped environment variable refused by name, the admin API saying how to turn it on,
every config problem at once (duplicate replica URLs too), numbers as users write them,
and a busy port reported before anything starts."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import re
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from fake_upstream import FakeUpstream
from proxy_client import ADMIN_TOKEN, ProxyClient, proxy_settings
from serve_process import REPO, start_serve, stop_serve

from kvgate.gate.settings import GateSettings
from kvgate.proxy.access_log import access_line
from kvgate.proxy.app import create_app
from kvgate.proxy.commands import check_config_command
from kvgate.proxy.config import OTHER_VARIABLES, ConfigError, load_settings, settings_from_dict
from kvgate.proxy.settings import AdminSettings
from kvgate.simulator.replica_server import start_simulated_replicas

FIX_WORDS = ("docker/install-vllm-plugin.sh", "VLLM_PLUGINS=kvgate")


def problems_of(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        settings_from_dict(data)
    return caught.value.problems


# ---- a replica without the probe API ----------------------------------------------


async def _wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def test_a_replica_without_the_probe_api_is_named_at_start_in_ready_and_the_metric(caplog):
    """Before any turn: the log names the replica and the fix, /ready lists it (still 200:
    the gate routes and reads /metrics), kvgate_replica_probe_api is 0 for it and 1 for a
    replica with the API."""
    plain = await FakeUpstream("plain").start()  # a vLLM without the plugin: no /v1/kvgate/*
    (sim,) = await start_simulated_replicas(1)
    settings = dataclasses.replace(
        proxy_settings([plain, sim]),
        gate=GateSettings(mode="enforce"),
        balancer=dataclasses.replace(
            proxy_settings([]).balancer,
            health=dataclasses.replace(proxy_settings([]).balancer.health, interval_sec=0.1),
        ),
    )
    app = create_app(settings)
    caplog.set_level(logging.WARNING, logger="kvgate")
    host, port = await app.start("127.0.0.1", 0)
    client = ProxyClient(app, host, port)
    try:

        async def ready_body():
            async with client.get("/ready") as resp:
                body = await resp.json()
                return body if resp.status == 200 and "probe_api_missing" in body else None

        body = await _wait_for(ready_body)
        assert list(body["probe_api_missing"]) == ["plain"]
        assert all(word in body["probe_api_missing"]["plain"] for word in FIX_WORDS)
        logged = [r.getMessage() for r in caplog.records if "plain" in r.getMessage()]
        assert any(all(word in m for word in FIX_WORDS) and plain.url in m for m in logged), logged
        metrics = app.metrics.registry
        await _wait_for(
            lambda: asyncio.sleep(0, metrics.get_sample_value("kvgate_replica_probe_api", {"replica": sim.name}))
        )
        assert metrics.get_sample_value("kvgate_replica_probe_api", {"replica": "plain"}) == 0
        assert metrics.get_sample_value("kvgate_replica_probe_api", {"replica": sim.name}) == 1
        assert not plain.requests  # no turn was needed to find out
    finally:
        await client.close()
        await plain.stop()
        await sim.stop()


async def test_check_config_contact_replicas_names_a_replica_without_the_probe_api(tmp_path, capsys):
    plain = await FakeUpstream("plain").start()
    (sim,) = await start_simulated_replicas(1)
    config = tmp_path / "kvgate.yaml"
    config.write_text(f"replicas:\n  - {{name: plain, url: '{plain.url}'}}\n  - {{name: sim, url: '{sim.url}'}}\n")
    try:
        args = type("Args", (), {"file": str(config), "contact_replicas": True})()
        code = await asyncio.to_thread(check_config_command, args)
    finally:
        await plain.stop()
        await sim.stop()
    err = capsys.readouterr().err
    assert code == 2
    (line,) = [line for line in err.splitlines() if "probe API" in line]
    assert "replicas[0] (plain)" in line and all(word in line for word in FIX_WORDS)


# ---- environment variables --------------------------------------------------------


@pytest.mark.parametrize(
    "variable, meant",
    [("KVGATE_GATE_POLICY", "KVGATE_GATE__POLICY"), ("KVGATE_LISTEN_PORT", "KVGATE_LISTEN__PORT")],
)
def test_a_mistyped_environment_variable_is_refused_by_name(variable, meant):
    with pytest.raises(ConfigError) as caught:
        load_settings(None, {variable: "9001"})
    (problem,) = caught.value.problems
    assert problem.startswith(f"{variable}: not a kvgate setting") and f"did you mean {meant}?" in problem


def test_unknown_kvgate_variables_are_refused_and_the_project_s_own_are_not():
    with pytest.raises(ConfigError, match="KVGATE_NOT_A_THING: not a kvgate setting"):
        load_settings(None, {"KVGATE_NOT_A_THING": "1", "OTHER_TOOL_SETTING": "x"})
    assert load_settings(None, {name: "1" for name in OTHER_VARIABLES}).listen.port == 8000


# ---- the admin API when it is off -------------------------------------------------


async def test_admin_routes_without_a_token_say_how_to_enable_the_admin_api(upstreams, make_proxy):
    proxy = await make_proxy(upstreams, admin=AdminSettings(token=None))
    async with proxy.get("/admin/state") as resp:
        assert resp.status == 404
        error = (await resp.json())["error"]
    assert error["code"] == "admin_api_disabled"
    assert "admin.token" in error["message"] and "KVGATE_ADMIN__TOKEN" in error["message"]


# ---- every config problem at once ---------------------------------------------------


def test_duplicate_replica_names_and_urls_are_reported_with_every_other_problem():
    problems = problems_of(
        {
            "replicas": [
                {"name": "a", "url": "http://vllm:8000"},
                {"name": "a", "url": "http://other:8000"},
                {"name": "b", "url": "HTTP://VLLM:8000/"},  # the first server again
            ],
            "gate": {"mode": "sometimes"},
            "listen": {"port": "eighty"},
        }
    )
    assert any(p.startswith("gate.mode:") for p in problems)
    assert any(p.startswith("listen.port:") for p in problems)
    assert any(p.startswith("replicas: name 'a' is used more than once") for p in problems)
    (url_problem,) = [p for p in problems if "one server is listed more than once" in p]
    assert "replicas[0]" in url_problem and "replicas[2]" in url_problem


async def test_admin_api_refuses_a_second_replica_at_the_same_url(upstreams, make_proxy):
    proxy = await make_proxy(upstreams)
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with proxy.post("/admin/replicas", json={"name": "again", "url": upstreams[0].url + "/"}, headers=auth) as r:
        assert r.status == 409
        assert "already exists as replica 'r0'" in (await r.json())["error"]["message"]
    assert [r.name for r in proxy.app.registry.all()] == ["r0", "r1"]


# ---- numbers as users write them ---------------------------------------------------


def test_yaml_numbers_as_users_write_them(tmp_path):
    path = tmp_path / "kvgate.yaml"
    path.write_text("gate: {idle_grace_sec: 1.0e9, max_wait_sec: 2e2}\nlimits: {max_body_bytes: 1e9}\n")
    settings = load_settings(path, {"KVGATE_GATE__QUIET_FLOOR_SEC": "5e-1"})
    assert settings.gate.idle_grace_sec == 1.0e9 and settings.gate.max_wait_sec == 200.0
    assert settings.limits.max_body_bytes == 10**9 and isinstance(settings.limits.max_body_bytes, int)
    assert settings.gate.quiet_floor_sec == 0.5
    assert any(
        p.startswith("limits.max_body_bytes: must be integer") for p in problems_of({"limits": {"max_body_bytes": 1.5}})
    )


# ---- a busy port -------------------------------------------------------------------


def test_serve_on_a_busy_port_says_so_before_starting_anything():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "kvgate.cli", "serve", "--port", str(port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert "simulated" not in done.stderr  # nothing was started first
    (line,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith(f"kvgate: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert "--port" in line and "kvgate: kvgate:" not in line


# ---- the access log ------------------------------------------------------------------

LOGFMT = re.compile(r"^(\w+=\S+)( \w+=\S+)*$")


def parse_logfmt(line: str) -> dict[str, str]:
    assert LOGFMT.match(line), line
    return dict(pair.split("=", 1) for pair in line.split(" "))


def test_access_line_is_logfmt_with_the_session_hashed():
    line = access_line(1764624001.25, "chat", "agent 42", "r0", "window_fits", 12.34, 200, 0.8341)
    fields = parse_logfmt(line)
    assert list(fields) == ["time", "route", "session", "replica", "admission", "wait_ms", "status", "duration_ms"]
    assert fields["time"] == "2025-12-01T21:20:01.250Z"
    assert fields["session"] == hashlib.sha256(b"agent 42").hexdigest()[:16] and "agent" not in line
    assert (fields["wait_ms"], fields["status"], fields["duration_ms"]) == ("12.3", "200", "834.1")
    anonymous = parse_logfmt(access_line(0.0, "models", None, None, None, 0.0, 503, 0.001))
    assert (anonymous["session"], anonymous["replica"], anonymous["admission"]) == ("-", "-", "-")


async def test_serve_with_log_access_writes_one_line_per_request():
    proc, lines, url = await start_serve_env({"KVGATE_LOG__ACCESS": "true"})
    try:
        async with aiohttp.ClientSession() as http:
            for turn in range(2):
                body = {
                    "model": "kvgate-sim",
                    "messages": [{"role": "user", "content": f"turn {turn}"}],
                    "max_tokens": 2,
                }
                async with http.post(
                    url + "/v1/chat/completions", json=body, headers={"x-session-id": "secret-id"}
                ) as r:
                    assert r.status == 200
                    replica, admission = r.headers["x-kvgate-replica"], r.headers["x-kvgate-admission"]
            async with http.post(url + "/v1/chat/completions", data=b"{not json", headers={"x-session-id": "x"}) as r:
                assert r.status == 400
        access: list[dict[str, str]] = []
        while len(access) < 3:
            line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode().strip()
            lines.append(line)
            if line.startswith("time="):
                access.append(parse_logfmt(line))
    finally:
        await stop_serve(proc)
    assert not any("secret-id" in line for line in lines)
    first, second, refused = access
    assert first["session"] == second["session"] == hashlib.sha256(b"secret-id").hexdigest()[:16]
    assert (second["route"], second["replica"], second["admission"], second["status"]) == (
        "chat",
        replica,
        admission,
        "200",
    )
    assert float(second["duration_ms"]) > 0 and float(second["wait_ms"]) >= 0
    assert (refused["status"], refused["admission"], refused["replica"]) == ("400", "invalid_json", "-")


async def test_serve_without_log_access_writes_no_access_line():
    proc, lines, url = await start_serve_env({})
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/v1/models", headers={"x-session-id": "s"}) as r:
                assert r.status == 200
    finally:
        await stop_serve(proc)
    rest = (await proc.stdout.read()).decode()
    assert not any(line.startswith("time=") for line in lines + rest.splitlines())


async def start_serve_env(env: dict[str, str]):
    """`kvgate serve --port 0` (simulated replicas) with `env` added to the environment."""
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, env):
        return await start_serve()
