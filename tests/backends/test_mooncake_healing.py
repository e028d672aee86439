"""A Mooncake store that heals (see test_healing.py), on a real mooncake_master (conftest.py's
fixtures): a put never replaces a stored key, so the backup that rewrites a damaged object
removes it first, even under the lease the reader's own get left; one backup rewrites every
damaged object of a prefix, proving each ours by a read; another secret's objects, and a
shorter object of another layout, stay, byte for byte."""
import os

import pytest
import torch

from hicache_async.keys import ObjectSpec, make_key_scheme, page_hashes
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.storage.sealed import SEAL_BYTES, SealedStorage, load_key
from hicache_async.transfer.objects import HEADER_BYTES, encode_header
from hicache_async.transfer.page_store import PageStore

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=64, page_size=16)   # 16 KiB pages


def _host(seed: int = 0) -> HostPool:
    host = HostPool(LAYOUT, 4)
    host.tensor.copy_(torch.randn(host.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    return host


def _store(adapter, scheme: str) -> PageStore:
    return PageStore(adapter, LAYOUT, make_key_scheme(scheme, LAYOUT, head_group=1))


def _raw(adapter, key: str, room: int) -> bytes:
    buf = memoryview(bytearray(room))
    n = adapter.batch_get([key], [buf])[0]
    assert n >= 0, n
    return bytes(buf[:n])


def _key(path):
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return load_key(str(path))


@pytest.mark.parametrize("scheme,how,first_token", [("rank-suffix", "payload byte", 40_000),
                                                    ("unified", "payload byte", 41_000),
                                                    ("rank-suffix", "truncated", 42_000)])
def test_a_damaged_object_is_removed_and_put_afresh_then_read_back_verified(mooncake_storage, scheme, how,
                                                                            first_token):
    hashes = page_hashes(range(first_token, first_token + 4 * 16), 16)
    host = _host()
    store = _store(mooncake_storage, scheme)
    assert store.backup(hashes, host, [0, 1, 2, 3]).ok == [True] * 4
    bad = store.keys.objects(hashes[2])[0]
    payload = store._slot(host, 2, bad).contiguous().numpy().tobytes()
    right = encode_header(bad.key, bad, LAYOUT.namespace(), payload) + payload
    damaged = bytearray(right)
    if how == "payload byte":
        damaged[HEADER_BYTES + 1000] ^= 0x04
    else:
        del damaged[-512:]
    assert mooncake_storage._store.batch_remove([bad.key], True) == [0]
    assert mooncake_storage.batch_set([bad.key], [bytes(damaged)]) == [True]

    found = store.prefetch(hashes, HostPool(LAYOUT, 4), [0, 1, 2, 3])
    assert (found.pages, found.corrupt, found.forged) == (2, 1, 0)
    again = store.backup(hashes, host, [0, 1, 2, 3])        # at once: the get's lease still holds
    assert again.ok == [True] * 4 and again.bytes == len(right)
    assert _raw(mooncake_storage, bad.key, len(right) + 4096) == right
    reader = HostPool(LAYOUT, 4)
    got = _store(mooncake_storage, scheme).prefetch(hashes, reader, [3, 2, 1, 0])
    assert (got.pages, got.corrupt) == (4, 0) and torch.equal(reader.tensor.flip(0), host.tensor)
    # a truncated one is proven ours by the backup, from its header
    assert (found.damaged, again.healed, store.counters.healed_objects) == (how != "truncated", 1, 1)


def _right(store: PageStore, host: HostPool, hashes: list[str]) -> dict[str, bytes]:
    out = {}
    for page, h in enumerate(hashes):
        for spec in store.keys.objects(h):
            payload = store._slot(host, page, spec).contiguous().numpy().tobytes()
            out[spec.key] = encode_header(spec.key, spec, LAYOUT.namespace(), payload) + payload
    return out


def _replace(adapter, key: str, blob: bytes) -> None:
    assert adapter._store.batch_remove([key], True) == [0]
    assert adapter.batch_set([key], [blob]) == [True]


@pytest.mark.parametrize("scheme,first_token", [("rank-suffix", 46_000), ("unified", 47_000)])
def test_every_damaged_object_of_a_prefix_is_rewritten_by_one_backup(mooncake_storage, scheme, first_token):
    hashes = page_hashes(range(first_token, first_token + 4 * 16), 16)
    host = _host()
    store = _store(mooncake_storage, scheme)
    assert store.backup(hashes, host, [0, 1, 2, 3]).ok == [True] * 4
    right = _right(store, host, hashes)
    for n, (key, blob) in enumerate(right.items()):
        damaged = bytearray(blob)
        if n % 2:
            del damaged[-512:]
        else:
            damaged[HEADER_BYTES + 1000] ^= 0x04
        _replace(mooncake_storage, key, bytes(damaged))

    found = store.prefetch(hashes, HostPool(LAYOUT, 4), [0, 1, 2, 3])
    assert (found.pages, found.corrupt, found.damaged) == (0, 1, 1)
    again = store.backup(hashes, host, [0, 1, 2, 3])        # the recompute's: every page of the prefix
    assert again.ok == [True] * 4 and (again.pages, again.healed, again.errors) == (4, len(right), 0)
    assert {key: _raw(mooncake_storage, key, len(blob) + 4096) for key, blob in right.items()} == right
    reader = HostPool(LAYOUT, 4)
    got = _store(mooncake_storage, scheme).prefetch(hashes, reader, [0, 1, 2, 3])
    assert (got.pages, got.corrupt) == (4, 0) and torch.equal(reader.tensor, host.tensor)


def test_a_shorter_object_of_another_layout_is_a_miss_never_removed(mooncake_storage):
    """Another layer partition's object under our key: half our size, its header its own."""
    hashes = page_hashes(range(48_000, 48_000 + 4 * 16), 16)
    host = _host()
    store = _store(mooncake_storage, "rank-suffix")
    assert store.backup(hashes, host, [0, 1, 2, 3]).ok == [True] * 4
    right = _right(store, host, hashes)
    spec = store.keys.objects(hashes[1])[0]
    half = right[spec.key][HEADER_BYTES:HEADER_BYTES + LAYOUT.page_bytes // 2]
    theirs = ObjectSpec(spec.key, range(spec.layers.start, spec.layers.start + 1), spec.heads)
    _replace(mooncake_storage, spec.key, encode_header(spec.key, theirs, LAYOUT.namespace(), half) + half)
    before = {key: _raw(mooncake_storage, key, len(blob) + 4096) for key, blob in right.items()}

    for _ in range(2):
        reader = _store(mooncake_storage, "rank-suffix")
        found = reader.prefetch(hashes, HostPool(LAYOUT, 4), [0, 1, 2, 3])
        assert (found.pages, found.corrupt, found.damaged) == (1, 1, 0)
        again = reader.backup(hashes, host, [0, 1, 2, 3])
        assert again.ok == [True] * 4 and (again.bytes, again.skipped, again.healed) == (0, 4, 0)
        assert {key: _raw(mooncake_storage, key, len(blob) + 4096) for key, blob in right.items()} == before


@pytest.mark.parametrize("reader_secret", [True, False])
def test_another_secrets_objects_are_never_removed(mooncake_storage, tmp_path, reader_secret):
    hashes = page_hashes(range(43_000 + 1000 * reader_secret, 43_000 + 1000 * reader_secret + 4 * 16), 16)
    host = _host()
    writer = _store(SealedStorage(mooncake_storage, _key(tmp_path / "a")), "rank-suffix")
    assert writer.backup(hashes, host, [0, 1, 2, 3]).ok == [True] * 4
    keys = [spec.key for h in hashes for spec in writer.keys.objects(h)]
    room = HEADER_BYTES + LAYOUT.page_bytes + SEAL_BYTES
    before = [_raw(mooncake_storage, key, room) for key in keys]    # each with its random nonce

    reader = _store(SealedStorage(mooncake_storage, _key(tmp_path / "b")) if reader_secret else mooncake_storage,
                    "rank-suffix")
    got = reader.prefetch(hashes, HostPool(LAYOUT, 4), [0, 1, 2, 3])
    assert got.pages == 0 and got.corrupt + got.forged == 1
    again = reader.backup(hashes, _host(seed=1), [0, 1, 2, 3])
    assert (again.bytes, again.skipped) == (0, 4)
    assert [_raw(mooncake_storage, key, room) for key in keys] == before
    into = HostPool(LAYOUT, 4)
    assert writer.prefetch(hashes, into, [0, 1, 2, 3]).pages == 4 and torch.equal(into.tensor, host.tensor)
    assert (got.damaged, again.healed) == (0, 0)
