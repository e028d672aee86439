"""L3 bandwidth figures: PageStore over an adapter, against raw I/O of the same bytes in the same run.

The baseline moves exactly the page bytes with nothing else (no header, checksum or key
logic), in the same number of objects with the same durability (no fsync on either side),
so the ratio is what the object format and the facade cost. The store runs the way a rank
runs it: through the guard (breaker and deadline) and the tracing wrapper, tracing off.
Each figure is the best of a few interleaved repetitions, to keep a noisy 2-core machine
from deciding it; which side goes first alternates, and file writes start from a synced
page cache, so neither side pays for the other's dirty pages.
"""
from __future__ import annotations

import os
import tempfile

import torch

from ...errors import HiCacheError
from ...keys import make_key_scheme, page_hashes
from ...layout import KVLayout
from ...transfer.page_store import PageStore
from ...config import CacheConfig
from ...transfer.pool import HostPool, tensor_bytes
from ...storage.base import StorageAdapter
from ...storage.file import FileStorage
from ...storage.guarded import GuardedStorage
from ...storage.traced import TracedStorage
from ...parallel.topology import RankCoords
from .figure import figure, gbps, skipped

# 512 KiB pages: 32 layers x K,V x 16 tokens x 4 kv heads x 64 dims, fp16.
LAYOUT = KVLayout(num_layers=32, kv_heads=4, head_dim=64, page_size=16, dtype=torch.float16,
                  model_id="bench-512k")


def _workload(pages: int, reps: int):
    host = HostPool(LAYOUT, pages)
    host.tensor.copy_(torch.randn(host.tensor.shape, generator=torch.Generator().manual_seed(0)))
    batches = [page_hashes(range(r * pages * 16, (r + 1) * pages * 16), LAYOUT.page_size) for r in range(reps)]
    return host, HostPool(LAYOUT, pages), batches


def _store(adapter: StorageAdapter, name: str) -> PageStore:
    """A PageStore over `adapter` wrapped as a rank wraps it."""
    guarded = GuardedStorage(adapter, CacheConfig())
    return PageStore(TracedStorage(guarded, RankCoords(), name), LAYOUT, make_key_scheme("rank-suffix", LAYOUT))


def _compare(store: PageStore, host, reader, batches, raw_put, raw_get, pages: int,
             settle=lambda: None) -> tuple[float, ...]:
    """Best (store backup, raw put, store prefetch, raw get) GB/s; raw_put(r)/raw_get(r) move rep r.

    Raw and store runs alternate, first one then the other, so drift on a busy machine hits
    both sides alike; `settle()` runs untimed before each write.
    """
    slots, nbytes = list(range(pages)), pages * LAYOUT.page_bytes
    best = {"b_store": 0.0, "b_raw": 0.0, "p_store": 0.0, "p_raw": 0.0}

    def timed(name: str, run) -> None:
        best[name] = max(best[name], gbps(nbytes, run))

    def backup(r: int) -> None:
        results = []
        timed("b_store", lambda: results.append(store.backup(batches[r], host, slots)))
        if results[0].ok != [True] * pages or results[0].skipped:
            raise RuntimeError(f"bench backup did not write every page: {results[0]}")

    def prefetch(r: int) -> None:
        results = []
        timed("p_store", lambda: results.append(store.prefetch(batches[r], reader, slots)))
        if results[0].pages != pages or not torch.equal(reader.tensor, host.tensor):
            raise RuntimeError(f"bench prefetch read {results[0]} or wrong bytes")

    def raw_backup(r: int) -> None:
        timed("b_raw", lambda: raw_put(r))

    def raw_prefetch(r: int) -> None:
        timed("p_raw", lambda: raw_get(r))

    for sides, before in (((raw_backup, backup), settle), ((raw_prefetch, prefetch), lambda: None)):
        for r in range(len(batches)):
            for side in sides if r % 2 else sides[::-1]:   # who goes first alternates
                before()
                side(r)
    return best["b_store"], best["b_raw"], best["p_store"], best["p_raw"]


def _file_figures(pages: int, reps: int) -> list[dict]:
    host, reader, batches = _workload(pages, reps)
    with tempfile.TemporaryDirectory(prefix="hicache-bench-") as root:
        raw_dir = os.path.join(root, "raw")
        os.mkdir(raw_dir)
        store = _store(FileStorage(os.path.join(root, "store")), "file")
        views = [host.page_bytes(p) for p in range(pages)]
        into = [reader.page_bytes(p) for p in range(pages)]

        def raw_put(r: int) -> None:
            for p, view in enumerate(views):
                with open(os.path.join(raw_dir, f"{r}-{p}"), "wb") as f:
                    f.write(view)

        def raw_get(r: int) -> None:
            for p, view in enumerate(into):
                with open(os.path.join(raw_dir, f"{r}-{p}"), "rb") as f:
                    f.readinto(view)

        bs, br, ps, pr = _compare(store, host, reader, batches, raw_put, raw_get, pages, settle=os.sync)
    return [figure("file_backup_gbps", bs, "GB/s", "raw_file_write_gbps", br),
            figure("file_prefetch_gbps", ps, "GB/s", "raw_file_read_gbps", pr)]


def _mooncake_figures(pages: int, reps: int) -> list[dict]:
    from hicache_mooncake import MooncakeMaster, MooncakeStorage

    host, reader, batches = _workload(pages, reps)
    segment = 3 * reps * pages * (LAYOUT.page_bytes + 4096) + (64 << 20)   # room to spare: no eviction
    # No segment holder: the client mounts its own segment, so both sides take the local path.
    with MooncakeMaster(holder_bytes=0) as master:
        adapter = MooncakeStorage(master.address, master.metadata_url, segment_bytes=segment,
                                  buffer_bytes=32 << 20)
        try:
            store = _store(adapter, "mooncake")
            client = adapter._store  # the raw baseline drives the very same client
            size = LAYOUT.page_bytes
            ptrs = [host.page_ptr(p) for p in range(pages)]
            into = [reader.page_ptr(p) for p in range(pages)]
            for pool in (host, reader):
                adapter.register_memory(tensor_bytes(pool.tensor))

            def raw_put(r: int) -> None:
                codes = client.batch_put_from([f"raw-{r}-{p}" for p in range(pages)], ptrs, [size] * pages)
                if any(c < 0 for c in codes):
                    raise RuntimeError(f"raw batch_put_from failed with codes {set(codes)}")

            def raw_get(r: int) -> None:
                codes = client.batch_get_into([f"raw-{r}-{p}" for p in range(pages)], into, [size] * pages)
                if any(c != size for c in codes):
                    raise RuntimeError(f"raw batch_get_into failed with codes {set(codes)}")

            bs, br, ps, pr = _compare(store, host, reader, batches, raw_put, raw_get, pages)
        finally:
            adapter.close()
    return [figure("mooncake_backup_gbps", bs, "GB/s", "raw_batch_put_from_gbps", br),
            figure("mooncake_prefetch_gbps", ps, "GB/s", "raw_batch_get_into_gbps", pr)]


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
        figures += [skipped("mooncake_backup_gbps", "GB/s", "raw_batch_put_from_gbps", reason),
                    skipped("mooncake_prefetch_gbps", "GB/s", "raw_batch_get_into_gbps", reason)]
    return figures
