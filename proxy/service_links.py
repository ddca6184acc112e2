"""Kubernetes' service-link variables, told apart from kvgate's own `KVGATE_*` settings.

The kubelet gives every container, unless its pod sets `enableServiceLinks: false`, the
Docker-links-style variables of every Service with a cluster IP in its namespace. For a
Service NAME (upper case, `-` as `_`), on a port named PORTNAME with number N:

    NAME_SERVICE_HOST=10.0.0.11             NAME_PORT=tcp://10.0.0.11:8000
    NAME_SERVICE_PORT=8000                  NAME_PORT_8000_TCP=tcp://10.0.0.11:8000
    NAME_SERVICE_PORT_PORTNAME=8000         NAME_PORT_8000_TCP_PROTO=tcp
                                            NAME_PORT_8000_TCP_PORT=8000
                                            NAME_PORT_8000_TCP_ADDR=10.0.0.11

A Service named `kvgate`, `kvgate-door` or `kvgate-admin` puts such variables in kvgate's
own `KVGATE_` namespace. They are recognised by name *and* value, so a misspelt setting
(`KVGATE_LISTEN_PORT=9000`, meant `KVGATE_LISTEN__PORT`) still has no value of the shape
the kubelet writes (`tcp://IP:PORT`) and stays an error naming the setting meant.
"""

from __future__ import annotations

import ipaddress
import re

_PROTOCOLS = "TCP|UDP|SCTP"
# A Service name (a DNS label: a letter first, a letter or digit last) and a port name
# (letters, digits and single hyphens), with `-` written `_`.
_NAME = "[A-Z][A-Z0-9_]*[A-Z0-9]"
_PORT_NAME = "[A-Z0-9]+(_[A-Z0-9]+)*"
# (name pattern, what the value looks like)
_SHAPES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(rf"{_NAME}_SERVICE_HOST"), "address"),
    (re.compile(rf"{_NAME}_SERVICE_PORT(_{_PORT_NAME})?"), "port"),
    (re.compile(rf"{_NAME}_PORT(_\d+_({_PROTOCOLS}))?"), "url"),
    (re.compile(rf"{_NAME}_PORT_\d+_({_PROTOCOLS})_PROTO"), "protocol"),
    (re.compile(rf"{_NAME}_PORT_\d+_({_PROTOCOLS})_PORT"), "port"),
    (re.compile(rf"{_NAME}_PORT_\d+_({_PROTOCOLS})_ADDR"), "address"),
)
_URL = re.compile(r"(tcp|udp|sctp)://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(\d+)")


def is_service_link(name: str, value: str) -> bool:
    """Whether `name=value` is one of the variables the kubelet writes for a Service."""
    return any(pattern.fullmatch(name) and _value_fits(kind, value) for pattern, kind in _SHAPES)


def _value_fits(kind: str, value: str) -> bool:
    if kind == "address":
        return _is_address(value)
    if kind == "port":
        return _is_port(value)
    if kind == "protocol":
        return value in ("tcp", "udp", "sctp")
    found = _URL.fullmatch(value)
    return found is not None and _is_address(found.group(2).strip("[]")) and _is_port(found.group(3))


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _is_port(text: str) -> bool:
    return text.isdigit() and 0 < int(text) < 65536
