"""The credentials a gate shows a replica (docs/security.md), as one pure function.

Two secrets, two headers. `Authorization: Bearer <api_key>` is the replica's client key
(vLLM's `--api-key`, which guards every path under /v1, the probe API's included).
`REPLICA_KEY_HEADER: <replica_api_key>` is the gates' own credential: the kvgate plugin
and the simulated replica answer the owner and probe routes only to a request that
carries it, so a client holding vLLM's key still cannot read the cache or take the owner
record. A replica the gate must not trust (added at run time from a host the config
does not list) gets neither.
"""

from __future__ import annotations

REPLICA_KEY_HEADER = "X-Kvgate-Replica-Key"


def replica_headers(api_key: str | None, replica_api_key: str | None, trusted: bool = True) -> dict[str, str]:
    """The headers of a probe or owner claim to a replica (`trusted`: it gets credentials)."""
    if not trusted:
        return {}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if replica_api_key:
        headers[REPLICA_KEY_HEADER] = replica_api_key
    return headers
