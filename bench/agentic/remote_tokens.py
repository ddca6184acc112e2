"""The ceiling's token model for a real vLLM server: its own tokenizer and chat template.

vLLM's `POST /tokenize` renders chat messages with the served model's template
(`{"messages": ..., "add_generation_prompt": true}`) and tokenises plain text
(`{"prompt": ..., "add_special_tokens": false}`). The ceiling needs a synchronous
`render(messages)`, so every prompt of the workload is tokenised up front (once per
turn, with the same placeholder replies the ceiling uses) and looked up afterwards.
A server without `/tokenize` leaves the words model in place.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from kvgate.bench.agentic.ceiling import TokenModel, placeholder_reply
from kvgate.bench.agentic.workload import Workload, build_messages


def _key(messages: list[dict]) -> bytes:
    return orjson.dumps(messages)


async def _tokenize(http: aiohttp.ClientSession, url: str, body: dict) -> list[int]:
    async with http.post(url + "/tokenize", json=body, timeout=aiohttp.ClientTimeout(total=30)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"POST {url}/tokenize answered {resp.status}: {(await resp.text())[:200]}")
        return (await resp.json())["tokens"]


async def server_token_model(
    http: aiohttp.ClientSession, url: str, model: str, workload: Workload, parallel: int = 8
) -> TokenModel:
    """A TokenModel answering from `url`'s tokenizer for exactly the prompts of `workload`."""
    conversations = []
    lengths = set()
    for thread in workload.threads:
        replies: list[str] = []
        for turn in thread.turns:
            conversations.append(build_messages(thread, replies, turn.index))
            lengths.add(workload.reply_tokens(turn))
            replies.append(placeholder_reply(workload.reply_tokens(turn)))
    limit = asyncio.Semaphore(parallel)

    async def render_remote(messages: list[dict]) -> list[int]:
        async with limit:
            return await _tokenize(http, url, {"model": model, "messages": messages, "add_generation_prompt": True})

    rendered = await asyncio.gather(*(render_remote(m) for m in conversations))
    prompts = {_key(m): tokens for m, tokens in zip(conversations, rendered)}
    placeholders = [placeholder_reply(n) for n in sorted(lengths)]
    encoded = await asyncio.gather(
        *(_tokenize(http, url, {"model": model, "prompt": p, "add_special_tokens": False}) for p in placeholders)
    )
    replies_tokens = dict(zip(placeholders, encoded))

    def render(messages: list[dict]) -> list[int]:
        return prompts[_key(messages)]

    def encode(text: str) -> list[int]:
        if text not in replies_tokens:
            raise KeyError("only the workload's placeholder replies were tokenised up front")
        return replies_tokens[text]

    return TokenModel(f"server {url}", render, encode)
