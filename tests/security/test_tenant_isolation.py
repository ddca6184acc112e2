"""Tenant isolation in the prefix cache: vLLM's `cache_salt` passes through kvgate to the
turns it forwards and the prefix probes it sends, so tenants with different salts share
no cached block and each tenant's turn is priced against its own (docs/security.md)."""

from __future__ import annotations

from security_parts import chat, replica_config

# ---- tenants: vLLM's cache_salt passes through kvgate, turns and probes alike --------------------


async def test_tenants_cache_salt_passes_through_to_turns_and_probes(parts, http, monkeypatch):
    from kvgate.simulator import replica_server

    (replica,) = await parts.replicas(num_blocks=64, block_size=16)
    forwarded: list[object] = []
    parse_turn = replica_server._parse

    def recorded(kind, body, *args):
        forwarded.append(body.get("cache_salt"))
        return parse_turn(kind, body, *args)

    monkeypatch.setattr(replica_server, "_parse", recorded)
    probed: list[str | None] = []
    prefix_answer = replica.engine.prefix_answer

    def counted(token_ids, cache_salt=None):
        probed.append(cache_salt)
        return prefix_answer(token_ids, cache_salt)

    replica.engine.prefix_answer = counted  # type: ignore[method-assign]
    gate = await parts.kvgate(replica_config(replica))
    prompt = "shared system prompt " * 60  # its byte bound exceeds the cache: the gate probes it
    for tenant in ("tenant-a", "tenant-b"):
        body = chat(prompt, cache_salt=f"salt-{tenant}")
        async with http.post(gate.url + "/v1/chat/completions", json=body, headers={"x-session-id": tenant}) as resp:
            assert resp.status == 200, await resp.text()
    assert forwarded == ["salt-tenant-a", "salt-tenant-b"]
    assert "salt-tenant-b" in probed and None not in probed
    # the two tenants share no cached block: tenant b's prompt, salted, finds none of tenant a's
    shared = {"chat": chat(prompt, cache_salt="salt-tenant-a")}
    async with http.post(replica.url + "/v1/kvgate/prefix", json=shared) as resp:
        assert (await resp.json())["hit_blocks"] > 0
    async with http.post(replica.url + "/v1/kvgate/prefix", json={"chat": chat(prompt, cache_salt="other")}) as resp:
        assert (await resp.json())["hit_blocks"] == 0
