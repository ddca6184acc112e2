"""The chaos agents (tests/chaos_agents.py) through kvgate against a real vLLM CPU server with
the plugin, the retention connector and the keys (the session's keyed server): turns given
up at random moments, streams hung up after their first chunk, retries while the first
attempt is out, on the chat, Anthropic messages and Responses APIs, with more sessions than
the server's cache holds. Every answer read whole is a reply or an expected error; afterwards
vLLM runs and queues nothing (the proxy's closed connections aborted what it had), the
windows' pins are released in the connector as the windows end, and the gate's books empty.
"""

from __future__ import annotations

import asyncio

import pytest
from keyed_server import REPLICA_KEY, VLLM_KEY

from tests.chaos_agents import EXPECTED_ERRORS, Sessions, Tally, agent, assert_nothing_left, kvgate_before

pytestmark = pytest.mark.vllm

AGENTS = 9
# About 150-500 of the tiny model's tokens a session (some 3 a word): together several
# times the server's 2,016-token cache.
SESSION_SHAPE = Sessions(model="tiny", system_words=15, result_words=(15, 30), turns=(3, 5))


async def test_misbehaving_agents_leave_nothing_behind_in_vllm(keyed_server):
    tally = Tally(EXPECTED_ERRORS)
    async with kvgate_before([("vllm", keyed_server.url)], REPLICA_KEY, VLLM_KEY) as (app, http):
        await asyncio.gather(*(agent(http, index, 0, tally, SESSION_SHAPE) for index in range(AGENTS)))
        await assert_nothing_left([app], [keyed_server.url], REPLICA_KEY, VLLM_KEY)
    assert tally.statuses.get(200, 0) >= AGENTS * 2, tally
    assert tally.gave_up + tally.hung_up > 0, tally  # some turns were given up on
