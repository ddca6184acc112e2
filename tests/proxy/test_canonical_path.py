"""Which request paths kvgate serves (proxy/canonical_path.py), and tenant tags (proxy/tenancy.py)."""

from __future__ import annotations

import pytest

from kvgate.proxy.canonical_path import path_problem
from kvgate.proxy.client_auth import ClientAuth
from kvgate.proxy.tenancy import scoped_session, tenant_tag


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions",
        "/v1/models/",
        "/health",
        "/",
        "/sess/a%2Fb/v1/chat/completions",  # the session id is kvgate's: any escape
        "/sess/%2e%2e/v1/models",
        "/v1/responses/a%20b",  # escapes of reserved or other characters mean the same everywhere
        "/v1/responses/%E2%9C%93",
        "/v1/files/a%3Fb",
    ],
)
def test_canonical_paths_pass(path):
    assert path_problem(path) is None


@pytest.mark.parametrize(
    "path, problem",
    [
        ("/v1/%6bvgate/kv", "escaped 'k'"),
        ("/v1/kvgat%45/kv", "escaped 'E'"),
        ("/%76%31/models", "escaped 'v'"),
        ("/v1/a%2Fb", "escaped '/'"),
        ("/v1/a%2fb", "escaped '/'"),
        ("/v1/%2e%2e/kvgate/kv", "escaped '.'"),
        ("/v1/a%7eb", "escaped '~'"),
        ("/v1//kvgate/kv", "empty segment"),
        ("//v1/models", "empty segment"),
        ("/v1/./models", "dot segment"),
        ("/v1/x/../models", "dot segment"),
        ("/v1/models/..", "dot segment"),
        ("/v1/%zz", "starts no escape"),
        ("/v1/%4", "starts no escape"),
        ("/v1/a%", "starts no escape"),
        ("/sess/x/v1/%6bvgate/kv", "escaped 'k'"),
        ("/sess/x/v1//models", "empty segment"),
        ("/%73ess/x/v1/kvgate/kv", "escaped 's'"),
    ],
)
def test_disguised_paths_are_named(path, problem):
    found = path_problem(path)
    assert found is not None and problem in found


def test_tenants_exist_only_with_several_keys():
    assert ClientAuth(["one"]).tenant(0) is None
    assert ClientAuth(["same", "same"]).tenant(1) is None
    auth = ClientAuth(["key-a", "key-b"])
    assert auth.match({"authorization": "Bearer key-b"}) == 1 and auth.match({"x-api-key": "key-a"}) == 0
    assert auth.match({"authorization": "Bearer key-c"}) == -1
    assert auth.tenant(1) == tenant_tag("key-b") != auth.tenant(0)
    assert "key-b" not in auth.tenant(1)


def test_scoped_sessions():
    assert scoped_session(None, "s") == "s" and scoped_session("t1", None) is None
    assert scoped_session("t1", "s") != scoped_session("t2", "s")
