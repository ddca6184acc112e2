"""Admission policies: may the waiting request at the head of the queue join the running set?

Pure functions of an `AdmissionView` (docs/simulator.md). The scheduler has already
checked the sequence slot; the policies only price KV blocks:

| policy              | admits when |
|---------------------|-------------|
| `naive`             | one new block is free (vLLM's own behaviour: allocate the first chunk and hope) |
| `reserve`           | the request's uncached blocks fit in the free blocks not owed to running requests |
| `reserve_watermark` | the same, keeping a headroom of `headroom_fraction` of the cache (12.5%) for decode growth |

"Owed" (obligations) = blocks running requests still need to finish computing the
tokens they already have (the rest of a chunked prefill), so two admissions never
count the same free blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_HEADROOM_FRACTION = 0.125


@dataclass(frozen=True)
class AdmissionView:
    num_total_blocks: int
    num_free_blocks: int  # free for new allocations (candidate's own evictable hits excluded)
    uncached_blocks: int  # blocks the candidate needs for all its known tokens, after prefix hits
    obligation_blocks: int  # blocks running requests still need for their known tokens


AdmissionPolicy = Callable[[AdmissionView], bool]


def naive(view: AdmissionView) -> bool:
    return view.num_free_blocks >= 1


def reserve(view: AdmissionView) -> bool:
    return view.uncached_blocks <= view.num_free_blocks - view.obligation_blocks


def headroom_blocks(num_total_blocks: int, headroom_fraction: float = DEFAULT_HEADROOM_FRACTION) -> int:
    return math.ceil(num_total_blocks * headroom_fraction)


def reserve_watermark(view: AdmissionView, headroom_fraction: float = DEFAULT_HEADROOM_FRACTION) -> bool:
    headroom = headroom_blocks(view.num_total_blocks, headroom_fraction)
    return view.uncached_blocks <= view.num_free_blocks - view.obligation_blocks - headroom


POLICY_NAMES = ("naive", "reserve", "reserve_watermark")


def make_policy(name: str, headroom_fraction: float = DEFAULT_HEADROOM_FRACTION) -> AdmissionPolicy:
    if name == "naive":
        return naive
    if name == "reserve":
        return reserve
    if name == "reserve_watermark":
        return lambda view: reserve_watermark(view, headroom_fraction)
    raise ValueError(f"unknown admission policy {name!r}: use one of {', '.join(POLICY_NAMES)}")
