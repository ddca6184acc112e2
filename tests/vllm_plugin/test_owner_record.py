"""Conflict detection on a real vLLM CPU server: the plugin's owner record, and two kvgates
enforcing on the same server (the late one detects it, shadows, and says so in /ready and
its metrics)."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from vllm_harness import REPO_ROOT, free_port, http_json, scrape_metrics, start_service, stop_process_group

pytestmark = pytest.mark.vllm

OWNER = "/v1/kvgate/owner"


def test_owner_record_claim_renew_conflict_release(vllm_server):
    url = vllm_server.url + OWNER
    a, b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    status, body = http_json("POST", url, {"gate_id": a, "ttl_sec": 30})
    assert status == 200 and body["held"] is True and body["nonce"], body
    nonce = body["nonce"]
    assert 29 <= body["expires_in_sec"] <= 30
    status, body = http_json("POST", url, {"gate_id": b, "ttl_sec": 30})
    assert (status, body["held"], body["owned"], body["contenders"]) == (200, False, True, 1)
    assert "nonce" not in body and "owner" not in body
    status, body = http_json("POST", url, {"gate_id": a, "ttl_sec": 30, "nonce": nonce})  # renewal: a learns of b
    assert (body["held"], body["contenders"], body["nonce"]) == (True, 1, nonce)
    status, body = http_json("GET", url)
    assert (status, body["owned"], body["held"]) == (200, True, False) and a not in json.dumps(body)
    # the owner's id without its nonce releases nothing; with it, the record is free at once
    assert http_json("POST", url, {"gate_id": a, "ttl_sec": 0})[1]["owned"] is True
    assert http_json("POST", url, {"gate_id": a, "ttl_sec": 0, "nonce": nonce})[1]["owned"] is False
    status, body = http_json("POST", url, {"gate_id": b, "ttl_sec": 30})
    assert body["held"] is True
    http_json("POST", url, {"gate_id": b, "ttl_sec": 0, "nonce": body["nonce"]})
    status, body = http_json("POST", url, {"gate_id": "", "ttl_sec": 1})
    assert status == 400 and body["error"]["param"] == "gate_id"


def _gate_metric(base_url: str, name: str, replica: str) -> float | None:
    for sample, labels, value in scrape_metrics(base_url):
        if sample == name and labels.get("replica") == replica:
            return value
    return None


def _conflict_seen(base_url: str, within_sec: float = 60.0) -> float | None:
    """The late gate's `kvgate_gate_conflict` for v0, read until it is 1 or `within_sec`
    passed: the gate learns of the conflict from its first ownership claim's answer, which
    on a loaded machine comes after its /health does."""
    deadline = time.monotonic() + within_sec
    while (value := _gate_metric(base_url, "kvgate_gate_conflict", "v0")) != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_second_enforcing_kvgate_is_detected(vllm_server, tmp_path: Path):
    procs, urls = [], []
    try:
        for name in ("early", "late"):
            port = free_port()
            config = tmp_path / f"{name}.yaml"
            config.write_text(
                f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                f'replicas: [{{name: v0, url: "{vllm_server.url}"}}]\n'
                f"ownership: {{ttl_sec: 6, gate_id: {name}-{uuid.uuid4().hex[:6]}}}\n"
            )
            urls.append(f"http://127.0.0.1:{port}")
            # the early gate must be ready (it holds the record) before the late one starts
            procs.append(
                start_service(
                    [sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config)],
                    tmp_path / f"{name}.log",
                    urls[-1] + ("/ready" if name == "early" else "/health"),
                    90,
                    poll=0.3,
                    what=f"kvgate {name}",
                    cwd=REPO_ROOT,
                )
            )
        early, late = urls
        assert _conflict_seen(late) == 1
        status, body = http_json("GET", late + "/ready")
        assert status == 503 and body["error"]["code"] == "gate_conflict", body
        assert http_json("GET", early + "/ready")[0] == 200
        log = (tmp_path / "late.log").read_text()
        assert "gate conflict on replica v0" in log and "shadow" in log
        chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        request = urllib.request.Request(
            late + "/v1/chat/completions",
            data=json.dumps(chat).encode(),
            headers={"content-type": "application/json", "x-session-id": "s1", "x-session-finish": "true"},
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            assert resp.status == 200 and resp.headers["x-kvgate-admission"].startswith("shadow_")
    finally:
        for proc in reversed(procs):
            stop_process_group(proc, grace=15)
    # both stopped cleanly: the record is free again
    assert http_json("GET", vllm_server.url + OWNER)[1]["owned"] is False
