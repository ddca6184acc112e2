"""Helpers of the security tests: bodies, configs, waiting, and the leak check's cleanup."""

from __future__ import annotations

import asyncio

CLEAN = {"leases": 0, "windows": 0, "waiters": 0, "attempts": 0, "sessions": 0}


def chat(text: str = "hello", **extra) -> dict:
    return {"model": "kvgate-sim", "max_tokens": 4, **extra, "messages": [{"role": "user", "content": text}]}


async def until(condition, what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.02)


async def renewals(gate, replica: str, count: int, timeout: float = 30.0) -> None:
    """Wait until `gate` has renewed its claim on `replica`'s owner record `count` more times
    (each answered claim stores a new `Ownership`; a failed one keeps the old), instead of
    sleeping for what the renewal interval would take on an idle machine."""
    seen = [gate.app.ownership.ownership().get(replica)]

    def renewed() -> bool:
        current = gate.app.ownership.ownership().get(replica)
        if current is not seen[-1]:
            seen.append(current)
        return len(seen) > count

    await until(renewed, f"{count} renewals of the owner record of {replica}", timeout)


def finish_every_session(admission) -> None:
    """End every session a row left (their windows wait out idle_grace_sec otherwise), so the
    leak check sees only what finishing cannot release."""
    for gate_state in admission.state().values():
        for session in gate_state.get("sessions", {}):
            admission.finish_session(session)


def replica_config(replica, **extra) -> dict:
    return {"replicas": [{"name": replica.name, "url": replica.url}], **extra}


def address_of(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").partition(":")
    return host, int(port)


async def raw_exchange(url: str, raw: bytes, timeout: float = 5.0) -> tuple[bytes, bool]:
    """Send `raw` bytes on a new connection to `url`; (what came back, whether the server
    closed the connection within `timeout`)."""
    reader, writer = await asyncio.open_connection(*address_of(url))
    writer.write(raw)
    data, closed = b"", False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while (left := deadline - loop.time()) > 0 and not closed:
            try:
                piece = await asyncio.wait_for(reader.read(65536), left)
            except TimeoutError:
                break
            data += piece
            closed = not piece
    except ConnectionError:
        closed = True
    finally:
        writer.close()
    return data, closed
