"""What may name a replica and be its URL (`balancer.replica_fields`): the values that
go into every answer's x-kvgate-replica header and into the upstream request line."""

from __future__ import annotations

import pytest

from kvgate.balancer.replica_fields import replica_name_problem, replica_url_problem


@pytest.mark.parametrize(
    "name, ok",
    [
        ("r0", True),
        ("vllm-a.zone_1", True),
        ("a" * 128, True),
        ("", False),
        ("a" * 129, False),
        ("has space", False),
        ("crlf\r\nX-A: b", False),
        ("slash/x", False),
        ('quote"', False),
        ("ünï", False),
        ("tab\t", False),
    ],
)
def test_replica_names(name, ok):
    assert (replica_name_problem(name) is None) is ok


@pytest.mark.parametrize(
    "url, ok",
    [
        ("http://127.0.0.1:8000", True),
        ("https://vllm.internal/base/v1", True),
        ("http://[::1]:8000", True),
        ("ftp://h", False),
        ("http://", False),
        ("http://h:99999", False),
        ("http://h/a b", False),
        ("http://h/\r\nX: y", False),
        ("http://user:pw@h", False),
        ("http://h/?q=1", False),
        ("http://h/#f", False),
        ("http://hé/", False),
    ],
)
def test_replica_urls(url, ok):
    assert (replica_url_problem(url) is None) is ok
