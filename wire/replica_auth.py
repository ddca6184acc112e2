"""The replica API's credential: only gates may use the probe and owner routes.

The kvgate plugin and the simulated replica answer the probe API (`probe_api`) and the
owner record (`owner_record`) only to a request whose `X-Kvgate-Replica-Key` header
holds the replica key (compared in constant time), else 401. The key is the gates' own
secret, separate from the clients' vLLM key: a client that may generate must still not
read what the cache holds (the prefix probe answers exactly how much of a guessed prompt
is resident) nor take the owner record.

The server reads the key from the environment, never from its command line (which any
local user can read): `KVGATE_REPLICA_API_KEY`, or `KVGATE_REPLICA_API_KEY_FILE`
naming a file whose first non-blank line is the key (Docker and Kubernetes secrets).
A server with neither answers everyone, as vLLM's own routes do without `--api-key`,
and says so once at start (docs/security.md).

The gate's side is `replica_headers`: two secrets, two headers. `Authorization: Bearer
<api_key>` is the replica's client key (vLLM's `--api-key`, which guards every path under
/v1, the probe API's included); `REPLICA_KEY_HEADER: <replica_api_key>` is the gates' own.
A replica the gate must not trust (added at run time from a host the config does not
list) gets neither.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import Path

REPLICA_KEY_HEADER = "X-Kvgate-Replica-Key"
ENV_KEY = "KVGATE_REPLICA_API_KEY"
ENV_KEY_FILE = "KVGATE_REPLICA_API_KEY_FILE"
UNAUTHORIZED_MESSAGE = (
    f"the kvgate replica API answers gates only: send the replica key in {REPLICA_KEY_HEADER} "
    "(the gate's upstream.replica_api_key, the server's KVGATE_REPLICA_API_KEY)"
)
OPEN_WARNING = (
    f"kvgate: no replica key ({ENV_KEY} or {ENV_KEY_FILE}): the probe and owner routes answer anyone "
    "who can reach this server's API, who can then read what its prefix cache holds and claim its owner "
    "record; set the key here and as upstream.replica_api_key on the gates (docs/security.md)"
)


class ReplicaKeyError(ValueError):
    """The replica key's file is named but unusable; the message says which and why."""


def replica_key_from_env(environ: Mapping[str, str]) -> str | None:
    """The replica key the environment gives, or None; ReplicaKeyError when both variables are
    set or the file cannot be read or holds no key."""
    inline = environ.get("KVGATE_REPLICA_API_KEY") or None  # ENV_KEY, spelled out for tests/test_reference_doc.py
    path = environ.get("KVGATE_REPLICA_API_KEY_FILE") or None  # ENV_KEY_FILE
    if inline is not None and path is not None:
        raise ReplicaKeyError(f"set {ENV_KEY} or {ENV_KEY_FILE}, not both")
    if path is None:
        return inline.strip() if inline is not None else None
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplicaKeyError(f"{ENV_KEY_FILE}: cannot read {path} ({exc})") from None
    key = next((line for line in lines if line and not line.startswith("#")), None)
    if key is None:
        raise ReplicaKeyError(f"{ENV_KEY_FILE}: {path} holds no key")
    return key


def allowed(given: str | None, key: str | None) -> bool:
    """Whether a request showing `given` (its REPLICA_KEY_HEADER, None if absent) may use the
    replica API of a server whose key is `key` (None: open)."""
    if key is None:
        return True
    return hmac.compare_digest((given or "").encode("utf-8", "surrogateescape"), key.encode())


def replica_headers(api_key: str | None, replica_api_key: str | None, trusted: bool = True) -> dict[str, str]:
    """The headers of a probe or owner claim to a replica (`trusted`: it gets credentials)."""
    if not trusted:
        return {}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if replica_api_key:
        headers[REPLICA_KEY_HEADER] = replica_api_key
    return headers
