"""SGLang's bench group (`hicache-async bench --only sglang`, by the `hicache_async.bench` entry
point): our backend (file store, every object checksummed and verified) against
SGLang's own `file` backend (`HiCacheFile`, raw tensor files, nothing verified), on the same
pages of one page-first host buffer in the same run.

Each side is timed the way SGLang's controller drives it: ours through `batch_set_v1` /
`batch_get_v1` (host slots, no copies by the caller), `HiCacheFile` through the controller's
generic path (one `get_data_page` copy per page, then `batch_set`; a dummy page per key, then
`batch_get` and `set_from_flat_data_page`), in batches of SGLang's 128 pages at most. The host
buffer is a stand-in with SGLang's geometry in each MHA layout measured (its host pool classes
import model code that a CPU machine without torchvision cannot load), attached as SGLang's MHA
pool (`attach_host_pool`, skipping only the check of its class), under a named model (no
checkpoint to fingerprint): `page_first`, whose pages are a K and a V run in memory, stored in
that order (the store is built for the pool, `page_order`) and read and written in place, and
`layer_first` and `page_first_direct`, whose pages are a K and a V run a layer, in place too.
"""
from __future__ import annotations

import importlib.util
import tempfile
from types import SimpleNamespace

import torch

from hicache_async.app.bench.figure import figure, gbps, skipped
from hicache_async.errors import EngineMissing

LAYERS, HEADS, DIM, PAGE = 32, 4, 64, 16   # 512 KiB pages of fp16, as the storage figures
BATCH = 128
LAYOUTS = {   # SGLang's MHA host buffer shape for n pages, and the page at token slot s (get_data_page's view)
    "page_first": (lambda n: (2, n * PAGE, LAYERS, HEADS, DIM), lambda kv, s: kv[:, s:s + PAGE]),
    "layer_first": (lambda n: (2, LAYERS, n * PAGE, HEADS, DIM), lambda kv, s: kv[:, :, s:s + PAGE]),
    "page_first_direct": (lambda n: (2, n, LAYERS, PAGE, HEADS, DIM), lambda kv, s: kv[:, s // PAGE]),
}


def _pool(layout: str, pages: int, seed: int) -> SimpleNamespace:
    """SGLang's MHA host buffer in `layout` and the attributes read of it."""
    kv = torch.randn(LAYOUTS[layout][0](pages), generator=torch.Generator().manual_seed(seed))
    return SimpleNamespace(kv_buffer=kv.to(torch.float16), layout=layout, page_size=PAGE, layer_num=LAYERS,
                           head_num=HEADS, head_dim=DIM, v_head_dim=DIM, start_layer=0)


def _config(extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="bench-512k", extra_config=extra)


def _theirs_set(backend, pool, keys, slots):
    page = LAYOUTS[pool.layout][1]
    return backend.batch_set(keys, [page(pool.kv_buffer, s).flatten() for s in slots[::PAGE].tolist()])


def _theirs_get(backend, pool, keys, slots):
    dummy = [torch.empty(2 * LAYERS * PAGE * HEADS * DIM, dtype=torch.float16) for _ in keys]
    got = backend.batch_get(keys, dummy)
    for s, flat in zip(slots[::PAGE].tolist(), got):        # set_from_flat_data_page
        page = LAYOUTS[pool.layout][1](pool.kv_buffer, s)
        page.copy_(flat.view(page.shape))
    return all(flat is not None for flat in got)


def sglang_figures(quick: bool = False) -> list[dict]:
    """Set and get figures for each layout; page_first's under the plain names."""
    if importlib.util.find_spec("sglang") is None:
        raise EngineMissing("SGLang is not installed: pip install 'hicache-async[sglang]'")
    out = []
    for layout in LAYOUTS:
        tag = "" if layout == "page_first" else layout + "_"
        out += _figures(layout, (f"sglang_{tag}batch_set_v1_gbps", f"sglang_{tag}batch_get_v1_gbps"),
                        (f"sglang_file_{tag}batch_set_gbps", f"sglang_file_{tag}batch_get_gbps"), quick)
    return out


def _figures(layout: str, names: tuple[str, str], baselines: tuple[str, str], quick: bool) -> list[dict]:
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile

        from .storage import HiCacheAsyncStorage
    except ImportError as exc:
        return [skipped(n, "GB/s", b, f"sglang not importable: {exc}") for n, b in zip(names, baselines)]
    pages, reps = (128, 2) if quick else (256, 4)
    nbytes = pages * 2 * LAYERS * PAGE * HEADS * DIM * 2
    best = {}
    with tempfile.TemporaryDirectory(prefix="hicache-sglang-bench-") as root:
        for r in range(reps):
            keys = [f"{r:08x}{i:056x}" for i in range(pages)]
            slots = torch.arange(pages * PAGE)
            ours = HiCacheAsyncStorage(_config({"storage_path": f"{root}/ours{r}", "model_id": "bench-512k"}))
            mine = _pool(layout, pages, r)
            ours.attach_host_pool(mine, "mha")
            theirs, src = HiCacheFile(_config({}), file_path=f"{root}/theirs{r}"), _pool(layout, pages, r)
            dst, want = _pool(layout, pages, r + 100), src.kv_buffer.clone()
            cut = [(keys[b:b + BATCH], slots[b * PAGE:(b + BATCH) * PAGE]) for b in range(0, pages, BATCH)]
            sides = {
                "ours_set": lambda: all(ok for k, s in cut for ok in ours.batch_set_v1(k, s)),
                "theirs_set": lambda: all(_theirs_set(theirs, src, k, s) for k, s in cut),
                "ours_get": lambda: all(ok for k, s in cut for ok in ours.batch_get_v1(k, s)),
                "theirs_get": lambda: all(_theirs_get(theirs, dst, k, s) for k, s in cut),
            }
            order = ["ours_set", "theirs_set", "ours_get", "theirs_get"]
            if r % 2:
                order = ["theirs_set", "ours_set", "theirs_get", "ours_get"]
            for name in order:
                if name == "ours_get":
                    mine.kv_buffer.zero_()
                done = []
                best[name] = max(best.get(name, 0.0), gbps(nbytes, lambda: done.append(sides[name]())))
                if not done[0]:
                    raise RuntimeError(f"sglang bench: {layout} {name} failed")
            if not (torch.equal(mine.kv_buffer, want) and torch.equal(dst.kv_buffer, want)):
                raise RuntimeError(f"sglang bench: {layout}: a side read other bytes than were written")
            ours.close()
    return [figure(names[0], best["ours_set"], "GB/s", baselines[0], best["theirs_set"]),
            figure(names[1], best["ours_get"], "GB/s", baselines[1], best["theirs_get"])]
