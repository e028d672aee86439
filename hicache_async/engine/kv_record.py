"""The reference run's KV, recorded per page so cached runs on any topology can check theirs.

A page is named by its token prefix (`prefix_names`): a causal model's KV at a page is a
function of every token up to the page's end, and the name owes nothing to the cache's page
keys, so no bug in those can make a wrong page look right.

On disk: `<path>.json` (page names in row order, the page shape, the dtype) and `<path>.bin`
(raw rows of [layers, planes, page_size, kv_heads, dim] for the whole model). Read back with
a memory map: raw bytes with a header we wrote, never unpickled.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from ..layout import KVLayout
from ..request import Request
from .kv_witness import KVWitness


def prefix_names(tokens: list[int], page_size: int, pages: int | None = None) -> list[str]:
    """A name for each of the first `pages` full pages of `tokens` (all if None): a BLAKE2b
    digest of the whole prefix up to the page's end, as 8-byte token ids."""
    n = len(tokens) // page_size if pages is None else pages
    prefix = hashlib.blake2b(digest_size=16, person=b"ref-kv-prefix")
    out = []
    for i in range(n):
        prefix.update(np.asarray(tokens[i * page_size:(i + 1) * page_size], dtype="<i8").tobytes())
        out.append(prefix.copy().hexdigest())
    return out


class KVRecorder(KVWitness):
    """Keeps the KV of every full prompt page the reference computes, first time seen."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[str, torch.Tensor] = {}

    def after_prefill(self, req: Request, kv: torch.Tensor) -> None:
        ps = self.page_size
        for i, h in enumerate(prefix_names(req.prompt, ps)):
            if h not in self.pages:
                self.pages[h] = kv[:, req.pages[i]].clone()

    def save(self, path: str) -> None:
        rows = list(self.pages.values())
        shape = list(rows[0].shape) if rows else []
        with open(path + ".json", "w") as f:
            json.dump({"names": list(self.pages), "page_shape": shape, "dtype": "float32"}, f)
        if rows:
            torch.stack(rows).to(torch.float32).numpy().tofile(path + ".bin")


class RecordedKV:
    """The recorded truth, sliced to one rank's layers and heads: a `kv_witness.Truth`."""

    def __init__(self, path: str, layout: KVLayout) -> None:
        with open(path + ".json") as f:
            meta = json.load(f)
        self.page_size = layout.page_size
        self.row = {h: i for i, h in enumerate(meta["names"])}
        shape = (len(self.row), *meta["page_shape"])
        data = np.memmap(path + ".bin", dtype=np.float32, mode="r", shape=shape) if self.row else None
        self._data = data
        self._layers = slice(layout.first_layer, layout.first_layer + layout.num_layers)
        self._heads = slice(layout.first_head, layout.first_head + layout.kv_heads)

    def page_ids(self, req: Request, pages: int) -> list[str]:
        return prefix_names(req.prompt, self.page_size, pages)

    def expected(self, page_ids: list[str], layer: int) -> torch.Tensor:
        """Recorded KV of these pages for local layer `layer`: [pages, planes, ps, heads, dim]."""
        rows = [self.row[h] for h in page_ids]
        global_layer = self._layers.start + layer
        return torch.from_numpy(np.ascontiguousarray(self._data[rows, global_layer, :, :, self._heads]))
