"""`kvgate check-config --contact-replicas`: ask each configured replica what it is (I/O only;
the verdicts are `proxy.topology.replica_findings`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from kvgate.proxy.settings import Settings
from kvgate.proxy.topology import replica_findings
from kvgate.wire.owner_record import OWNER_PATH
from kvgate.wire.probe_api import KV_PATH
from kvgate.wire.replica_auth import replica_headers

TIMEOUT_SEC = 3.0


def _get(url: str, headers: dict[str, str]) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_SEC) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except (urllib.error.URLError, OSError, ValueError):
        return None, b""


def contact_replicas(settings: Settings) -> tuple[list[str], list[str]]:
    problems: list[str] = []
    notes: list[str] = []
    key = replica_headers(settings.upstream.api_key, settings.upstream.replica_api_key)
    for index, replica in enumerate(settings.replicas):
        base = replica.url.rstrip("/")
        metrics_status, metrics = _get(base + "/metrics", key)
        owner_status, owner_raw = _get(base + OWNER_PATH, key)
        kv_status, _ = _get(base + KV_PATH, key)
        try:
            owner = json.loads(owner_raw) if owner_status == 200 else None
        except ValueError:
            owner = None
        found = replica_findings(
            settings,
            index,
            replica.name,
            reachable=metrics_status is not None,
            is_kvgate=b"kvgate_requests_total" in metrics,
            owner_status=owner_status,
            owner=owner if isinstance(owner, dict) else None,
            kv_status=kv_status,
            url=replica.url,
            metrics_status=metrics_status,
        )
        problems += found[0]
        notes += found[1]
    return problems, notes
