"""Healing in real vLLM (CPU build) over a file L3: when every object of a prompt's prefix is
damaged, the one process that recomputes the prompt rewrites them all, so the next process is
served the whole prefix again; a shorter object of another layout under one of our keys is a
miss, and stays. Every output equals the same request's cache-less run. The writer and the
two readers are the session's (`SharedL3`), each test under a salt of its own; the first test's
also with vLLM's scheduling as on a GPU (async: a step ahead of the worker)."""
from __future__ import annotations

import xxhash

from hicache_async.transfer.objects import _HEADER, HEADER_BYTES

from .conftest import BLOCK, page_files
from .engines import SCHEDULINGS, gen, same_output, tiers

HIT = 288   # nine full pages


@SCHEDULINGS
def test_every_damaged_object_of_a_prefix_heals_after_one_recompute(prompts, cold, l3, salt, scheduling):
    l3.write([gen(prompts["p"], salt)], **scheduling)
    objects = [f for page in page_files(l3.path, prompts["p"], salt) for f in page]
    assert len(objects) == 9
    damaged = {}
    for obj in objects:
        data = bytearray(obj.read_bytes())
        data[len(data) // 2] ^= 0x40
        obj.write_bytes(bytes(data))
        damaged[obj] = bytes(data)

    (recomputed,) = l3.read([gen(prompts["p"], salt)], **scheduling)
    assert recomputed["cached"] == 0 and same_output(recomputed, cold["p"])
    assert all(obj.read_bytes() != data for obj, data in damaged.items())     # every one rewritten
    (healed,) = l3.read_again([gen(prompts["p"], salt)], **scheduling)
    assert tiers(healed)[1] == HIT and same_output(healed, cold["p"])


def _another_layout(blob: bytes) -> bytes:
    """What another layer partition stores under the same key: the first half of the layers,
    half the bytes, a header of its own (valid: its checksum is right)."""
    fields = list(_HEADER.unpack(blob[:HEADER_BYTES]))
    payload = blob[HEADER_BYTES:HEADER_BYTES + (len(blob) - HEADER_BYTES) // 2]
    first, last = fields[6], fields[7]
    fields[7] = first + (last - first + 1) // 2 - 1
    fields[10], fields[11] = len(payload), xxhash.xxh3_64_intdigest(payload)
    return _HEADER.pack(*fields) + payload


def test_a_shorter_object_of_another_layout_is_a_miss_never_removed(prompts, cold, l3, salt):
    l3.write([gen(prompts["p"], salt)])
    (obj,) = page_files(l3.path, prompts["p"], salt)[4]
    theirs = _another_layout(obj.read_bytes())
    obj.write_bytes(theirs)

    (short,) = l3.read([gen(prompts["p"], salt)])
    assert short["cached"] == 4 * BLOCK and same_output(short, cold["p"])
    assert obj.read_bytes() == theirs
