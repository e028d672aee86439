"""Mooncake-format traces (FAST'25 release): reading them, and the prompts a replay builds.

One JSON object a line: `timestamp` (ms from the start), `input_length`, `output_length` and
`hash_ids`, one id per 512-token block of the prompt (the last block may be partial). Equal
ids stand for equal blocks, so each block's tokens are a pure function of (seed, id): shared
prefixes in the trace stay shared token prefixes here, and so shared cache pages.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
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
    return TraceRequest(lineno, float(ts), n_in, n_out, tuple(ids))


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
