"""The pure checks of the HTTP layer: values kvgate writes into HTTP heads, the session-id
splice, Connection-named headers, the descriptor budget, the new config keys."""

from __future__ import annotations

import resource

import orjson
import pytest

import kvgate.proxy.front_server as front_server
from kvgate.proxy.config import ConfigError, settings_from_dict
from kvgate.proxy.errors import RequestRejected
from kvgate.proxy.http_fields import decode_path_segment
from kvgate.proxy.request_body import parse_json_object, with_member, with_priority
from kvgate.proxy.session_id import bounded_session_id
from kvgate.proxy.upstream import relayed_response_headers, upstream_request_headers


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("agent-1", "agent-1"),
        ("a%20b", "a b"),
        ("%C3%A9t%C3%A9", "été"),
        ("%ff", None),
        ("%C3", None),
    ],
)
def test_path_segments_decode_to_utf8_or_400(raw, expected):
    if expected is None:
        with pytest.raises(RequestRejected) as info:
            decode_path_segment(raw)
        assert info.value.status == 400 and info.value.code == "invalid_session_id"
    else:
        assert decode_path_segment(raw) == expected


def test_session_ids_that_are_not_utf8_text_are_400():
    header_value = b"a\xffb".decode("utf-8", "surrogateescape")  # as the server decodes header values
    with pytest.raises(RequestRejected):
        bounded_session_id(header_value)
    assert bounded_session_id("été") == "été"
    assert len(bounded_session_id("x" * 600)) == 64 and len(bounded_session_id("é" * 300)) == 64


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m"}',
        b'  {"model":"m"}',
        b"{ }",
        b"{}",
        b'\n{"a":18446744073709551616,"a":1.0e5}',
        '{"é":"ü","x":[1,2]}'.encode(),
    ],
)
def test_session_id_splice_keeps_the_client_bytes(raw):
    body = parse_json_object(raw)
    out = with_member(raw, body, "session_id", 'agent "7" é')
    start = raw.index(b"{") + 1
    assert out[:start] == raw[:start] and out.endswith(raw[start:])
    inserted = out[start : len(out) - len(raw) + start]
    assert inserted == b'"session_id":"agent \\"7\\" \xc3\xa9"' + (b"," if body else b"")
    parsed = orjson.loads(out) if b"18446744073709551616" not in raw else None
    if parsed is not None:
        assert parsed == {"session_id": 'agent "7" é', **body}


@pytest.mark.parametrize(
    "raw, expected",
    [
        (b'{"model":"m","n":18446744073709551616}', b'{"priority":1,"model":"m","n":18446744073709551616}'),
        (b'{"model":"m","priority":0}', b'{"model":"m","priority":1}'),  # the later of the two
        (b'{"model":"m","priority":5}', b'{"model":"m","priority":5}'),  # the client's own, later: as sent
        (b'{"model":"m","priority":"high"}', b'{"model":"m","priority":"high"}'),  # vLLM judges it
        (b'{"model":"m","priority":null}', b'{"model":"m","priority":null}'),
    ],
)
def test_a_low_priority_forward_sets_the_priority_field(raw, expected):
    assert with_priority(raw, orjson.loads(raw) if b"1844" not in raw else {"model": "m"}, 1) == expected


def test_headers_named_in_connection_are_hop_by_hop():
    client = [
        (b"Host", b"k"),
        (b"Connection", b"keep-alive, X-Secret"),
        (b"X-Secret", b"1"),
        (b"connection", b"x-other"),
        (b"X-Other", b"2"),
        (b"X-Kept", b"3"),
        (b"Authorization", b"Bearer c"),
    ]
    assert upstream_request_headers(client, None) == [(b"X-Kept", b"3"), (b"Authorization", b"Bearer c")]
    assert upstream_request_headers(client, "k") == [(b"X-Kept", b"3"), (b"Authorization", b"Bearer k")]
    upstream = [(b"Connection", b"close, X-Hop"), (b"X-Hop", b"1"), (b"Content-Type", b"a/b")]
    assert relayed_response_headers(upstream) == [(b"Content-Type", b"a/b")]


@pytest.mark.parametrize(
    "soft, hard, configured, expected, raised_to",
    [
        (1_000_000, 1_000_000, 4096, 4096, None),  # plenty
        (1024, 1_000_000, 4096, 4096, 4096 * 2 + 64),  # soft limit raised to what is needed
        (1024, 1024, 4096, (1024 - 64) // 2, None),  # hard limit too low: fewer connections, descriptors kept
        (resource.RLIM_INFINITY, resource.RLIM_INFINITY, 4096, 4096, None),
    ],
)
def test_connection_limit_keeps_descriptors_for_upstreams_and_health_checks(
    monkeypatch, soft, hard, configured, expected, raised_to
):
    calls = []
    monkeypatch.setattr(front_server.resource, "getrlimit", lambda which: (soft, hard))

    def setrlimit(which, limits):
        if limits[0] > hard != resource.RLIM_INFINITY:
            raise ValueError("over the hard limit")
        calls.append(limits[0])

    monkeypatch.setattr(front_server.resource, "setrlimit", setrlimit)
    assert front_server.connection_limit(configured) == expected
    assert calls == ([raised_to] if raised_to else [])


@pytest.mark.parametrize(
    "data, problem",
    [
        ({"limits": {"max_head_bytes": 100}}, "limits.max_head_bytes: must be >= 1024"),
        ({"limits": {"header_timeout_sec": 0}}, "limits.header_timeout_sec: must be > 0"),
        ({"limits": {"keepalive_timeout_sec": -1}}, "limits.keepalive_timeout_sec: must be > 0"),
        ({"limits": {"max_connections": 0}}, "limits.max_connections: must be >= 1"),
        ({"limits": {"max_headers": 0}}, "limits.max_headers: must be >= 1"),
        ({"replicas": [{"name": "a\r\nb", "url": "http://h"}]}, "replicas[0].name: must be 1-128"),
        ({"replicas": [{"name": "a", "url": "http://h/a b"}]}, "replicas[0].url: must be an http"),
        ({"upstream": {"api_key": "k\r\nX: y"}}, "upstream.api_key: must be printable ASCII"),
    ],
)
def test_config_rejects_bad_limits_and_values_written_into_heads(data, problem):
    with pytest.raises(ConfigError) as info:
        settings_from_dict(data)
    assert any(p.startswith(problem) for p in info.value.problems), info.value.problems
