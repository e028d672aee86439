"""A store that heals: an object that fails verification as a damaged copy of the reader's own
(a flipped byte, a truncation, a header zeroed by a crash) is removed by the next backup of its
key and written afresh, so reads hit again, byte for byte. An object that may be another
writer's (another secret, another tenant, a sealed one read without the secret) is never
removed, whatever the reader then backs up. Real file stores in temp dirs, through the page store."""
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
    elif how == "truncated":
        del out[-100:]
    else:
        assert how == "emptied"
        out.clear()
    return bytes(out)


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


def _snapshot(root) -> dict[str, bytes]:
    return {os.path.join(d, f): open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(root) for f in fs}


CASES = [pytest.param(backend, scheme, how, id=f"{backend}-{scheme}-{how}")
         for backend in ("file", "memory") for scheme in ("rank-suffix", "unified")
         for how in ("payload byte", "checksum byte", "key digest byte", "zeroed header", "truncated", "emptied")]
CASES += [pytest.param("sealed file", scheme, how, id=f"sealed-{scheme}-{how}")
          for scheme in ("rank-suffix", "unified") for how in ("payload byte", "zeroed header")]


@pytest.mark.parametrize("backend,scheme,how", CASES)
def test_a_damaged_object_is_rewritten_by_the_next_backup_and_then_read_back_verified(
        tmp_path, backend, scheme, how):
    raw = MemoryStorage() if backend == "memory" else FileStorage(str(tmp_path / "l3"))
    adapter = SealedStorage(raw, load_key(secret_file(tmp_path / "secret"))) if backend == "sealed file" else raw
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

    assert (found.damaged, again.healed, got.damaged) == (1, 1, 0)
    assert store.counters.healed_objects == 1 and store.counters.corrupt_objects == 1
    assert store.backup(HASHES, host, [0, 1, 2, 3]).healed == 0     # healed once, then left alone


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
