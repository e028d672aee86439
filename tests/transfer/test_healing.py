"""A store that heals: an object that fails verification as a damaged copy of the reader's own
(a flipped byte, a truncation under our own header, a header zeroed by a crash) is removed by
the next backup of its key and written afresh, and so is every damaged object after it in the
prefix, which the prefetch never read, while the valid ones after it are kept: after one
recompute's backups, reads hit the whole prefix again, byte for byte. An object that may be
another writer's (another secret, another tenant, a sealed one read without the secret, an
object of another size without our header) is never removed, whatever the reader then backs
up. Real file stores in temp dirs, through the page store."""
import os

import pytest
import torch

from hicache_async.config import CacheConfig
from hicache_async.keys import page_hashes
from hicache_async.pools import HostPool
from hicache_async.storage.file import FileStorage
from hicache_async.storage.memory import MemoryStorage
from hicache_async.storage.sealed import SealedStorage, load_key
from hicache_async.topology import RankCoords
from hicache_async.transfer.l3_session import guarded_store
from hicache_async.errors import StorageError
from hicache_async.keys import ObjectSpec
from hicache_async.transfer import healer
from hicache_async.transfer.objects import HEADER_BYTES, NO_TENANT, encode_header
from hicache_async.transfer.page_store import PageStore
from tests.helpers.small_pages import LAYOUT, page_store, secret_file, seeded_host

HASHES = page_hashes(range(4 * 4), 4)
TENANT_A, TENANT_B = b"tenant-a", b"tenant-b"


def _object(store: PageStore, host: HostPool, page: int, spec, tenant: bytes = NO_TENANT) -> bytes:
    """What a correct backup stores for one object, built here from the page's bytes."""
    payload = store._slot(host, page, spec).contiguous().numpy().tobytes()
    return encode_header(spec.key, spec, LAYOUT.namespace(), payload, tenant) + payload


def _damage(blob: bytes, how: str) -> bytes:
    out = bytearray(blob)
    if how == "payload byte":
        out[HEADER_BYTES + 17] ^= 0x10
    elif how == "checksum byte":
        out[HEADER_BYTES - 1] ^= 0x01
    elif how == "key digest byte":
        out[24] ^= 0x01
    elif how == "zeroed header":
        out[:HEADER_BYTES] = bytes(HEADER_BYTES)
    elif how == "cut to its header":
        del out[HEADER_BYTES:]
    else:
        assert how == "truncated"
        del out[-100:]
    return bytes(out)


def _foreign(right: bytes, spec, how: str) -> bytes:
    """Another writer's object under our key, beside our own `right` one: its header is not ours."""
    payload = right[HEADER_BYTES:]
    if how == "another partition's, shorter":     # other layers, half the bytes
        other = ObjectSpec(spec.key, range(spec.layers.start + 1, spec.layers.stop + 1), spec.heads)
        return encode_header(spec.key, other, LAYOUT.namespace(), payload[:len(payload) // 2]) + payload[:len(payload) // 2]
    if how == "a draft model's, shorter":         # another namespace, half the bytes
        return encode_header(spec.key, spec, "draft", payload[:len(payload) // 2]) + payload[:len(payload) // 2]
    if how == "another tenant's":
        return encode_header(spec.key, spec, LAYOUT.namespace(), payload, TENANT_B) + payload
    if how == "longer":
        return encode_header(spec.key, spec, LAYOUT.namespace(), payload * 2) + payload * 2
    assert how == "empty"
    return b""


def _adapter(tmp_path, backend: str):
    raw = MemoryStorage() if backend == "memory" else FileStorage(str(tmp_path / "l3"))
    return SealedStorage(raw, load_key(secret_file(tmp_path / "secret"))) if backend == "sealed file" else raw


def _objects(store: PageStore, host: HostPool, hashes: list[str]) -> dict[str, bytes]:
    """What a correct backup of `host`'s pages stores under each key of `hashes`."""
    return {spec.key: _object(store, host, page, spec) for page, h in enumerate(hashes)
            for spec in store.keys.objects(h)}


def _put_raw(adapter, key: str, blob: bytes) -> None:
    """Store `blob` under `key` over whatever is there, as damage would: behind the store's back."""
    if isinstance(adapter, SealedStorage):      # damaged before sealing: it opens, then fails its checksum
        os.unlink(adapter.inner._path(key))
        assert adapter.batch_set_parts([key], [[memoryview(blob[:HEADER_BYTES]), memoryview(blob[HEADER_BYTES:])]])
    elif isinstance(adapter, FileStorage):
        with open(adapter._path(key), "wb") as f:
            f.write(blob)
    else:
        adapter._objects[key] = blob


def _get_raw(adapter, key: str, size: int) -> bytes:
    """The object under `key`, read as a page store reads it: its header, then its payload."""
    parts = [memoryview(bytearray(HEADER_BYTES)), memoryview(bytearray(size - HEADER_BYTES))]
    assert adapter.batch_get_parts([key], [parts]) == [size]
    return b"".join(parts)


def _raw_bytes(adapter, key: str) -> bytes | None:
    """The object under `key` whatever its size, behind the store's back (None: none)."""
    if isinstance(adapter, FileStorage):
        path = adapter._path(key)
        return open(path, "rb").read() if os.path.exists(path) else None
    return adapter._objects.get(key)


def _snapshot(root) -> dict[str, bytes]:
    return {os.path.join(d, f): open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(root) for f in fs}


CASES = [pytest.param(backend, scheme, how, id=f"{backend}-{scheme}-{how}")
         for backend in ("file", "memory") for scheme in ("rank-suffix", "unified")
         for how in ("payload byte", "checksum byte", "key digest byte", "zeroed header", "truncated",
                     "cut to its header")]
CASES += [pytest.param("sealed file", scheme, how, id=f"sealed-{scheme}-{how}")
          for scheme in ("rank-suffix", "unified") for how in ("payload byte", "zeroed header")]


@pytest.mark.parametrize("backend,scheme,how", CASES)
def test_a_damaged_object_is_rewritten_by_the_next_backup_and_then_read_back_verified(
        tmp_path, backend, scheme, how):
    adapter = _adapter(tmp_path, backend)
    host = seeded_host()
    assert page_store(adapter, scheme).backup(HASHES, host, [0, 1, 2, 3]).ok == [True] * 4
    store = page_store(adapter, scheme)                    # a later process: it reads, then backs up
    specs = store.keys.objects(HASHES[1])
    bad = specs[len(specs) // 2]                       # an object of the second page (mid-page when several)
    right = _object(store, host, 1, bad)
    _put_raw(adapter, bad.key, _damage(right, how))

    found = store.prefetch(HASHES, HostPool(LAYOUT, 4), [0, 1, 2, 3])
    assert (found.pages, found.corrupt, found.forged) == (1, 1, 0)

    again = store.backup(HASHES, host, [0, 1, 2, 3])
    assert again.ok == [True] * 4 and again.errors == 0
    assert again.bytes == len(right)                   # the damaged object, and it alone, was written
    assert _get_raw(adapter, bad.key, len(right)) == right
    reader = HostPool(LAYOUT, 4)
    got = page_store(adapter, scheme).prefetch(HASHES, reader, [3, 2, 1, 0])
    assert (got.pages, got.corrupt) == (4, 0)
    assert torch.equal(reader.tensor.flip(0), host.tensor)

    short = how in ("truncated", "cut to its header")        # proven ours by the backup, from its header
    assert (found.damaged, again.healed, got.damaged) == (not short, 1, 0)
    assert store.counters.healed_objects == 1 and store.counters.corrupt_objects == 1
    assert store.backup(HASHES, host, [0, 1, 2, 3]).healed == 0     # healed once, then left alone


WHOLE = [pytest.param(backend, scheme, id=f"{backend}-{scheme}")
         for backend in ("file", "memory", "sealed file") for scheme in ("rank-suffix", "unified")]


@pytest.mark.parametrize("backend,scheme", WHOLE)
def test_every_damaged_object_of_a_prefix_is_rewritten_by_one_recompute(tmp_path, monkeypatch, backend, scheme):
    """Every object damaged, one way or another: the prefetch stops at the first and reads no
    other, yet the one backup that follows rewrites them all (checked in several proof reads)."""
    monkeypatch.setattr(healer, "PROOF_BYTES", 2500)        # two 1 KiB objects a proof read
    adapter = _adapter(tmp_path, backend)
    host = seeded_host()
    assert page_store(adapter, scheme).backup(HASHES, host, [0, 1, 2, 3]).ok == [True] * 4
    store = page_store(adapter, scheme)
    right = _objects(store, host, HASHES)
    kinds = ("payload byte", "checksum byte", "key digest byte", "zeroed header", "truncated", "cut to its header")
    if backend == "sealed file":      # a shorter sealed object does not open: another secret's, for all we know
        kinds = kinds[:4]
    for n, (key, blob) in enumerate(right.items()):
        _put_raw(adapter, key, _damage(blob, kinds[n % len(kinds)]))

    found = store.prefetch(HASHES, HostPool(LAYOUT, 4), [0, 1, 2, 3])
    assert (found.pages, found.corrupt, found.damaged) == (0, 1, 1)
    again = store.backup(HASHES, host, [0, 1, 2, 3])         # the recompute's: every page of the prefix
    assert again.ok == [True] * 4 and (again.errors, again.pages) == (0, 4)
    assert again.healed == store.counters.healed_objects == len(right)
    assert again.bytes == sum(map(len, right.values()))
    assert {key: _get_raw(adapter, key, len(blob)) for key, blob in right.items()} == right
    reader = HostPool(LAYOUT, 4)
    got = page_store(adapter, scheme).prefetch(HASHES, reader, [0, 1, 2, 3])
    assert (got.pages, got.corrupt) == (4, 0) and torch.equal(reader.tensor, host.tensor)


LEFT = ("another partition's, shorter", "a draft model's, shorter", "another tenant's", "longer", "empty")


@pytest.mark.parametrize("backend", ["file", "memory"])
@pytest.mark.parametrize("theirs", LEFT)
def test_after_a_damaged_object_valid_ones_are_kept_and_what_is_not_ours_is_left(tmp_path, backend, theirs):
    """Page 1 damaged; after it, unread, page 2 holds another writer's object and page 3 a valid
    one of ours; page 4 is missing. A recompute gives other bytes (seed 1): the backup rewrites
    page 1, writes page 4, and keeps pages 2 and 3 byte for byte."""
    hashes = page_hashes(range(5 * 4), 4)
    first, recomputed = HostPool(LAYOUT, 5), HostPool(LAYOUT, 5)
    first.tensor.copy_(torch.randn(first.tensor.shape, generator=torch.Generator().manual_seed(0)))
    recomputed.tensor.copy_(torch.randn(first.tensor.shape, generator=torch.Generator().manual_seed(1)))
    adapter = _adapter(tmp_path, backend)
    store = page_store(adapter)
    assert store.backup(hashes, first, list(range(5))).ok == [True] * 5
    old, new = _objects(store, first, hashes), _objects(store, recomputed, hashes)
    (k0,), (k1,), (k2,), (k3,), (k4,) = ([s.key for s in store.keys.objects(h)] for h in hashes)
    _put_raw(adapter, k1, _damage(old[k1], "payload byte"))
    _put_raw(adapter, k2, _foreign(old[k2], store.keys.objects(hashes[2])[0], theirs))
    adapter.batch_remove([k4])
    stored = {k: _raw_bytes(adapter, k) for k in (k0, k2, k3)}

    reader = page_store(adapter)
    found = reader.prefetch(hashes, HostPool(LAYOUT, 5), list(range(5)))
    assert (found.pages, found.damaged) == (1, 1)
    again = reader.backup(hashes, recomputed, list(range(5)))
    assert again.ok == [True] * 5 and (again.pages, again.healed, again.skipped) == (2, 1, 3)
    assert _raw_bytes(adapter, k1) == new[k1] and _raw_bytes(adapter, k4) == new[k4]
    assert {k: _raw_bytes(adapter, k) for k in (k0, k2, k3)} == stored
    assert reader.counters.healed_objects == 1


@pytest.mark.parametrize("backend", ["file", "memory"])
@pytest.mark.parametrize("theirs", LEFT)
def test_an_object_of_another_writer_under_our_key_is_a_miss_never_removed(tmp_path, backend, theirs):
    """Another size without our header, or another tenant's: a miss for every read, and no
    backup of ours removes it, however often it runs."""
    adapter = _adapter(tmp_path, backend)
    host = seeded_host()
    store = page_store(adapter)
    assert store.backup(HASHES, host, [0, 1, 2, 3]).ok == [True] * 4
    spec = store.keys.objects(HASHES[1])[0]
    _put_raw(adapter, spec.key, _foreign(_object(store, host, 1, spec), spec, theirs))
    before = {k: _raw_bytes(adapter, k) for k in _objects(store, host, HASHES)}

    for _ in range(2):
        reader = page_store(adapter)
        found = reader.prefetch(HASHES, HostPool(LAYOUT, 4), [0, 1, 2, 3])
        assert (found.pages, found.corrupt, found.damaged) == (1, 1, 0)
        again = reader.backup(HASHES, host, [0, 1, 2, 3])
        assert again.ok == [True] * 4 and (again.bytes, again.skipped, again.healed) == (0, 4, 0)
        assert {k: _raw_bytes(adapter, k) for k in before} == before


def test_a_failed_proof_read_is_counted_and_the_object_found_again(tmp_path, monkeypatch):
    raw = FileStorage(str(tmp_path / "l3"))
    store, host = page_store(raw), seeded_host()
    store.backup(HASHES, host, [0, 1, 2, 3])
    right = _objects(store, host, HASHES)
    for key in list(right)[1:]:
        _put_raw(raw, key, _damage(right[key], "truncated"))
    assert store.prefetch(HASHES, HostPool(LAYOUT, 4), [0, 1, 2, 3]).pages == 1

    def down(keys, buffers):
        raise StorageError("file storage: down")

    monkeypatch.setattr(raw, "batch_get", down)
    again = store.backup(HASHES, host, [0, 1, 2, 3])
    monkeypatch.undo()
    assert again.ok == [True] * 4 and (again.bytes, again.healed) == (0, 0)
    assert store.counters.storage_errors == 1
    assert store.prefetch(HASHES, HostPool(LAYOUT, 4), [0, 1, 2, 3]).pages == 1     # found again
    assert store.backup(HASHES, host, [0, 1, 2, 3]).healed == 3                      # and healed at last
    assert store.prefetch(HASHES, HostPool(LAYOUT, 4), [0, 1, 2, 3]).pages == 4


def _writer_and_reader(tmp_path, case: str, raw: FileStorage):
    """(writer store, its tenant, reader store, its tenant) for a reader that cannot claim the objects."""
    sealed = SealedStorage(raw, load_key(secret_file(tmp_path / "secret")))
    if case == "another secret":
        other = SealedStorage(raw, load_key(secret_file(tmp_path / "other")))
        return page_store(sealed), NO_TENANT, page_store(other), NO_TENANT
    if case == "no secret, sealed objects":
        return page_store(sealed), NO_TENANT, page_store(raw), NO_TENANT
    if case == "a secret, unsealed objects":
        return page_store(raw), NO_TENANT, page_store(sealed), NO_TENANT
    if case == "tampered sealed object":
        return page_store(sealed), NO_TENANT, page_store(sealed), NO_TENANT
    assert case == "another tenant"
    return page_store(raw), TENANT_A, page_store(raw), TENANT_B


@pytest.mark.parametrize("case", ["another secret", "no secret, sealed objects", "a secret, unsealed objects",
                                  "tampered sealed object", "another tenant"])
def test_a_reader_never_removes_what_may_be_another_writers(tmp_path, case):
    raw = FileStorage(str(tmp_path / "l3"))
    writer, mine, reader, theirs = _writer_and_reader(tmp_path, case, raw)
    host = seeded_host()
    assert writer.backup(HASHES, host, [0, 1, 2, 3], tenant=mine).ok == [True] * 4
    if case == "tampered sealed object":         # a flipped ciphertext byte: AES-GCM cannot tell it from another secret
        path = raw._path(writer.keys.objects(HASHES[0])[0].key)
        blob = bytearray(open(path, "rb").read())
        blob[HEADER_BYTES + 40] ^= 0x01
        open(path, "wb").write(bytes(blob))
    before = _snapshot(tmp_path / "l3")

    got = reader.prefetch(HASHES, HostPool(LAYOUT, 4), [0, 1, 2, 3], tenant=theirs)
    assert got.pages == 0 and got.corrupt + got.forged == 1
    again = reader.backup(HASHES, seeded_host(seed=1), [0, 1, 2, 3], tenant=theirs)
    assert again.ok == [True] * 4 and (again.bytes, again.skipped) == (0, 4)
    assert _snapshot(tmp_path / "l3") == before          # not a byte of the store changed
    if case != "tampered sealed object":
        into = HostPool(LAYOUT, 4)
        assert writer.prefetch(HASHES, into, [0, 1, 2, 3], tenant=mine).pages == 4
        assert torch.equal(into.tensor, host.tensor)
    assert (got.damaged, again.healed, reader.counters.healed_objects) == (0, 0, 0)


def test_the_guarded_traced_stack_heals(tmp_path):
    """The stack every owner of a page store builds (`guarded_store`): deadline, breaker and spans
    pass the removal through to the backend."""
    raw = FileStorage(str(tmp_path / "l3"))
    store = guarded_store(raw, "file", LAYOUT, RankCoords(), CacheConfig(page_size=4))
    host = seeded_host()
    assert store.backup(HASHES, host, [0, 1, 2, 3]).ok == [True] * 4
    spec = store.keys.objects(HASHES[0])[0]
    right = _object(store, host, 0, spec)
    _put_raw(raw, spec.key, _damage(right, "payload byte"))
    assert store.prefetch(HASHES, HostPool(LAYOUT, 4), [0, 1, 2, 3]).corrupt == 1
    healed = store.backup(HASHES, host, [0, 1, 2, 3])
    assert open(raw._path(spec.key), "rb").read() == right
    reader = HostPool(LAYOUT, 4)
    assert store.prefetch(HASHES, reader, [0, 1, 2, 3]).pages == 4 and torch.equal(reader.tensor, host.tensor)
    assert healed.healed == store.counters.healed_objects == 1


def test_a_failed_removal_is_counted_and_the_object_found_again(tmp_path, monkeypatch):
    raw = FileStorage(str(tmp_path / "l3"))
    store, host = page_store(raw), seeded_host()
    store.backup(HASHES, host, [0, 1, 2, 3])
    spec = store.keys.objects(HASHES[0])[0]
    _put_raw(raw, spec.key, _damage(_object(store, host, 0, spec), "payload byte"))
    assert store.prefetch(HASHES, HostPool(LAYOUT, 4), [0, 1, 2, 3]).corrupt == 1

    def refused(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "unlink", refused)
    again = store.backup(HASHES, host, [0, 1, 2, 3])
    monkeypatch.undo()
    assert again.ok == [True] * 4 and again.bytes == 0 and store.counters.storage_errors == 1
    assert store.prefetch(HASHES, HostPool(LAYOUT, 4), [0, 1, 2, 3]).corrupt == 1   # still there, found again
    assert store.backup(HASHES, host, [0, 1, 2, 3]).bytes > 0                      # and rewritten at last
    assert store.prefetch(HASHES, HostPool(LAYOUT, 4), [0, 1, 2, 3]).pages == 4
    assert store.counters.healed_objects == 1
