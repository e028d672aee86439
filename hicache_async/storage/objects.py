"""The stored object: a fixed 64-byte header, then the raw KV payload bytes.

The header lets a reader prove the bytes are what it asked for before they reach the cache:
wrong namespace, wrong key (a misplaced object), wrong layer/head range, truncation or a
flipped byte all become a miss, never wrong KV. No pickle: plain struct fields.

The payload checksum is two 64-bit sums over little-endian words: a plain sum (any single
corrupted word changes it) and a sum of 512-byte block sums weighted by block position
(moved or swapped blocks change it). It runs at memory speed across cores, where CRC32
(~3 GB/s, one core) would cost more than the transfer it guards.
"""
from __future__ import annotations

import functools
import hashlib
import struct

import torch

from ..errors import HiCacheError
from ..keys import ObjectSpec

MAGIC = b"HKV\x00"
VERSION = 1
_HEADER = struct.Struct("<4sHH8s8sIIIIQQQ")
_BLOCK_WORDS = 64
_SERIAL_WORDS = 16384  # below torch's parallel grain: summing stays on this thread
_MASK = (1 << 64) - 1
HEADER_BYTES = _HEADER.size  # 64


class CorruptObject(HiCacheError):
    """A stored object failed verification; the reader treats it as a miss."""


def _digest8(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()[:8]


@functools.lru_cache(maxsize=16)
def _weights(n: int) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=torch.int64)


def checksum(payload) -> tuple[int, int]:
    """(sum, position-weighted block sum) of the payload's 64-bit words, each mod 2**64."""
    view = memoryview(payload).cast("B")
    if view.readonly:
        view = memoryview(bytearray(view))
    whole = view.nbytes // (8 * _BLOCK_WORDS) * _BLOCK_WORDS
    total = weighted = 0
    if whole:
        # Serial chunks: intra-op threads wake too slowly for one page, worse on a busy machine.
        words = torch.frombuffer(view, dtype=torch.int64, count=whole).view(-1, _BLOCK_WORDS)
        blocks = torch.empty(len(words), dtype=torch.int64)
        step = _SERIAL_WORDS // _BLOCK_WORDS
        for start in range(0, len(words), step):
            torch.sum(words[start:start + step], 1, out=blocks[start:start + step])
        total = int(blocks.sum())
        weighted = int(torch.dot(blocks, _weights(len(blocks))))
    rest = bytes(view[whole * 8:])
    rest += bytes(-len(rest) % 8)
    tail = sum(struct.unpack(f"<{len(rest) // 8}q", rest))
    return (total + tail) & _MASK, (weighted + tail * (whole // _BLOCK_WORDS + 1)) & _MASK


def encode_header(key: str, spec: ObjectSpec, namespace: str, payload) -> bytes:
    """Header for `payload` (any contiguous buffer) stored under `key`."""
    view = memoryview(payload).cast("B")
    return _HEADER.pack(MAGIC, VERSION, 0, _digest8(namespace), _digest8(key),
                        spec.layers.start, spec.layers.stop - 1, spec.heads.start, spec.heads.stop - 1,
                        view.nbytes, *checksum(view))


def verify(key: str, spec: ObjectSpec, namespace: str, header, payload) -> None:
    """Raise CorruptObject naming the first field that does not match what the reader expects."""
    header = memoryview(header).cast("B")
    if header.nbytes < HEADER_BYTES:
        raise CorruptObject(f"object {key}: header truncated to {header.nbytes} bytes")
    magic, version, _, ns, kd, l0, l1, h0, h1, length, total, weighted = _HEADER.unpack(header[:HEADER_BYTES])
    payload = memoryview(payload).cast("B")
    expected = (MAGIC, VERSION, _digest8(namespace), _digest8(key),
                spec.layers.start, spec.layers.stop - 1, spec.heads.start, spec.heads.stop - 1)
    names = ("magic", "version", "namespace", "key digest", "first layer", "last layer",
             "first head", "last head")
    for name, got, want in zip(names, (magic, version, ns, kd, l0, l1, h0, h1), expected):
        if got != want:
            raise CorruptObject(f"object {key}: {name} is {got!r}, expected {want!r}")
    if length != payload.nbytes:
        raise CorruptObject(f"object {key}: payload is {payload.nbytes} bytes, header says {length}")
    if checksum(payload) != (total, weighted):
        raise CorruptObject(f"object {key}: payload checksum mismatch")
