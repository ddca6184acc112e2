"""A request inside the engine model, and vLLM's chained block hashes.

A full block's hash is hash((parent hash or NONE_HASH, the block's token ids, extra key));
the extra key is the `cache_salt` on the first block only, as in vLLM. Python's hash of a
tuple of ints is deterministic across processes (only str/bytes hashing is randomised),
and the salt is reduced to an int with a fixed digest, so hashes are stable.

Hashes are computed incrementally: once per full block, when the block's last token is
known (prompt blocks at creation, output blocks as tokens are appended), never per step.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence

NONE_HASH = 0x6B76676174650001  # parent of the first block ("kvgate" + 1)


def salt_key(cache_salt: str | None) -> int | None:
    if cache_salt is None:
        return None
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=8).digest(), "little")


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int], extra_key: int | None) -> int:
    if extra_key is None:
        return hash((parent_hash, tuple(token_ids)))
    return hash((parent_hash, tuple(token_ids), extra_key))


def compute_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, start: int = 0, parent: int | None = None
) -> list[int]:
    """Hashes of the full blocks of `token_ids` from block index `start` on.

    `parent` is the hash of block start-1 (required when start > 0).
    """
    hashes = []
    extra = salt_key(cache_salt)
    if start == 0:
        parent_hash = NONE_HASH
    else:
        assert parent is not None, "compute_block_hashes: `parent` is required when start > 0"
        parent_hash = parent
    for index in range(start, len(token_ids) // block_size):
        block = token_ids[index * block_size : (index + 1) * block_size]
        parent_hash = hash_block_tokens(parent_hash, block, extra if index == 0 else None)
        hashes.append(parent_hash)
    return hashes


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    REJECTED = "rejected"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED, RequestStatus.REJECTED)


class SimRequest:
    """One generation request. `all_token_ids` = prompt + outputs so far.

    `priority` and `arrival` order it under priority scheduling: (priority, arrival),
    lowest first, as vLLM's `Request.__lt__`. `pin` is the KV pin its turn carries,
    (session, ttl_sec), or None: when it finishes, the session pins its blocks
    (`kvgate.wire.kv_pins`).

    Invariants: `num_computed_tokens <= num_tokens`; `block_hashes` covers exactly the full
    blocks of `all_token_ids`; `max_computed_tokens` is the high-water mark of computed
    tokens, so tokens computed again below it are recomputation (after a preemption).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "all_token_ids",
        "output_token_ids",
        "max_tokens",
        "cache_salt",
        "block_size",
        "block_hashes",
        "_extra_key",
        "num_computed_tokens",
        "max_computed_tokens",
        "status",
        "arrival",
        "priority",
        "num_preemptions",
        "first_token_step",
        "finish_step",
        "admitted_step",
        "num_cached_prompt_tokens",
        "prefix_stats_recorded",
        "pin",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        block_size: int,
        cache_salt: str | None = None,
        arrival: float = 0.0,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.block_size = block_size
        self._extra_key = salt_key(cache_salt)
        self.block_hashes = compute_block_hashes(prompt_token_ids, block_size, cache_salt)
        self.num_computed_tokens = 0
        self.max_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival = arrival
        self.priority = priority  # vLLM's request priority: lower is served first (priority scheduling only)
        self.num_preemptions = 0
        self.first_token_step: int | None = None
        self.finish_step: int | None = None
        self.admitted_step: int | None = None
        self.num_cached_prompt_tokens = 0  # prefix-cache hit at first admission
        self.prefix_stats_recorded = False
        self.pin: tuple[str, float] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        size = self.block_size
        if len(self.all_token_ids) % size == 0:
            index = len(self.all_token_ids) // size - 1
            parent = self.block_hashes[-1] if self.block_hashes else NONE_HASH
            block = self.all_token_ids[index * size :]
            self.block_hashes.append(hash_block_tokens(parent, block, self._extra_key if index == 0 else None))

    def __repr__(self) -> str:
        return (
            f"SimRequest({self.request_id}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}/"
            f"{self.max_tokens}, computed={self.num_computed_tokens}, {self.status.value})"
        )
