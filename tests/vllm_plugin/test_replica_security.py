"""The replica API on a real vLLM CPU server with both keys set, as docs/security.md deploys it:
vLLM's own client key (`VLLM_API_KEY`) and the gates' replica key
(`KVGATE_REPLICA_API_KEY_FILE`), on the session's keyed server (conftest.keyed_server).
The plugin must enforce what the simulated replica does in
tests/security/test_security_conformance.py: only a gate reads the cache or the owner
record, and no probe costs more than the turn it prices."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from keyed_server import CLIENT, GATE, REPLICA_KEY, VLLM_KEY
from vllm_harness import REPO_ROOT, VllmServer, free_port, http_json, start_service, stop_process_group

pytestmark = pytest.mark.vllm


def chat(text: str) -> dict:
    return {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": text}]}


def replica_requests(server: VllmServer) -> tuple[int, int]:
    """How many prefix probes and chat turns the server has answered (its access log)."""
    log = server.log_path.read_text(errors="replace")
    return log.count('"POST /v1/kvgate/prefix HTTP'), log.count('"POST /v1/chat/completions HTTP')


def test_probe_and_owner_routes_answer_only_the_replica_key(keyed_server):
    url = keyed_server.url
    routes = [
        ("GET", "/v1/kvgate/kv", None),
        ("POST", "/v1/kvgate/prefix", {"chat": chat("my salary is 120000")}),
        ("GET", "/v1/kvgate/owner", None),
        ("POST", "/v1/kvgate/owner", {"gate_id": "evil", "ttl_sec": 3600}),
        ("POST", "/v1/kvgate/release", {"sessions": ["someone-else"]}),
    ]
    for method, path, body in routes:
        for headers in (CLIENT, {**CLIENT, "X-Kvgate-Replica-Key": "guess"}):
            status, answer = http_json(method, url + path, body, headers=headers)
            assert status == 401 and answer["error"]["code"] == "invalid_replica_key", (path, answer)
    assert http_json("GET", url + "/v1/kvgate/kv", headers={"X-Kvgate-Replica-Key": REPLICA_KEY})[0] == 401
    for method, path, body in routes[:3]:
        status, answer = http_json(method, url + path, body, headers=GATE)
        assert status == 200, (path, answer)
    # The replica key opens the release route too: a session nobody pinned frees nothing.
    status, answer = http_json("POST", url + "/v1/kvgate/release", {"sessions": ["nobody-pinned"]}, headers=GATE)
    assert (status, answer) == (200, {"released_sessions": 0, "released_blocks": 0}), answer
    assert http_json("POST", url + "/v1/chat/completions", chat("hi"), headers=CLIENT)[0] == 200


def test_prompts_longer_than_max_model_len_are_refused_before_the_engine(keyed_server):
    url = keyed_server.url + "/v1/kvgate/prefix"
    too_many = keyed_server.max_model_len + 1
    started = time.perf_counter()
    status, answer = http_json("POST", url, {"token_ids": [1] * 2_000_000}, headers=GATE)
    assert status == 400 and answer["error"]["code"] == "prompt_too_long", answer
    status, answer = http_json("POST", url, {"token_ids": [1] * too_many}, headers=GATE)
    assert status == 400 and answer["error"]["code"] == "prompt_too_long", answer
    status, answer = http_json("POST", url, {"chat": chat("word " * (4 * too_many))}, headers=GATE)
    assert status == 400 and answer["error"]["code"] == "prompt_too_long", answer
    print(f"three over-long probes refused in {time.perf_counter() - started:.2f} s")
    status, answer = http_json("POST", url, {"token_ids": [1] * keyed_server.max_model_len}, headers=GATE)
    assert status == 200 and answer["total_tokens"] == keyed_server.max_model_len


def test_a_kvgate_with_both_keys_from_files_gates_the_server(keyed_server, tmp_path: Path):
    (tmp_path / "vllm.key").write_text(VLLM_KEY + "\n")
    (tmp_path / "replica.key").write_text(REPLICA_KEY + "\n")
    port = free_port()
    config = tmp_path / "kvgate.yaml"
    config.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f'replicas: [{{name: v0, url: "{keyed_server.url}"}}]\n'
        f"upstream: {{api_key_file: {tmp_path / 'vllm.key'}, replica_api_key_file: {tmp_path / 'replica.key'}}}\n"
        "ownership: {ttl_sec: 6}\n"
    )
    proc = start_service(
        [sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config)],
        tmp_path / "kvgate.log",
        f"http://127.0.0.1:{port}/ready",
        90,
        poll=0.3,
        what="kvgate",
        cwd=REPO_ROOT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        status, answer = http_json(
            "POST", base + "/v1/chat/completions", chat("hello there"), headers={"x-session-id": "s"}
        )
        assert status == 200, answer
        # a 4 MB body the kv answer's max_model_len and max_token_bytes prove too long: refused
        # by kvgate, and vLLM serves no request for it (no prefix probe, no turn)
        seen = replica_requests(keyed_server)
        for session in ("s", "s", "new"):
            status, answer = http_json(
                "POST", base + "/v1/chat/completions", chat("word " * 800_000), headers={"x-session-id": session}
            )
            assert status == 400 and answer["error"]["code"] == "prompt_too_long", answer
        assert replica_requests(keyed_server) == seen
        status, owner = http_json("GET", keyed_server.url + "/v1/kvgate/owner", headers=GATE)
        assert status == 200 and owner["owned"] is True and "owner" not in owner, owner
    finally:
        stop_process_group(proc, grace=15)
    log = (tmp_path / "kvgate.log").read_text()
    assert VLLM_KEY not in log and REPLICA_KEY not in log


# Disguises of the replica API's paths (tests/security/test_edge_conformance.py plays them
# through kvgate against the simulated replica), and canonical paths for contrast.
PATH_MATRIX = [
    "/v1/kvgate/kv",
    "/v1/%6bvgate/kv",
    "/v1/%6Bvgate/kv",
    "/v1/kvgat%65/kv",
    "/%761/kvgate/kv",
    "/v1//kvgate/kv",
    "/v1/./kvgate/kv",
    "/v1/x/../kvgate/kv",
    "/v1/%2e%2e/v1/kvgate/kv",
    "/v1/x%2F..%2Fkvgate/kv",
    "/v1%2Fkvgate%2Fkv",
    "/v1/kvgate/kv/",
]


def raw_get(url: str, path: str, headers: dict[str, str]) -> int:
    """GET `path` exactly as written (no client-side decoding or normalisation); the status."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request("GET", path, headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()


def test_every_path_vllm_routes_to_the_replica_api_is_one_kvgate_refuses_or_never_relays(keyed_server):
    """vLLM's router (Starlette on uvicorn) decodes some disguises; kvgate must refuse each of
    those (400 non_canonical_path) or recognise it as the replica API. Unrun by the helper
    that wrote it (vLLM tests are run by the lead)."""
    from kvgate.proxy.canonical_path import path_problem
    from kvgate.wire.routes import passthrough_route

    routed = {path: raw_get(keyed_server.url, path, GATE) for path in PATH_MATRIX}
    assert routed["/v1/kvgate/kv"] == 200, routed
    for path, status in routed.items():
        if status == 200:  # vLLM answered it as the replica API
            assert path_problem(path) is not None or passthrough_route("GET", path) is None, (path, routed)
