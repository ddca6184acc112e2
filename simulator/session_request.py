"""A request whose tokens are a prefix of its session's token sequence, held as a length.

An agent session's token sequence is fixed: turn k+1's prompt is turn k's prompt,
its reply and the next tool result, and the simulated replica's replies are a
function of position only. So every request of a session is a prefix of one
sequence, and a block's content is identified by (session, block index) alone, or,
for blocks that lie wholly inside a prefix every session shares (a common system
prompt), by (shared prefix, block index). `SessionRequest` keeps only lengths and
those identities: no token lists, so thousands of 30k-token contexts fit in memory,
and its block hashes are computed on demand.

Invariants: block `i` of a request hashes to `shared_base + i` when `i < shared_blocks`,
else `own_base + i`; the two ranges of different sessions and shared prefixes never
overlap (`block_key`). Two requests share a block hash exactly when the real token
sequences would share that block's whole prefix.
"""

from __future__ import annotations

from itertools import chain

from kvgate.simulator.request import RequestStatus, SimRequest

_BLOCKS_PER_SEQUENCE = 1 << 24  # block indexes per session: 2^24 blocks of 16 tokens = 268M tokens


def block_key(sequence_id: int, shared: bool) -> int:
    """The hash of block 0 of a session's own sequence, or of a shared prefix (negative)."""
    base = (sequence_id + 1) * _BLOCKS_PER_SEQUENCE
    return -base if shared else base


class SessionBlocks:
    """The full-block hashes of a SessionRequest (a read-only view, sized by its tokens).

    `blocks[i]` is one hash; `blocks[a:b]` (step 1) is an iterable of hashes, which
    is all the KV cache manager slices for.
    """

    __slots__ = ("_request", "_shared_base", "_own_base", "_shared_blocks", "_block_size")

    def __init__(self, request: SessionRequest, shared_base: int, own_base: int, shared_blocks: int) -> None:
        self._request = request
        self._shared_base = shared_base
        self._own_base = own_base
        self._shared_blocks = shared_blocks
        self._block_size = request.block_size

    def __len__(self) -> int:
        return self._request.num_tokens // self._block_size

    def __bool__(self) -> bool:
        return len(self) > 0

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("SessionBlocks supports contiguous slices only")
            shared = self._shared_blocks
            return chain(
                range(self._shared_base + start, self._shared_base + min(stop, shared)),
                range(self._own_base + max(start, shared), self._own_base + max(stop, shared)),
            )
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return (self._shared_base if index < self._shared_blocks else self._own_base) + index


class SessionRequest(SimRequest):
    """A SimRequest of `prompt_tokens` tokens of a session's sequence, generating up to `max_tokens`.

    sequence_id: the session's identity (unique per session of a run); shared_prefix:
    (prefix id, tokens) of the leading tokens every session of that prefix shares.
    Output tokens only advance the length (their content is fixed by position).
    """

    __slots__ = ("_num_tokens", "_num_prompt", "sequence_id")

    def __init__(
        self,
        request_id: str,
        sequence_id: int,
        prompt_tokens: int,
        max_tokens: int,
        block_size: int,
        shared_prefix: tuple[int, int] = (0, 0),
        arrival: float = 0.0,
    ) -> None:
        # SimRequest's token lists are never made: everything reads the lengths below.
        self.request_id = request_id
        self.sequence_id = sequence_id
        self._num_prompt = prompt_tokens
        self._num_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.cache_salt = None
        self.block_size = block_size
        self._extra_key = None
        prefix_id, prefix_tokens = shared_prefix
        self.block_hashes = SessionBlocks(  # type: ignore[assignment]  # a lazy view with the list's read API
            self, block_key(prefix_id, shared=True), block_key(sequence_id, shared=False), prefix_tokens // block_size
        )
        self.num_computed_tokens = 0
        self.max_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival = arrival
        self.priority = 0  # vLLM's request priority (SimRequest.priority); the front door sets the gate's
        self.num_preemptions = 0
        self.first_token_step = None
        self.finish_step = None
        self.admitted_step = None
        self.num_cached_prompt_tokens = 0
        self.prefix_stats_recorded = False
        self.pin = None

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt

    @property
    def num_output_tokens(self) -> int:
        return self._num_tokens - self._num_prompt

    def append_output_token(self, token_id: int) -> None:
        self._num_tokens += 1

    def advance_output(self, count: int) -> None:
        """Append `count` output tokens at once (the decode jump)."""
        self._num_tokens += count
