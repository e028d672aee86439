"""SplitMix64 over numpy arrays: the replay engine's source of deterministic "randomness".

Replay tokens and KV bytes must be equal on every rank and in every process, so they come
from a fixed integer mix of their coordinates, never from a seeded generator's state.
Unsigned numpy arithmetic wraps modulo 2**64 by definition, unlike torch's int64.
"""
from __future__ import annotations

import numpy as np

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective, well-mixed image of each uint64 in `x` (a new array)."""
    x = np.asarray(x, dtype=np.uint64) + _GAMMA
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))
