"""A sealed store (`--storage-secret-file`): every object authenticated and encrypted with
AES-256-GCM, the header as associated data. An object written without the secret, under
another one, or altered in any byte is a miss counted as forged, never KV; the secret shows
nowhere; a bad secret file is one line and exit 2."""
import json
import subprocess
import sys

import pytest
import torch

from hicache_async.errors import UsageError
from hicache_async.keys import page_hashes
from hicache_async.pools import HostPool
from hicache_async.storage.file import FileStorage
from hicache_async.storage.memory import MemoryStorage
from hicache_async.storage.sealed import SEAL_BYTES, SealedStorage, load_key
from hicache_async.transfer.objects import HEADER_BYTES
from tests.helpers.small_pages import LAYOUT, page_store, secret_file, seeded_host

HASHES = page_hashes(range(4 * 4), 4)
RUN = ["--requests", "16", "--page-size", "8", "--device-pages", "48", "--host-pages", "56",
       "--prefetch-threshold", "8"]


@pytest.mark.parametrize("scheme", ["rank-suffix", "unified"])
def test_a_sealed_round_trip_stores_no_plaintext(tmp_path, scheme):
    key = load_key(secret_file(tmp_path / "secret"))
    host, raw = seeded_host(), FileStorage(str(tmp_path / "l3"))
    store = page_store(SealedStorage(raw, key), scheme)
    assert store.backup(HASHES, host, [0, 1, 2, 3]).ok == [True] * 4
    reader = HostPool(LAYOUT, 4)
    got = store.prefetch(HASHES, reader, [3, 2, 1, 0])
    assert (got.pages, got.corrupt, got.forged) == (4, 0, 0)
    assert torch.equal(reader.tensor.flip(0), host.tensor)
    for page, h in enumerate(HASHES):
        for spec in store.keys.objects(h):
            blob = open(raw._path(spec.key), "rb").read()
            payload = store._slot(host, page, spec).contiguous().numpy().tobytes()
            assert len(blob) == HEADER_BYTES + len(payload) + SEAL_BYTES
            assert blob[:4] == b"HKV\x00"                # the header stays readable
            assert payload[:16] not in blob and payload[-16:] not in blob


def test_a_batch_bigger_than_a_run_moves_in_several_calls_and_stops_at_a_forgery(tmp_path, monkeypatch):
    from hicache_async.storage import sealed as sealed_module

    monkeypatch.setattr(sealed_module, "RUN_BYTES", 1)   # one object a backend call
    raw, host, calls = MemoryStorage(), seeded_host(), []
    get = raw.batch_get
    raw.batch_get = lambda keys, buffers: calls.append(len(keys)) or get(keys, buffers)
    store = page_store(SealedStorage(raw, load_key(secret_file(tmp_path / "secret"))))
    assert store.backup(HASHES, host, [0, 1, 2, 3]).ok == [True] * 4
    reader = HostPool(LAYOUT, 4)
    assert store.prefetch(HASHES, reader, [0, 1, 2, 3]).pages == 4 and torch.equal(reader.tensor, host.tensor)
    assert calls == [1] * 4
    _forge("ciphertext", raw, store.keys.objects(HASHES[2])[0].key)
    got = store.prefetch(HASHES, HostPool(LAYOUT, 4), [0, 1, 2, 3])
    assert (got.pages, got.forged) == (2, 1)


def test_each_object_gets_a_fresh_nonce(tmp_path):
    raw = MemoryStorage()
    store = page_store(SealedStorage(raw, load_key(secret_file(tmp_path / "secret"))))
    host = seeded_host()
    host.tensor[1] = host.tensor[0]                      # two pages of equal KV
    assert store.backup(HASHES[:2], host, [0, 1]).ok == [True] * 2
    blobs = [raw._objects[store.keys.objects(h)[0].key] for h in HASHES[:2]]
    nonces = [b[HEADER_BYTES:HEADER_BYTES + 12] for b in blobs]
    assert nonces[0] != nonces[1] and blobs[0][HEADER_BYTES:] != blobs[1][HEADER_BYTES:]


def _forge(how: str, raw: MemoryStorage, key: str) -> None:
    blob = bytearray(raw._objects[key])
    at = {"header": 20, "nonce": HEADER_BYTES + 3, "ciphertext": HEADER_BYTES + 40, "tag": len(blob) - 5}[how]
    blob[at] ^= 0x01
    raw._objects[key] = bytes(blob)


@pytest.mark.parametrize("how", ["without the secret", "another secret", "header", "nonce", "ciphertext", "tag",
                                 "truncated"])
def test_an_object_that_does_not_open_is_a_miss_counted_as_forged(tmp_path, how):
    raw, host = MemoryStorage(), seeded_host()
    sealed = page_store(SealedStorage(raw, load_key(secret_file(tmp_path / "secret"))))
    if how == "without the secret":
        writer = page_store(raw)
    elif how == "another secret":
        writer = page_store(SealedStorage(raw, load_key(secret_file(tmp_path / "other"))))
    else:
        writer = sealed
    assert writer.backup(HASHES, host, [0, 1, 2, 3]).ok == [True] * 4
    second = sealed.keys.objects(HASHES[1])[0].key
    if how in ("header", "nonce", "ciphertext", "tag"):
        _forge(how, raw, second)
    elif how == "truncated":
        raw._objects[second] = raw._objects[second][:-1]
    reader = HostPool(LAYOUT, 4)
    got = sealed.prefetch(HASHES, reader, [0, 1, 2, 3])
    leading = 0 if how in ("without the secret", "another secret") else 1
    assert (got.pages, got.forged, got.corrupt, sealed.counters.forged_objects) == (leading, 1, 0, 1)
    assert torch.equal(reader.tensor[:leading], host.tensor[:leading])
    assert torch.count_nonzero(reader.tensor[leading]) == 0    # nothing of a forged object lands


def test_an_unsealed_reader_of_a_sealed_object_misses(tmp_path):
    raw = MemoryStorage()
    sealed = page_store(SealedStorage(raw, load_key(secret_file(tmp_path / "s"))))
    assert sealed.backup(HASHES, seeded_host(), [0, 1, 2, 3]).ok
    got = page_store(raw).prefetch(HASHES, HostPool(LAYOUT, 4), [0, 1, 2, 3])
    assert (got.pages, got.corrupt) == (0, 1)


@pytest.mark.parametrize("setup,named", [
    (lambda p: None, "cannot read it: No such file"),
    (lambda p: p.mkdir(), "not a regular file"),
    (lambda p: secret_file(p, size=31), "holds 31 bytes; a secret is at least 32 random bytes"),
    (lambda p: secret_file(p, mode=0o640), "open to group or others (mode 640)"),
    (lambda p: secret_file(p, mode=0o604), "open to group or others (mode 604)"),
])
def test_a_bad_secret_file_is_one_line_and_exit_2(tmp_path, setup, named):
    path = tmp_path / "secret"
    setup(path)
    with pytest.raises(UsageError, match=named.replace("(", r"\(").replace(")", r"\)")):
        load_key(str(path))
    done = subprocess.run([sys.executable, "-m", "hicache_async", "simulate", "--storage-secret-file", str(path),
                           "--requests", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and named in done.stderr, done.stderr
    assert str(path) in done.stderr and "Traceback" not in done.stderr


def _simulate(tmp_path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "hicache_async", "simulate", *RUN, "--storage-path",
                           str(tmp_path / "l3"), "--json", str(out), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text()), done.stdout + done.stderr


def test_simulate_seals_its_store_and_another_secret_finds_only_forgeries(tmp_path):
    secret, other = secret_file(tmp_path / "secret"), secret_file(tmp_path / "other")
    first, said = _simulate(tmp_path, "--storage-secret-file", secret, "--trace-file", str(tmp_path / "spans.json"))
    assert first["storage_sealed"] and first["forged_objects"] == 0 and first["tokens_from_l3"] > 0, first
    assert first["kv_mismatches"] == 0 and first["outputs_match_reference"]
    assert "(sealed)" in said and "forged objects 0" in said
    again, _ = _simulate(tmp_path, "--storage-secret-file", other)
    assert again["forged_objects"] > 0 and again["tokens_from_l3"] == 0, again
    assert again["kv_mismatches"] == 0 and again["outputs_match_reference"]
    raw = open(secret, "rb").read()
    shown = said + (tmp_path / "out.json").read_text() + (tmp_path / "spans.json").read_text()
    for form in (raw.hex(), raw.hex().upper(), repr(raw)[2:-1]):
        assert form not in shown                         # the secret shows nowhere


def test_a_secret_file_needs_a_storage(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hicache_async", "simulate", "--storage", "none",
                           "--storage-secret-file", secret_file(tmp_path / "s"), "--requests", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "needs a storage to seal" in done.stderr and done.stderr.count("\n") == 1
