"""Tenants: with several client keys (`auth.api_keys`), each key is a tenant, and what a
tenant names lives in its own namespace (docs/security.md, Tenants).

A tenant is known by its tag, a hash of its key (never the key): `tenant_tag`. Its
session ids are scoped by the tag (`scoped_session`) before kvgate keeps, gates or
forwards them, so two tenants' `x-session-id: s1` are two sessions and a tenant cannot
finish, supersede or probe (admission reasons) another's. Its Responses links carry
the tag: a link is visible to its own tenant only (`visible`). With one key (or none)
there is one tenant and nothing is scoped: the tag is None.
"""

from __future__ import annotations

import hashlib

TAG_CHARS = 16  # hex digits of the key's SHA-256: 64 bits, no collision between a deployment's keys


def tenant_tag(key: str) -> str:
    return "t" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:TAG_CHARS]


def scoped_session(tenant: str | None, session_id: str | None) -> str | None:
    """`session_id` in `tenant`'s namespace (unchanged without a tenant or an id)."""
    if tenant is None or session_id is None:
        return session_id
    return f"{tenant}:{session_id}"


def visible(link_tenant: str | None, tenant: str | None) -> bool:
    """Whether a Responses link made by `link_tenant` may be used by `tenant`."""
    return link_tenant == tenant
