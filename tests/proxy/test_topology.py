"""Tiers, the pure parts: role validation at config load, and the header rules between tiers."""

from __future__ import annotations

import pytest

from kvgate.proxy.config import ConfigError, settings_from_dict
from kvgate.proxy.topology import merge_kvgate_headers, session_header_value, with_session_header

ONE = [{"name": "r0", "url": "http://vllm-0:8000"}]
TWO = ONE + [{"name": "r1", "url": "http://vllm-1:8000"}]


@pytest.mark.parametrize(
    "config, problem_keys",
    [
        ({}, []),
        ({"role": "standalone", "replicas": TWO}, []),
        ({"role": "front_door", "replicas": TWO, "gate": {"mode": "off"}}, []),
        ({"role": "front_door", "replicas": TWO, "gate": {"mode": False}}, []),  # a bare YAML `off`
        ({"role": "front_door", "replicas": TWO}, ["gate.mode"]),  # would gate twice
        ({"role": "front_door", "replicas": TWO, "gate": {"mode": "shadow"}}, ["gate.mode"]),
        ({"role": "front_door", "gate": {"mode": "off"}}, ["replicas"]),  # nothing to front
        ({"role": "replica_gate", "replicas": ONE}, []),
        ({"role": "replica_gate", "replicas": ONE, "gate": {"mode": "shadow"}}, []),
        ({"role": "replica_gate", "replicas": TWO}, ["replicas"]),  # one book per replica
        ({"role": "replica_gate", "replicas": []}, ["replicas"]),
        ({"role": "replica_gate", "replicas": ONE, "gate": {"mode": "off"}}, ["gate.mode"]),
        ({"role": "proxy"}, ["role"]),
        ({"ownership": {"ttl_sec": -1}}, ["ownership.ttl_sec"]),
        ({"ownership": {"ttl_sec": 0, "gate_id": ""}}, ["ownership.gate_id"]),
    ],
)
def test_role_combinations(config, problem_keys):
    if not problem_keys:
        settings_from_dict(config)
        return
    with pytest.raises(ConfigError) as err:
        settings_from_dict(config)
    assert [p.split(":", 1)[0] for p in err.value.problems] == problem_keys


def test_session_header_value_is_safe_and_stable():
    assert session_header_value("agent-42") == b"agent-42"
    odd = session_header_value("a\r\nx-evil: 1")
    assert odd.startswith(b"sha256:") and b"\r" not in odd and odd == session_header_value("a\r\nx-evil: 1")
    assert session_header_value("café").startswith(b"sha256:")


def test_with_session_header_replaces_the_clients():
    headers = [(b"X-Kvgate-Session-Id", b"from-client"), (b"x-session-id", b"agent"), (b"accept", b"*/*")]
    assert with_session_header(headers, "from-path") == [
        (b"x-session-id", b"agent"),
        (b"accept", b"*/*"),
        (b"x-kvgate-session-id", b"from-path"),
    ]
    # an anonymous request carries no tier header, whatever the client sent
    assert with_session_header(headers, None) == [(b"x-session-id", b"agent"), (b"accept", b"*/*")]


def test_merge_kvgate_headers():
    own = [(b"x-kvgate-replica", b"rg0"), (b"x-kvgate-admission", b"open"), (b"x-kvgate-wait-ms", b"0")]
    plain = [(b"content-type", b"application/json")]
    assert merge_kvgate_headers(list(plain), own) == (plain + own, False)
    inner = [(b"X-Kvgate-Replica", b"vllm0"), (b"X-Kvgate-Admission", b"window_fits"), (b"X-Kvgate-Wait-Ms", b"12.5")]
    merged, gated = merge_kvgate_headers(plain + inner, own)
    assert gated and merged == plain + inner
