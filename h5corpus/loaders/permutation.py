"""A seeded permutation of ``[0, n)`` computed element by element, in O(1) memory.

The window loader's epoch order used to be a shuffled ``arange(windows)`` in every DataLoader
worker of every rank: 4 bytes per window, 2 GB per process at a trillion tokens of 2,048-token
windows. :func:`permute` gives the same kind of order (a bijection chosen by the seed) for just the
positions a process reads, as Levanter's and Grain's index shuffles do: a balanced Feistel network
on the smallest even number of bits covering ``n`` (a bijection on ``[0, 2^bits)`` for any round
function), walked until it lands in ``[0, n)`` ("cycle walking": a bijection restricted to its own
orbits stays one; the domain is at most 4n, so about 4 steps at most on average).

The round function is splitmix64's finalizer of the right half and a round key; :func:`keys`
derives the keys from the caller's seed words by BLAKE2b (numpy's random generators, ~1 MB in
every process that imports them, are not needed). Six rounds.
"""

from __future__ import annotations

import hashlib
import operator

import numpy as np

ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def keys(*seed: int) -> np.ndarray:
    """(ROUNDS,) uint64 round keys: BLAKE2b of the seed words (ints, as decimal text)."""
    words = ",".join(str(operator.index(w)) for w in seed).encode()
    digest = hashlib.blake2b(words, digest_size=8 * ROUNDS, person=b"h5c-feistel").digest()
    return np.frombuffer(digest, "<u8").astype(np.uint64)


def permute(items: np.ndarray, n: int, round_keys: np.ndarray) -> np.ndarray:
    """int64 images of ``items`` (each in ``[0, n)``) under the permutation of ``[0, n)`` that
    ``round_keys`` choose: distinct items give distinct images, and every image lies in ``[0, n)``."""
    x = np.asarray(items, dtype=np.int64)
    if x.size and (int(x.min()) < 0 or int(x.max()) >= n):
        raise IndexError(f"items outside [0, {n})")
    if n <= 1:
        return x.copy()
    half = max(1, -(-(n - 1).bit_length() // 2))
    out = _feistel(x.astype(np.uint64), half, round_keys)
    walk = np.flatnonzero(out >= n)
    while walk.size:  # cycle walking: step again until inside [0, n)
        out[walk] = _feistel(out[walk], half, round_keys)
        walk = walk[out[walk] >= n]
    return out.astype(np.int64)


def _feistel(x: np.ndarray, half: int, round_keys: np.ndarray) -> np.ndarray:
    """The balanced Feistel network on ``2 * half`` bits (a bijection of ``[0, 4**half)``)."""
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    with np.errstate(over="ignore"):
        for k in round_keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
    return (left << np.uint64(half)) | right


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (uint64, wrapping)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))
