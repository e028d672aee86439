import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from hicache_async.errors import StorageError, UsageError
from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.storage import MISSING, WRONG_SIZE, open_storage
from hicache_async.storage.base import run_abandonable
from hicache_async.storage.file import FileStorage, object_name
from hicache_async.transfer.page_store import PageStore


def _files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def _get(fs, key, size=64):
    buf = memoryview(bytearray(size))
    n = fs.batch_get([key], [buf])[0]
    return bytes(buf[:n]) if n >= 0 else n


def test_round_trip_leading_run_and_sizes(tmp_path):
    fs = open_storage("file", path=str(tmp_path))
    assert fs.batch_set(["a", "b", "d"], [b"one", b"two", b"four"]) == [True] * 3
    assert fs.batch_exists(["a", "b", "c", "d"]) == 2
    assert _get(fs, "d") == b"four"
    assert _get(fs, "c") == MISSING
    assert _get(fs, "d", size=2) == WRONG_SIZE


def test_a_failed_write_leaves_nothing_and_a_stored_object_is_kept(tmp_path, monkeypatch):
    fs = FileStorage(str(tmp_path))
    fs.batch_set(["k"], [b"old" * 100])
    assert fs.batch_set(["k"], [b"new" * 100]) == [True]   # content-addressed: kept, not rewritten
    real_pwritev = os.pwritev

    def failing_pwritev(fd, parts, offset):
        real_pwritev(fd, [parts[0][:10]], offset)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", failing_pwritev)
    with pytest.raises(StorageError, match="cannot write k2: No space left"):
        fs.batch_set_parts(["k2"], [[memoryview(b"new" * 50), memoryview(b"new" * 50)]])
    monkeypatch.undo()
    assert _get(fs, "k", 300) == b"old" * 100
    assert [os.path.basename(f) for f in _files(tmp_path)] == ["k"]  # no temp file, no k2


def test_short_writes_are_resumed_and_ready_comes_before_each_transfer(tmp_path, monkeypatch):
    fs = FileStorage(str(tmp_path))
    fs.batch_set(["held"], [b"x"])
    real_pwritev = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, parts, offset: real_pwritev(fd, [parts[0][:7]], offset))
    header, readied = bytearray(4), []

    def ready(i):
        readied.append(i)
        header[:] = b"HEAD"       # filled only now, as a checksum header would be

    parts = [[memoryview(b"p" * 10)], [memoryview(header), memoryview(b"payload" * 9)]]
    assert fs.batch_set_parts(["held", "new"], parts, ready=ready) == [True, True]
    monkeypatch.undo()
    assert readied == [1]        # the object already held is skipped, never readied
    assert _get(fs, "new", 100) == b"HEAD" + b"payload" * 9


def test_reads_land_in_order_and_an_abandoned_call_writes_nothing(tmp_path):
    fs = FileStorage(str(tmp_path))
    fs.batch_set(["a", "b"], [b"A" * 8, b"B" * 8])
    bufs = [[memoryview(bytearray(8))] for _ in range(3)]
    runs = []
    assert fs.batch_get_parts(["a", "gone", "b"], bufs, landed=lambda i, got: runs.append((i, got))) \
        == [8, MISSING, 8]
    assert runs == [(0, [8]), (1, [MISSING]), (2, [8])]
    gave_up = threading.Event()
    gave_up.set()
    fresh = [memoryview(bytearray(8))]
    assert run_abandonable(gave_up, lambda: fs.batch_get_parts(["a"], [fresh])) == [MISSING]
    assert bytes(fresh[0]) == bytes(8)


def test_readers_never_see_a_partial_object(tmp_path):
    fs = FileStorage(str(tmp_path))
    versions = [bytes([v]) * 200_000 for v in range(4)]
    fs.batch_set(["k"], [versions[0]])
    stop, seen, reads = threading.Event(), set(), [0]

    def reader():
        while not stop.is_set():
            seen.add(_get(fs, "k", 200_000))
            reads[0] += 1

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(40):
            os.unlink(tmp_path / "k" / "k")       # so that every write really writes
            fs.batch_set(["k"], [versions[i % 4]])
            before, deadline = reads[0], time.monotonic() + 5
            while reads[0] < before + 2 and time.monotonic() < deadline:   # a read that starts after this write
                time.sleep(0.001)
    finally:
        stop.set()
        t.join(timeout=30)
    assert seen <= set(versions) | {MISSING}
    assert seen - {MISSING}, "the reader never saw a whole object"


@pytest.mark.parametrize("key", ["../escape", "/etc/passwd", "a/../../b", "..", ".", "nul\0byte", "x" * 300, "é%"])
def test_hostile_keys_stay_inside_the_directory(tmp_path, key):
    root = tmp_path / "store"
    fs = FileStorage(str(root))
    assert fs.batch_set([key], [b"payload"]) == [True]
    assert _get(fs, key) == b"payload"
    assert all(f.startswith(str(root) + os.sep) for f in _files(tmp_path))
    name = object_name(key)
    assert "/" not in name and "\0" not in name and name not in (".", "..") and len(name) <= 200


def test_distinct_keys_get_distinct_names():
    keys = ["a/b", "a%2Fb", "a.b", "a%2Eb", "..", "%2E%2E"]
    assert len({object_name(k) for k in keys}) == len(keys)


def test_capacity_evicts_the_least_recently_written_and_a_read_changes_nothing(tmp_path):
    fs = FileStorage(str(tmp_path), capacity_bytes=10_000)
    for i in range(9):
        fs.batch_set([f"k{i}"], [bytes([i]) * 1000])
        os.utime(tmp_path / f"k{i}"[:2] / f"k{i}", (10 + i, 10 + i))   # k0 the oldest write, k8 the newest
    before = {f: os.stat(f).st_mtime_ns for f in _files(tmp_path)}
    for _ in range(3):
        assert _get(fs, "k0", 1000) == bytes([0]) * 1000
        assert fs.batch_get_parts(["k0"], [[memoryview(bytearray(1000))]]) == [1000]
    assert {f: os.stat(f).st_mtime_ns for f in _files(tmp_path)} == before   # reads left no trace
    for i in range(9, 15):
        fs.batch_set([f"k{i}"], [bytes([i]) * 1000])
    assert sum(os.path.getsize(f) for f in _files(tmp_path)) <= 10_000
    assert sorted(os.path.basename(f) for f in _files(tmp_path)) == sorted(f"k{i}" for i in range(6, 15))
    assert fs.batch_set(["huge"], [bytes(20_000)]) == [False]


def test_the_keys_an_eviction_removed_are_told_once_by_their_own_names(tmp_path):
    fs = FileStorage(str(tmp_path), capacity_bytes=3500)
    long = "x/" * 150                                  # its file is named by a digest: not named back
    keys = ["page/0 é", long, "k%2", "plain", "next", "last"]
    for age, key in enumerate(keys):
        fs.batch_set([key], [bytes(1000)])
        if age < 3:
            path = os.path.join(tmp_path, object_name(key)[:2], object_name(key))
            os.utime(path, (10 + age, 10 + age))       # the first three are the oldest writes, in order
    assert fs.evicted() == ["page/0 é", "k%2"]        # each of the last three writes evicts the oldest
    assert fs.batch_exists(["plain", "next", "last"]) == 3 and fs.batch_exists([long]) == 0
    assert fs.evicted() == []


def test_a_write_under_way_shows_only_a_dot_temp_file_beside_the_object(tmp_path, monkeypatch):
    fs = FileStorage(str(tmp_path))
    real_pwritev, halfway, go_on = os.pwritev, threading.Event(), threading.Event()

    def slow_pwritev(fd, parts, offset):
        done = real_pwritev(fd, [parts[0][:100]], offset)     # a short write, then a pause
        halfway.set()
        assert go_on.wait(30)
        return done

    monkeypatch.setattr(os, "pwritev", slow_pwritev)
    writer = threading.Thread(target=fs.batch_set, args=(["key"], [b"v" * 5000]))
    writer.start()
    try:
        assert halfway.wait(30)
        names = os.listdir(tmp_path / "ke")
        assert len(names) == 1 and names[0].startswith(".") and names[0].endswith(".tmp"), names
        assert os.path.getsize(tmp_path / "ke" / names[0]) == 100
        assert _get(fs, "key", 5000) == MISSING and fs.batch_exists(["key"]) == 0
    finally:
        go_on.set()
        writer.join(timeout=30)
    assert os.listdir(tmp_path / "ke") == ["key"] and _get(fs, "key", 5000) == b"v" * 5000


def test_temp_files_a_crash_left_are_never_read_or_counted_and_stale_ones_go(tmp_path):
    FileStorage(str(tmp_path)).batch_set(["k0"], [b"0" * 1000])
    fresh, stale = tmp_path / "k0" / ".123-deadbeef-0.tmp", tmp_path / "k0" / ".123-deadbeef-1.tmp"
    fresh.write_bytes(b"x" * 9000)                  # a writer that died mid-object, just now...
    stale.write_bytes(b"y" * 9000)
    os.utime(stale, (time.time() - 7200,) * 2)      # ...and one two hours ago
    fs = FileStorage(str(tmp_path), capacity_bytes=10_000)
    assert not stale.exists() and fresh.exists()
    assert _get(fs, "k0", 1000) == b"0" * 1000      # its directory's temp file is not the object
    for i in range(1, 10):                          # 10,000 bytes of objects: full, not over
        fs.batch_set([f"k{i}"], [b"%d" % i * 1000])
    assert fs.batch_exists([f"k{i}" for i in range(10)]) == 10 and fresh.exists()


def test_two_processes_share_one_directory(tmp_path):
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=4, page_size=4)
    code = f"""
import torch
from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.layout import KVLayout
from hicache_async.transfer.page_store import PageStore
from hicache_async.pools import HostPool
from hicache_async.storage import open_storage
layout = KVLayout(num_layers=2, kv_heads=2, head_dim=4, page_size=4)
host = HostPool(layout, 3)
host.tensor.copy_(torch.arange(host.tensor.numel(), dtype=torch.float32).view(host.tensor.shape))
store = PageStore(open_storage("file", path={str(tmp_path)!r}), layout, make_key_scheme("unified", layout))
assert store.backup(page_hashes(range(12), 4), host, [0, 1, 2]).ok == [True] * 3
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    host = HostPool(layout, 3)
    store = PageStore(FileStorage(str(tmp_path)), layout, make_key_scheme("unified", layout))
    assert store.prefetch(page_hashes(range(12), 4), host, [2, 1, 0]).pages == 3
    expected = torch.arange(host.tensor.numel(), dtype=torch.float32).view(host.tensor.shape)
    assert torch.equal(host.tensor, expected.flip(0))


def test_unreadable_directory_is_a_storage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StorageError, match="cannot create directory"):
        FileStorage(str(blocker / "sub"))


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(UsageError, match=r"'nope'.*file, memory, mooncake"):
        open_storage("nope")
