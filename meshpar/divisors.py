"""Divisors: the tilings and factorisations meshpar chooses from (attention tiles, loss chunks, mesh shapes)."""

from __future__ import annotations

import functools

from meshpar.errors import InputError


@functools.lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """Every divisor of `n`, ascending."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of `n` that is at most `at_most`: a tile that cuts `n` into equal pieces."""
    if n < 1 or at_most < 1:
        raise InputError(f"length {n} and tile size {at_most} must be >= 1")
    return max(d for d in divisors(n) if d <= at_most)
