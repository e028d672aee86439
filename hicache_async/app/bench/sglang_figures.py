"""SGLang figures: our backend (file store, every object checksummed and verified) against
SGLang's own `file` backend (`HiCacheFile`, raw tensor files, nothing verified), on the same
pages of one page-first host buffer in the same run.

Each side is timed the way SGLang's controller drives it: ours through `batch_set_v1` /
`batch_get_v1` (host slots, no copies by the caller), `HiCacheFile` through the controller's
generic path (one `get_data_page` copy per page, then `batch_set`; a dummy page per key, then
`batch_get` and `set_from_flat_data_page`), in batches of SGLang's 128 pages at most. The host
buffer is a stand-in with SGLang's page-first geometry (its host pool classes import model
code that a CPU machine without torchvision cannot load).
"""
from __future__ import annotations

import tempfile
from types import SimpleNamespace

import torch

from .figure import figure, gbps, skipped

LAYERS, HEADS, DIM, PAGE = 32, 4, 64, 16   # 512 KiB pages of fp16, as the storage figures
BATCH = 128


def _pool(pages: int, seed: int) -> SimpleNamespace:
    """SGLang's MHA page_first host buffer (2, tokens, layers, heads, dim) and the attributes read of it."""
    kv = torch.randn((2, pages * PAGE, LAYERS, HEADS, DIM), generator=torch.Generator().manual_seed(seed))
    return SimpleNamespace(kv_buffer=kv.to(torch.float16), layout="page_first", page_size=PAGE, layer_num=LAYERS,
                           head_num=HEADS, head_dim=DIM, v_head_dim=DIM, start_layer=0)


def _config(extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="bench-512k", extra_config=extra)


def _theirs_set(backend, pool, keys, slots):
    pages = [pool.kv_buffer[:, s:s + PAGE].flatten() for s in slots[::PAGE].tolist()]   # get_data_page
    return backend.batch_set(keys, pages)


def _theirs_get(backend, pool, keys, slots):
    dummy = [torch.empty(2 * LAYERS * PAGE * HEADS * DIM, dtype=torch.float16) for _ in keys]
    got = backend.batch_get(keys, dummy)
    for s, page in zip(slots[::PAGE].tolist(), got):        # set_from_flat_data_page
        pool.kv_buffer[:, s:s + PAGE] = page.reshape(2, PAGE, LAYERS, HEADS, DIM)
    return all(page is not None for page in got)


def sglang_figures(quick: bool = False) -> list[dict]:
    names = ("sglang_batch_set_v1_gbps", "sglang_batch_get_v1_gbps")
    try:
        from hicache_sglang import HiCacheAsyncStorage
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    except ImportError as exc:
        return [skipped(n, "GB/s", "sglang_file_" + n.split("_", 1)[1], f"sglang not importable: {exc}")
                for n in names]
    pages, reps = (128, 2) if quick else (256, 4)
    nbytes = pages * 2 * LAYERS * PAGE * HEADS * DIM * 2
    best = {}
    with tempfile.TemporaryDirectory(prefix="hicache-sglang-bench-") as root:
        for r in range(reps):
            keys = [f"{r:08x}{i:056x}" for i in range(pages)]
            slots = torch.arange(pages * PAGE)
            ours, mine = HiCacheAsyncStorage(_config({"storage_path": f"{root}/ours{r}"})), _pool(pages, r)
            ours.register_mem_pool_host(mine)
            theirs, src = HiCacheFile(_config({}), file_path=f"{root}/theirs{r}"), _pool(pages, r)
            dst, want = _pool(pages, r + 100), src.kv_buffer.clone()
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
                    raise RuntimeError(f"sglang bench: {name} failed")
            if not (torch.equal(mine.kv_buffer, want) and torch.equal(dst.kv_buffer, want)):
                raise RuntimeError("sglang bench: a side read other bytes than were written")
            ours.close()
    return [figure(names[0], best["ours_set"], "GB/s", "sglang_file_batch_set_gbps", best["theirs_set"]),
            figure(names[1], best["ours_get"], "GB/s", "sglang_file_batch_get_gbps", best["theirs_get"])]
