"""Client authentication (`auth.api_keys`) and which replicas get kvgate's credentials.

Clients authenticate as they do to vLLM: `Authorization: Bearer <key>`, or Anthropic's
`x-api-key: <key>` (Claude Code sends that one). Every configured key is compared in
constant time on every check, so neither a key's content nor its position in the list
shows in the time an answer takes. With no key configured every request is let in.

Replicas added at run time through the admin API get kvgate's upstream credentials
(`upstream.api_key`, `upstream.replica_api_key`) only when their host is on
`upstream.credential_hosts`: an admin-token holder must not be able to point kvgate at a
server of theirs and collect the keys, then the clients' prompts (docs/security.md).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from kvgate.proxy.tenancy import tenant_tag

# Paths a client reaches without a key: the liveness check (load balancers, kubelets).
OPEN_PATHS = frozenset({"/health"})
CLIENT_KEY_HEADERS = (b"authorization", b"x-api-key")


class ClientAuth:
    """The configured client keys; `allows(headers)` or `match(headers)` for one request.
    With several distinct keys each is a tenant (`proxy.tenancy`): `tenant(index)` is its tag."""

    def __init__(self, keys: Iterable[str]) -> None:
        texts = tuple(keys)
        self._keys = tuple(key.encode() for key in texts)
        several = len(set(texts)) > 1
        self._tags = tuple(tenant_tag(key) if several else None for key in texts)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def match(self, headers: Mapping[str, str]) -> int:
        """The index of the key the request carries (Bearer or x-api-key), or -1. Every key
        is compared, whatever matched, each with `hmac.compare_digest`."""
        bearer = headers.get("authorization", "")
        given = [bearer[7:]] if bearer[:7].lower() == "bearer " else []
        if "x-api-key" in headers:
            given.append(headers["x-api-key"])
        found = -1
        for value in given:
            raw = value.strip().encode("utf-8", "surrogateescape")
            for index, key in enumerate(self._keys):
                if hmac.compare_digest(raw, key) and found < 0:
                    found = index
        return found

    def allows(self, headers: Mapping[str, str]) -> bool:
        return self.match(headers) >= 0

    def tenant(self, index: int) -> str | None:
        """The tenant tag of key `index` (None: a single tenant, nothing is scoped)."""
        return self._tags[index]


def gets_credentials(url: str, hosts: Iterable[str]) -> bool:
    """Whether a replica added at run time at `url` is given kvgate's upstream credentials:
    its host (case-insensitive) is on `upstream.credential_hosts`."""
    host = (urlsplit(url).hostname or "").lower()
    return any(host == allowed.lower() for allowed in hosts)
