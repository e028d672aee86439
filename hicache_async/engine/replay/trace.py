"""Mooncake-format traces (FAST'25 release): reading them, and the prompts a replay builds.

One JSON object a line: `timestamp` (ms from the start), `input_length`, `output_length` and
`hash_ids`, one id per 512-token block of the prompt (the last block may be partial), and an
optional `cache_salt` naming the request's tenant. Equal ids stand for equal blocks, so each
block's tokens are a pure function of (seed, id): shared prefixes in the trace stay shared
token prefixes here, and so shared cache pages.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import numpy as np

from ...errors import UsageError
from .splitmix import splitmix64

BLOCK_TOKENS = 512
VOCAB = 131_072          # token ids stay well inside the 4 bytes a page hash packs them in
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class TraceRequest:
    line: int                 # 1-based line in the trace file, for messages
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    cache_salt: str | None = None   # the tenant: no cached page is shared across salts


def read_trace(path: str, page_size: int, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests (all if None) in arrival order; any defect is a UsageError
    naming the file and the line."""
    if page_size <= 0 or BLOCK_TOKENS % page_size:
        raise UsageError(f"{path}:1: --page-size {page_size} does not divide the trace's "
                         f"{BLOCK_TOKENS}-token hash_ids blocks")
    out: list[TraceRequest] = []
    lineno = 0
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, text in enumerate(f, 1):
                if limit is not None and len(out) == limit:
                    break
                if text.strip():
                    out.append(_parse(path, lineno, text))
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UsageError(f"{path}:{max(lineno, 1)}: cannot read the trace: {reason}") from None
    if not out:
        raise UsageError(f"{path}:{max(lineno, 1)}: empty trace: no request in the file")
    out.sort(key=lambda r: r.timestamp_ms)     # stable: equal timestamps keep file order
    return out


def _parse(path: str, lineno: int, text: str) -> TraceRequest:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: expected a JSON object with {', '.join(FIELDS)}")
    missing = [name for name in FIELDS if name not in obj]
    if missing:
        raise UsageError(f"{where}: missing field {missing[0]!r}")
    ts, n_in, n_out, ids = (obj[name] for name in FIELDS)
    if not _number(ts) or ts < 0:
        raise UsageError(f"{where}: timestamp must be a number >= 0, got {ts!r}")
    if not _integer(n_in) or n_in < 1:
        raise UsageError(f"{where}: input_length must be an integer >= 1, got {n_in!r}")
    if not _integer(n_out) or n_out < 0:
        raise UsageError(f"{where}: output_length must be an integer >= 0, got {n_out!r}")
    if not isinstance(ids, list) or not all(_integer(i) and 0 <= i < 2**63 for i in ids):
        raise UsageError(f"{where}: hash_ids must be a list of integers in [0, 2**63)")
    blocks = math.ceil(n_in / BLOCK_TOKENS)
    if len(ids) != blocks:
        raise UsageError(f"{where}: {len(ids)} hash_ids do not cover input_length {n_in} "
                         f"(expected {blocks}, one per {BLOCK_TOKENS}-token block)")
    salt = obj.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise UsageError(f"{where}: cache_salt must be a non-empty string, got {salt!r}")
    return TraceRequest(lineno, float(ts), n_in, n_out, tuple(ids), salt)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def prompt_tokens(req: TraceRequest, seed: int = 0) -> np.ndarray:
    """The request's prompt (uint32): each block's 512 tokens mixed from (seed, block id,
    offset), truncated to input_length. Vectorised: one pass over the prompt."""
    ids = np.asarray(req.hash_ids, dtype=np.uint64)
    key = splitmix64(np.array([seed], dtype=np.uint64))
    x = ids[:, None] * np.uint64(BLOCK_TOKENS) + np.arange(BLOCK_TOKENS, dtype=np.uint64)
    tokens = splitmix64(x ^ key) % np.uint64(VOCAB)
    return tokens.reshape(-1)[: req.input_length].astype(np.uint32)


def block_prefixes(req: TraceRequest, seed: int = 0) -> np.ndarray:
    """A 64-bit name for each block's whole prefix: BLAKE2b chained over the tenant, the seed
    and the ids up to the block. Equal ids at the same place in a Mooncake trace are a shared
    prefix; chaining also tells apart equal ids after different prefixes, as tokens would.
    Nothing of the cache's own page hashing, so the replay's truths can judge it."""
    tenant = b"\0" if req.cache_salt is None else b"\1" + req.cache_salt.encode()
    link = hashlib.blake2b(tenant + seed.to_bytes(8, "little"), digest_size=8, person=b"replay-blocks").digest()
    out = np.empty(len(req.hash_ids), dtype=np.uint64)
    for i, block in enumerate(req.hash_ids):
        link = hashlib.blake2b(link + block.to_bytes(8, "little"), digest_size=8).digest()
        out[i] = int.from_bytes(link, "little")
    return out


def prompt_page_ids(req: TraceRequest, page_size: int, seed: int = 0,
                    prefixes: np.ndarray | None = None) -> np.ndarray:
    """A 64-bit name for each full page of the prompt, from (its block's prefix, its offset in
    the block): what the replay's KV and its oracle know a prompt page by."""
    prefixes = block_prefixes(req, seed) if prefixes is None else prefixes
    starts = np.arange(req.input_length // page_size, dtype=np.uint64) * np.uint64(page_size)
    blocks = (starts // np.uint64(BLOCK_TOKENS)).astype(np.intp)
    return splitmix64(prefixes[blocks] ^ splitmix64(starts % np.uint64(BLOCK_TOKENS)))


def output_page_id(prefixes: np.ndarray, input_length: int, page: int) -> int:
    """The name of page `page` of a request whose prompt ends inside or before it: its outputs
    are a function of the prompt, so (the prompt's last prefix, its length, the page) fix it."""
    length, place = splitmix64(np.array([[input_length | 1 << 63], [page]], dtype=np.uint64))
    return int(splitmix64(prefixes[-1:] ^ length ^ splitmix64(place))[0])   # arrays wrap without warnings
