"""Block arithmetic shared by the gate and the engines it reads (no I/O, no imports).

`cdiv` is vLLM's `vllm.utils.cdiv`: the blocks that `a` tokens fill, `b` tokens a block,
a partial block counting whole. The gate prices windows with it and the simulated engine
allocates block tables with it, so the two count a prompt's blocks the same way.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the least n with n * b >= a (b > 0). cdiv(0, b) == 0."""
    return -(-a // b)
