"""The shared block arithmetic (gate and simulator count blocks with the same cdiv)."""

from __future__ import annotations

import pytest

from kvgate.wire.blocks import cdiv


@pytest.mark.parametrize("a, b, expected", [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (352, 16, 22), (5, 1, 5)])
def test_cdiv_counts_a_partial_block_whole(a, b, expected):
    assert cdiv(a, b) == expected
