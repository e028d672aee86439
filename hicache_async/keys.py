"""Storage keys: content hashes of token pages, and the schemes that turn them into object names.

A key must say what the stored bytes are, or two ranks (or two models) collide in shared
storage. Two schemes: `rank-suffix` (the anchor's: one object per page per rank, suffixed
with the rank's coordinates) and `unified` (topology-free: the key names the layers and
heads it holds, so writers and readers with different TP/PP share objects).
"""
from __future__ import annotations

import hashlib
import operator
import sys
from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from . import faults
from .errors import UsageError
from .layout import KVLayout
from .topology import RankCoords


def page_hashes(token_ids: Iterable[int], page_size: int, prior: str | None = None, *,
                salt: str | None = None, adapter: str | None = None,
                extras: Sequence[bytes] | None = None) -> list[str]:
    """Chained SHA-256 hex digest of each full page; a partial trailing page gets none.

    Each digest covers the previous page's digest bytes (or `prior`'s) and the page's token
    ids as 4-byte little-endian unsigned ints, so a page's key fixes its whole prefix.
    A tenant's `salt` (vLLM's `cache_salt`) stands in for the previous digest of the first
    page, so every page of two salts differs and one salt shares as before; a `prior` already
    carries its chain's salt. An `adapter` (a digest of LoRA weights) joins the salt at the
    chain's start, for the same reason. `extras[i]`, when given and not empty, is hashed after
    page i's tokens: what else decides that page's KV (its slice of prompt embeddings, the
    multimodal items in it). Never Python's `hash()`: it is salted per process and would
    miss across processes.
    """
    if (salt is not None or adapter is not None) and prior is not None:
        raise ValueError("pass a salt or adapter, or a prior, not both: the prior already carries its chain's start")
    if prior is None:
        return [d.hex() for d in page_digests(token_ids, page_size, chain_start(salt, adapter), extras)]
    try:
        prev = bytes.fromhex(prior)
    except ValueError:
        raise ValueError(f"prior must be a hex digest, got {prior!r}") from None
    return [d.hex() for d in page_digests(token_ids, page_size, prev, extras)]


def chain_start(salt: str | None, adapter: str | None = None) -> bytes:
    """What a chain starts from: the salt's digest, and the adapter's folded in after it."""
    start = salt_digest(salt)
    if adapter is None:
        return start
    if not isinstance(adapter, str) or not adapter:
        raise ValueError(f"adapter must be a non-empty digest string, got {adapter!r}")
    return hashlib.sha256(b"hicache-async adapter\0" + start + adapter.encode()).digest()


def salt_digest(salt: str | None) -> bytes:
    """What a chain starts from: nothing for no salt, else a digest of the salt."""
    if salt is None:
        return b""
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return hashlib.sha256(b"hicache-async cache_salt\0" + salt.encode()).digest()


def tenant_digest(salt: str | None) -> bytes:
    """The 8 bytes a stored object's header names its tenant by; all zeros for no salt."""
    return salt_digest(salt)[:8] if salt is not None else bytes(8)


def page_digests(token_ids: Iterable[int] | np.ndarray, page_size: int, prior: bytes = b"",
                 extras: Sequence[bytes] | None = None) -> list[bytes]:
    """`page_hashes` as raw digest bytes, for callers that chain or index them by the million."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    data = _packed(token_ids)
    step = page_size * 4
    unchained = faults.injected() == "unchained-hash"
    out, prev = [], prior
    for i, start in enumerate(range(0, len(data) - step + 1, step)):
        extra = extras[i] if extras is not None and i < len(extras) else b""
        prev = hashlib.sha256((b"" if unchained else prev) + data[start:start + step] + extra).digest()
        out.append(prev)
    return out


def _packed(token_ids: Iterable[int] | np.ndarray) -> bytes:
    """Token ids as 4-byte little-endian unsigned ints, packed in one C loop for all pages."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype.kind == "u" and token_ids.dtype.itemsize <= 4:
        return token_ids.astype("<u4", copy=False).tobytes()
    tokens = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError):
        raise ValueError(f"token id {_bad_token(tokens)!r} does not fit in 4 unsigned bytes") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _bad_token(tokens: list) -> object:
    for t in tokens:
        try:
            if 0 <= operator.index(t) < 2**32:
                continue
        except TypeError:
            pass
        return t


@dataclass(frozen=True)
class ObjectSpec:
    """One stored object: its key and the global layers and kv heads its payload holds."""

    key: str
    layers: range
    heads: range


class KeyScheme(ABC):
    """Maps a page hash to the objects this rank reads (and, if `writes`, writes) for it."""

    writes: bool      # False where another TP rank writes identical bytes (MLA, kv head replicas)
    cp_shared: bool   # True when every CP rank names a page by the same keys

    @abstractmethod
    def objects(self, page_hash: str) -> list[ObjectSpec]:
        """The objects of one page held by this rank, in a fixed order."""


def _local_layers(layout: KVLayout) -> range:
    return range(layout.first_layer, layout.first_layer + layout.num_layers)


def _local_heads(layout: KVLayout) -> range:
    return range(layout.first_head, layout.first_head + layout.kv_heads)


def _head_replicas(layout: KVLayout, coords: RankCoords) -> int:
    """Consecutive TP ranks holding this rank's heads: 1 when TP splits the kv heads,
    tp/kv_heads when it replicates each (GQA at a TP above the heads), every rank for MLA.
    Only the first of them writes: the others hold identical bytes."""
    return max(1, coords.tp_size * layout.kv_heads // layout.total_kv_heads)


class RankSuffixKeys(KeyScheme):
    """One object per page with all of this rank's layers and heads, named by rank.

    A rank's share depends on the size of each split as much as on its place in it (tp rank 0
    of 1 holds every head, of 2 half of them), so each part is `{rank}of{size}`; otherwise
    topologies sharing one storage overwrite, or rather skip, each other's objects.
    MHA/GQA: `_tp{r}of{n}` always (also at tp=1, so a default config still gives a valid key),
    `_cp{r}of{n}` when cp > 1. MLA: the latent is replicated across TP and CP ranks, whatever
    their number, so the key carries neither and only tp rank 0 writes; CP ranks then share
    keys and may split the writing. `_pp{r}of{n}` whenever pp > 1, since stages hold different
    layers of one page. A TP above the kv heads replicates each head over a group of ranks:
    the group is named by its place among the groups (tp4 ranks 2 and 3 of 2 heads are
    `_tp1of2`, the key and bytes of tp2 rank 1), and only its first rank writes.
    """

    def __init__(self, layout: KVLayout, coords: RankCoords = RankCoords()) -> None:
        self.layout = layout
        mla = layout.attention == "mla"
        r = _head_replicas(layout, coords)
        suffix = "" if mla else f"_tp{coords.tp_rank // r}of{coords.tp_size // r}"
        if coords.pp_size > 1:
            suffix += f"_pp{coords.pp_rank}of{coords.pp_size}"
        if coords.cp_size > 1 and not mla:
            suffix += f"_cp{coords.cp_rank}of{coords.cp_size}"
        self._suffix = f"_{layout.namespace()}{suffix}"
        self.writes = coords.tp_rank % r == 0
        self.cp_shared = mla or coords.cp_size == 1
        self._layers, self._heads = _local_layers(layout), _local_heads(layout)

    def objects(self, page_hash: str) -> list[ObjectSpec]:
        return [ObjectSpec(page_hash + self._suffix, self._layers, self._heads)]


class UnifiedKeys(KeyScheme):
    """Topology-free keys: one object per global layer and per group of `head_group` heads.

    `{page_hash}_{namespace}_L{first}-{last}[_H{group}]`. Because objects are canonical, a
    TP2 writer's objects are exactly the union of TP4 readers' (when `head_group` divides
    every rank's heads) and a PP2 writer's the union of a PP1 reader's. The namespace folds
    in `head_group`, so different groupings miss instead of misreading. MLA: no `_H`, and
    only tp rank 0 writes (every TP rank holds the same latent); likewise only the first
    replica of a kv head replicated over TP ranks writes.
    """

    def __init__(self, layout: KVLayout, coords: RankCoords = RankCoords(), head_group: int = 1) -> None:
        mla = layout.attention == "mla"
        if head_group < 1:
            raise UsageError(f"head_group must be >= 1, got {head_group}")
        if not mla and (layout.first_head % head_group or layout.kv_heads % head_group):
            raise UsageError(f"head_group {head_group} does not divide this rank's kv heads "
                             f"{layout.first_head}..{layout.last_head}")
        group = "mla" if mla else str(head_group)
        self._ns = hashlib.sha256(f"{layout.namespace()}|hg={group}".encode()).hexdigest()[:16]
        self.writes = coords.tp_rank % _head_replicas(layout, coords) == 0
        self.cp_shared = True
        self._parts = []  # (suffix, layers, heads) per object of a page
        for layer in _local_layers(layout):
            if mla:
                self._parts.append((f"_L{layer}-{layer}", range(layer, layer + 1), _local_heads(layout)))
                continue
            for h in range(layout.first_head, layout.last_head + 1, head_group):
                self._parts.append((f"_L{layer}-{layer}_H{h // head_group}", range(layer, layer + 1),
                                    range(h, h + head_group)))

    def objects(self, page_hash: str) -> list[ObjectSpec]:
        prefix = f"{page_hash}_{self._ns}"
        return [ObjectSpec(prefix + suffix, layers, heads) for suffix, layers, heads in self._parts]


def make_key_scheme(name: str, layout: KVLayout, coords: RankCoords = RankCoords(),
                    head_group: int = 1) -> KeyScheme:
    """The scheme behind `--key-scheme`."""
    if name == "rank-suffix":
        return RankSuffixKeys(layout, coords)
    if name == "unified":
        return UnifiedKeys(layout, coords, head_group)
    raise UsageError(f"unknown key scheme {name!r}: expected rank-suffix or unified")
