"""Which process listens on a TCP port of this machine, read from Linux's /proc.

A benchmark picks a free port (`processes.free_port`) and hands it to the server it
starts; until that server binds it, another process (a server another test started at
the same moment) may take the same port, and then answers the readiness check in its
place. `listens_on` tells the two apart.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvgate.bench.cpu_split import descendants, read_parents

PROC = Path("/proc")
LISTEN = "0A"  # the TCP state code of a listening socket in /proc/net/tcp


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on `port` (IPv4 and IPv6)."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    try:
        fds = os.listdir(PROC / str(pid) / "fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(PROC / str(pid) / "fd" / fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process `pid` (or a process it started) holds a socket listening on `port`;
    None where this machine cannot tell (no /proc, or no listener on the port at all)."""
    listening = _listening_inodes(port)
    if not listening:
        return None
    family = [pid, *descendants(read_parents(PROC), pid)]
    return any(listening & _socket_inodes(member) for member in family)
