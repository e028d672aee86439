"""Fingerprints of what decides KV bytes beyond the tokens: a model checkpoint, an adapter.

A name or a path is not content: a fine-tune saved over the last one keeps both, and its KV
differs. So a checkpoint is named by its files: every file's name and size, a digest of every
small file (configs, tokenizer), and a digest of sampled bytes of every weight file (its head,
its tail and evenly spaced blocks between), which reads a few MiB however large the weights
are. An adapter is small, so it is named by a digest of all the bytes of the files the engine
loads from it (an optimizer state or a `.git` folder beside them names nothing). Neither names a
file's time or place, so copies of one checkpoint on a fleet's machines share; a change that
touches no sampled byte of a large file (and keeps its size) is not seen, which a fine-tune
that rewrites every tensor never is.
"""
from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

from .errors import UsageError

SMALL_FILE = 1 << 20        # files up to this size are digested whole
SAMPLE = 64 << 10           # bytes read at each sampled place of a larger file
SAMPLES = 16                # sampled places of a larger file, head and tail included
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".txt", ".py", ".tiktoken")


def checkpoint_fingerprint(path: str | os.PathLike, settings: dict | None = None) -> str:
    """16 hex digits naming a checkpoint folder (or file) and the `settings` that change what
    it computes (quantization, overrides, RoPE scaling, revision, KV-cache dtype); a bad path
    is a UsageError naming it."""
    root = _existing(path, f"model {str(path)!r} is not a local checkpoint")
    h = _files_digest(root, "checkpoint", _file_digest, _tree(
        root, lambda rel: rel.name.endswith(WEIGHT_SUFFIXES) and ".cache" not in rel.parts))
    h.update(_settings_bytes(settings))
    return h.hexdigest()[:16]


def settings_fingerprint(settings: dict) -> str:
    """16 hex digits naming `settings` alone: for a model whose checkpoint an operator vouches for."""
    return hashlib.sha256(b"hicache-async settings v1\0" + _settings_bytes(settings)).hexdigest()[:16]


def adapter_fingerprint(path: str | os.PathLike, names: list[str] | None = None) -> str:
    """16 hex digits naming an adapter by all the bytes of `names` (paths in its folder: the
    files the engine loads), or of every file in it; a missing path is a UsageError naming it."""
    root = _existing(path, f"adapter {str(path)!r} is not a local folder")
    files = _tree(root, lambda rel: True) if names is None else [(Path(n), root / n) for n in sorted(names)]
    return _files_digest(root, "adapter", _whole_digest, files).hexdigest()[:16]


def local_checkpoint(path: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """A local folder for `path`: itself, or the snapshot of a hub id the engine downloaded
    (it loads the weights before its KV cache is built); else `path`, for a fingerprint to
    refuse in one line."""
    if not path or os.path.exists(path):
        return path or ""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, revision=revision, local_files_only=True, cache_dir=cache_dir)
    except Exception:   # noqa: BLE001 - not in the local cache
        return path


def _existing(path: str | os.PathLike, missing: str) -> Path:
    root = Path(path)
    if not root.exists():
        raise UsageError(f"{missing}: its weights cannot be fingerprinted")
    return root


def _tree(root: Path, keep) -> list[tuple[Path, Path]]:
    """(name relative to `root`, path) of every kept file under a folder, or the file itself;
    a dangling link is no file."""
    found = ((p.relative_to(root), p) for p in root.rglob("*")) if root.is_dir() else [(Path(root.name), root)]
    return sorted((rel, p) for rel, p in found if keep(rel) and p.is_file())


def _settings_bytes(settings: dict | None) -> bytes:
    return json.dumps(settings or {}, sort_keys=True, default=str).encode()


def _files_digest(root: Path, kind: str, digest, files: list[tuple[Path, Path]]):
    """SHA-256 over every file's name (relative to `root`, so where the folder lies names
    nothing), size and `digest`."""
    if not files:
        raise UsageError(f"{kind} {str(root)!r} holds no weight or config files to fingerprint")
    h = hashlib.sha256(f"hicache-async {kind} v1\0".encode())
    for rel, f in files:
        st = f.stat()
        h.update(f"{rel.as_posix()}\0{st.st_size}\0".encode())
        h.update(digest(str(f), st.st_size, st.st_mtime_ns, st.st_ino))
    return h


@lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int, inode: int) -> bytes:
    """Whole for a small file, sampled for a large one; cached while the file is unchanged."""
    if size <= SMALL_FILE:
        return _whole_digest(path, size, mtime_ns, inode)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for i in range(SAMPLES):
            f.seek((size - SAMPLE) * i // (SAMPLES - 1))
            h.update(f.read(SAMPLE))
    return h.digest()


@lru_cache(maxsize=4096)
def _whole_digest(path: str, size: int, mtime_ns: int, inode: int) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.digest()
