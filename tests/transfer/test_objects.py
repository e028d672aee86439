import pytest
import torch

from hicache_async.keys import ObjectSpec, RankSuffixKeys, page_hashes
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.storage.memory import MemoryStorage
from hicache_async.transfer.objects import (
    HEADER_BYTES,
    CorruptObject,
    checksum,
    encode_header,
    expected_prefix,
    expected_prefixes,
    intact,
    verify,
)
from hicache_async.transfer.page_store import PageStore

SPEC = ObjectSpec("k1", range(0, 2), range(2, 4))
PAYLOAD = bytes(range(200))


def test_header_round_trip_is_64_bytes():
    header = encode_header("k1", SPEC, "ns", PAYLOAD)
    assert len(header) == HEADER_BYTES == 64
    verify("k1", SPEC, "ns", header, PAYLOAD)


@pytest.mark.parametrize("key,spec,ns,payload,reason", [
    ("k2", SPEC, "ns", PAYLOAD, "key digest"),
    ("k1", ObjectSpec("k1", range(0, 3), range(2, 4)), "ns", PAYLOAD, "last layer"),
    ("k1", ObjectSpec("k1", range(0, 2), range(0, 4)), "ns", PAYLOAD, "first head"),
    ("k1", SPEC, "other", PAYLOAD, "namespace"),
    ("k1", SPEC, "ns", PAYLOAD[:-1], "payload is 199 bytes"),
    ("k1", SPEC, "ns", PAYLOAD[:5] + b"\xff" + PAYLOAD[6:], "checksum"),
])
def test_any_mismatch_is_corrupt(key, spec, ns, payload, reason):
    header = encode_header("k1", SPEC, "ns", PAYLOAD)
    with pytest.raises(CorruptObject, match=reason):
        verify(key, spec, ns, header, payload)


def test_intact_checks_every_header_byte_against_a_prefix_made_before_the_read():
    header = memoryview(bytearray(encode_header("k1", SPEC, "ns", PAYLOAD)))
    prefix = expected_prefix("k1", SPEC, "ns", len(PAYLOAD))
    assert intact(header, prefix, PAYLOAD)
    assert not intact(header, expected_prefix("k2", SPEC, "ns", len(PAYLOAD)), PAYLOAD)
    assert not intact(header, expected_prefix("k1", SPEC, "ns", len(PAYLOAD) + 1), PAYLOAD)
    assert not intact(header, prefix, PAYLOAD[:5] + b"\xff" + PAYLOAD[6:])
    assert not intact(header, expected_prefix("k1", SPEC, "ns", len(PAYLOAD), b"tenant-2"), PAYLOAD)
    header[-1] ^= 1                            # the checksum is the last field
    assert not intact(header, prefix, PAYLOAD)
    with pytest.raises(CorruptObject, match="checksum"):
        verify("k1", SPEC, "ns", header, PAYLOAD)


def test_prefixes_of_a_run_of_pages_are_each_objects_own():
    """Several objects a page (a layer each), several pages: packed once per object of a page,
    each must still equal the prefix packed from its own fields."""
    specs = [ObjectSpec(f"{page}-L{layer}", range(layer, layer + 1), range(0, 4))
             for page in ("a", "b", "c") for layer in range(3)]
    lengths = [100, 200, 300]
    got = expected_prefixes(specs, "ns", lengths, b"tenant-1")
    assert got == [expected_prefix(spec.key, spec, "ns", lengths[i % 3], b"tenant-1") for i, spec in enumerate(specs)]
    assert len(set(got)) == len(specs)


def test_an_object_of_another_tenant_is_corrupt():
    header = encode_header("k1", SPEC, "ns", PAYLOAD, tenant=b"tenant-1")
    verify("k1", SPEC, "ns", header, PAYLOAD, tenant=b"tenant-1")
    for reader in (b"tenant-2", bytes(8)):
        with pytest.raises(CorruptObject, match="tenant"):
            verify("k1", SPEC, "ns", header, PAYLOAD, tenant=reader)


def test_truncated_header_is_corrupt():
    with pytest.raises(CorruptObject, match="header truncated"):
        verify("k1", SPEC, "ns", encode_header("k1", SPEC, "ns", PAYLOAD)[:30], PAYLOAD)


def _stored_page(layout=None):
    layout = layout or KVLayout(num_layers=2, kv_heads=2, head_dim=4, page_size=4)
    host = HostPool(layout, 2)
    host.tensor.copy_(torch.randn(host.tensor.shape))
    storage = MemoryStorage()
    store = PageStore(storage, layout, RankSuffixKeys(layout))
    h = page_hashes(range(4), 4)
    assert store.backup(h, host, [0]).ok == [True]
    return storage, store, host, h, store.keys.objects(h[0])[0].key


def test_flipped_byte_is_a_miss_and_counted():
    storage, store, host, h, key = _stored_page()
    blob = bytearray(storage._objects[key])
    blob[HEADER_BYTES + 7] ^= 0x01
    storage._objects[key] = bytes(blob)
    result = store.prefetch(h, host, [1])
    assert (result.pages, result.corrupt, store.counters.corrupt_objects) == (0, 1, 1)


def test_a_page_stored_for_one_tenant_is_a_counted_miss_for_any_other():
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=4, page_size=4)
    host = HostPool(layout, 2)
    host.tensor.copy_(torch.randn(host.tensor.shape))
    store = PageStore(MemoryStorage(), layout, RankSuffixKeys(layout))
    h = page_hashes(range(4), 4)
    assert store.backup(h, host, [0], tenant=b"tenant-a").ok == [True]
    for other in (b"tenant-b", bytes(8)):
        got = store.prefetch(h, host, [1], tenant=other)
        assert (got.pages, got.corrupt) == (0, 1)
    assert store.prefetch(h, host, [1], tenant=b"tenant-a").pages == 1
    assert torch.equal(host.tensor[1], host.tensor[0])
    with pytest.raises(ValueError, match="8 bytes"):
        store.prefetch(h, host, [1], tenant=b"short")


def test_truncated_object_is_a_miss_and_counted():
    storage, store, host, h, key = _stored_page()
    storage._objects[key] = storage._objects[key][:-3]
    result = store.prefetch(h, host, [1])
    assert (result.pages, result.corrupt, store.counters.corrupt_objects) == (0, 1, 1)


def test_object_from_another_namespace_is_a_miss():
    storage, store, host, h, key = _stored_page()
    other = KVLayout(num_layers=2, kv_heads=2, head_dim=4, page_size=4, model_id="other-model")
    reader = PageStore(storage, other, RankSuffixKeys(other))
    misplaced = reader.keys.objects(h[0])[0].key
    assert misplaced != key
    storage._objects[misplaced] = storage._objects[key]  # same bytes under the other model's key
    result = reader.prefetch(h, HostPool(other, 1), [0])
    assert (result.pages, result.corrupt) == (0, 1)


@pytest.mark.parametrize("size", [0, 5, 8, 511, 512, 4096 + 24])
def test_checksum_catches_any_flipped_bit_and_swapped_blocks(size):
    data = bytearray(torch.randint(0, 256, (size,), dtype=torch.uint8).tolist())
    good = checksum(data)
    for pos in range(0, size, 7):
        for bit in (0, 7):
            data[pos] ^= 1 << bit
            assert checksum(data) != good, (pos, bit)
            data[pos] ^= 1 << bit
    if size >= 1024:
        swapped = data[512:1024] + data[:512] + data[1024:]
        assert swapped != data and checksum(swapped) != good


def test_an_object_of_another_format_version_is_corrupt():
    header = bytearray(encode_header("k1", SPEC, "ns", PAYLOAD))
    header[4] = 1                              # version field, right after the 4-byte magic
    with pytest.raises(CorruptObject, match="version"):
        verify("k1", SPEC, "ns", bytes(header), PAYLOAD)
