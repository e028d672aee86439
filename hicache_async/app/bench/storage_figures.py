"""L3 bandwidth figures: PageStore over an adapter, against raw I/O of the same bytes in the same run.

The baseline moves exactly the page bytes with nothing else (no header, checksum or key
logic), in the same number of objects with the same durability (no fsync on either side),
with the fewest calls that do it (file: `os.open`, one `readv`/`write`, `os.close`), so the
ratio is what the object format and the facade cost. The store runs the way a rank runs it:
through the guard (breaker and deadline) and the tracing wrapper, tracing off.

Each `*_xxh3_bound_gbps` figure is the raw calls plus one XXH3 pass over the same pages, placed
where it costs least (a file page hashed right beside its own read or write, while in cache; a
Mooncake batch hashed before its put or after its get, one call being all there is): the most a
store that verifies every byte can reach on this machine, beside the same baseline.

Each `*_sealed_*` figure is the same store sealed (`SealedStorage`: AES-256-GCM, the header as
associated data), beside the checksum-only store of the same run (the unsealed figure, itself
beside raw I/O).

Each figure is the best of a few repetitions, to keep a noisy 2-core machine from deciding
it; the sides take turns, each repetition starting from the next one. File writes start from
a synced page cache, so no side pays for another's dirty pages; the files written are
removed once read, so every repetition starts from the same page cache (on the reference VM, write throughput fell
3-4x as earlier repetitions' files piled up in it).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ...config import CacheConfig
from ...errors import HiCacheError
from ...keys import make_key_scheme, page_hashes
from ...layout import KVLayout
from ...pools import HostPool, tensor_bytes
from ...storage.base import StorageAdapter
from ...storage.file import FileStorage
from ...storage.guarded import GuardedStorage
from ...storage.sealed import SealedStorage
from ...storage.traced import TracedStorage
from ...topology import RankCoords
from ...transfer.objects import checksum
from ...transfer.page_store import PageStore
from .figure import figure, gbps, skipped

# 512 KiB pages: 32 layers x K,V x 16 tokens x 4 kv heads x 64 dims, fp16.
LAYOUT = KVLayout(num_layers=32, kv_heads=4, head_dim=64, page_size=16, dtype=torch.float16,
                  model_id="bench-512k")
Side = Callable[[int], None]   # moves repetition r's pages; raises if it moved the wrong ones


def _workload(pages: int, reps: int):
    host = HostPool(LAYOUT, pages)
    host.tensor.copy_(torch.randn(host.tensor.shape, generator=torch.Generator().manual_seed(0)))
    batches = [page_hashes(range(r * pages * 16, (r + 1) * pages * 16), LAYOUT.page_size) for r in range(reps)]
    return host, HostPool(LAYOUT, pages), batches


def _store(adapter: StorageAdapter, name: str, sealed: bool = False) -> PageStore:
    """A PageStore over `adapter` wrapped as a rank wraps it; sealed, under a random key and a
    namespace of its own (so it finds none of the checksum-only store's objects)."""
    layout = LAYOUT
    if sealed:
        adapter = SealedStorage(adapter, AESGCM(AESGCM.generate_key(256)))
        layout = dataclasses.replace(LAYOUT, model_id=f"{LAYOUT.model_id}-sealed")
    guarded = GuardedStorage(adapter, CacheConfig())
    return PageStore(TracedStorage(guarded, RankCoords(), name), layout, make_key_scheme("rank-suffix", layout))


def _store_sides(store: PageStore, host: HostPool, reader: HostPool, batches, pages: int) -> tuple[Side, Side]:
    """Backup and prefetch through `store`, each checked (untimed) to have moved every page right."""
    slots = list(range(pages))

    def backup(r: int) -> Callable[[], None]:
        result = store.backup(batches[r], host, slots)

        def check() -> None:
            if result.ok != [True] * pages or result.skipped:
                raise RuntimeError(f"bench backup did not write every page: {result}")
        return check

    def prefetch(r: int) -> Callable[[], None]:
        result = store.prefetch(batches[r], reader, slots)

        def check() -> None:
            if result.pages != pages or not torch.equal(reader.tensor, host.tensor):
                raise RuntimeError(f"bench prefetch read {result} or wrong bytes")
        return check
    return backup, prefetch


def _round(sides: dict[str, Side], r: int, nbytes: int, best: dict,
           settle: Callable[[], None] = lambda: None) -> None:
    """Repetition r of every side, the first one rotating with r; keeps each side's best GB/s.

    A side may return a check, run untimed right after it.
    """
    names = list(sides)
    for k in range(len(names)):
        name = names[(r + k) % len(names)]
        settle()
        checks = []
        best[name] = max(best.get(name, 0.0), gbps(nbytes, lambda: checks.append(sides[name](r))))
        if checks[0] is not None:
            checks[0]()


def _figures(kind: str, backup: dict, prefetch: dict, raw_put: str, raw_get: str) -> list[dict]:
    return [figure(f"{kind}_backup_gbps", backup["store"], "GB/s", raw_put, backup["raw"]),
            figure(f"{kind}_prefetch_gbps", prefetch["store"], "GB/s", raw_get, prefetch["raw"]),
            figure(f"{kind}_backup_xxh3_bound_gbps", backup["bound"], "GB/s", raw_put, backup["raw"]),
            figure(f"{kind}_prefetch_xxh3_bound_gbps", prefetch["bound"], "GB/s", raw_get, prefetch["raw"]),
            figure(f"{kind}_sealed_backup_gbps", backup["sealed"], "GB/s", f"{kind}_backup_gbps", backup["store"]),
            figure(f"{kind}_sealed_prefetch_gbps", prefetch["sealed"], "GB/s", f"{kind}_prefetch_gbps",
                   prefetch["store"])]


def _remove_files(root: str) -> None:
    """Every file under `root` removed (directories stay)."""
    for folder, _, files in os.walk(root):
        for name in files:
            os.unlink(os.path.join(folder, name))


def _file_figures(pages: int, reps: int) -> list[dict]:
    host, reader, batches = _workload(pages, reps)
    nbytes = pages * LAYOUT.page_bytes
    with tempfile.TemporaryDirectory(prefix="hicache-bench-") as root:
        raw_dir = os.path.join(root, "raw")
        os.mkdir(raw_dir)
        store_backup, store_prefetch = _store_sides(_store(FileStorage(os.path.join(root, "store")), "file"),
                                                    host, reader, batches, pages)
        sealed_backup, sealed_prefetch = _store_sides(
            _store(FileStorage(os.path.join(root, "sealed")), "file", sealed=True), host, reader, batches, pages)
        views = [host.page_bytes(p) for p in range(pages)]
        into = [reader.page_bytes(p) for p in range(pages)]

        def put(name: str, r: int, hashed: bool) -> None:
            for p, view in enumerate(views):
                fd = os.open(os.path.join(raw_dir, f"{name}{r}-{p}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    if os.write(fd, view) != view.nbytes:
                        raise RuntimeError(f"raw write of {name}{r}-{p} was short")
                finally:
                    os.close(fd)
                if hashed:
                    checksum(view)

        def get(name: str, r: int, hashed: bool) -> None:
            for p, view in enumerate(into):
                fd = os.open(os.path.join(raw_dir, f"{name}{r}-{p}"), os.O_RDONLY)
                try:
                    if os.readv(fd, [view]) != view.nbytes:
                        raise RuntimeError(f"raw read of {name}{r}-{p} was short")
                finally:
                    os.close(fd)
                if hashed:
                    checksum(view)

        backup, prefetch = {}, {}
        writes = {"store": store_backup, "raw": lambda r: put("raw", r, False),
                  "bound": lambda r: put("bound", r, True), "sealed": sealed_backup}
        reads = {"store": store_prefetch, "raw": lambda r: get("raw", r, False),
                 "bound": lambda r: get("bound", r, True), "sealed": sealed_prefetch}
        for r in range(reps):
            _round(writes, r, nbytes, backup, settle=os.sync)
            _round(reads, r, nbytes, prefetch)
            _remove_files(root)
    return _figures("file", backup, prefetch, "raw_file_write_gbps", "raw_file_read_gbps")


def _mooncake_figures(pages: int, reps: int) -> list[dict]:
    from hicache_mooncake import MooncakeMaster, MooncakeStorage

    host, reader, batches = _workload(pages, reps)
    nbytes, size = pages * LAYOUT.page_bytes, LAYOUT.page_bytes
    segment = 6 * reps * pages * (size + 4096) + (64 << 20)   # four sides' objects, room to spare: no eviction
    # No segment holder: the client mounts its own segment, so every side takes the local path.
    with MooncakeMaster(holder_bytes=0) as master:
        adapter = MooncakeStorage(master.address, master.metadata_url, segment_bytes=segment,
                                  buffer_bytes=32 << 20)
        try:
            store_backup, store_prefetch = _store_sides(_store(adapter, "mooncake"), host, reader, batches, pages)
            sealed_store = _store(adapter, "mooncake", sealed=True)
            sealed_backup, sealed_prefetch = _store_sides(sealed_store, host, reader, batches, pages)
            client = adapter._store  # the raw baseline drives the very same client
            ptrs = [host.page_ptr(p) for p in range(pages)]
            into = [reader.page_ptr(p) for p in range(pages)]
            for pool in (host, reader):
                adapter.register_memory(tensor_bytes(pool.tensor))

            def put(name: str, r: int, hashed: bool) -> None:
                for p in range(pages) if hashed else ():
                    checksum(host.page_bytes(p))
                codes = client.batch_put_from([f"{name}-{r}-{p}" for p in range(pages)], ptrs, [size] * pages)
                if any(c < 0 for c in codes):
                    raise RuntimeError(f"raw batch_put_from failed with codes {set(codes)}")

            def get(name: str, r: int, hashed: bool) -> None:
                codes = client.batch_get_into([f"{name}-{r}-{p}" for p in range(pages)], into, [size] * pages)
                if any(c != size for c in codes):
                    raise RuntimeError(f"raw batch_get_into failed with codes {set(codes)}")
                for p in range(pages) if hashed else ():
                    checksum(reader.page_bytes(p))

            backup, prefetch = {}, {}
            for r in range(reps):
                _round({"store": store_backup, "raw": lambda r: put("raw", r, False),
                        "bound": lambda r: put("bound", r, True), "sealed": sealed_backup}, r, nbytes, backup)
            for r in range(reps):
                _round({"store": store_prefetch, "raw": lambda r: get("raw", r, False),
                        "bound": lambda r: get("bound", r, True), "sealed": sealed_prefetch}, r, nbytes, prefetch)
        finally:
            adapter.close()
    return _figures("mooncake", backup, prefetch, "raw_batch_put_from_gbps", "raw_batch_get_into_gbps")


def storage_figures(quick: bool = False) -> list[dict]:
    """File and Mooncake backup/prefetch bandwidth beside raw I/O of the same pages.

    64 MiB per repetition (16 MiB when quick). Mooncake figures carry `skipped` and no
    values when the mooncake extra or its master is unavailable.
    """
    pages, reps = (32, 3) if quick else (128, 5)
    figures = _file_figures(pages, reps)
    try:
        figures += _mooncake_figures(pages, reps)
    except (ImportError, OSError, HiCacheError) as e:
        reason = f"mooncake unavailable: {e}"
        for op, raw in (("backup", "raw_batch_put_from_gbps"), ("prefetch", "raw_batch_get_into_gbps")):
            figures += [skipped(f"mooncake_{op}_gbps", "GB/s", raw, reason),
                        skipped(f"mooncake_{op}_xxh3_bound_gbps", "GB/s", raw, reason),
                        skipped(f"mooncake_sealed_{op}_gbps", "GB/s", f"mooncake_{op}_gbps", reason)]
    return figures
