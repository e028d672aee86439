"""A sealed store: every object authenticated and encrypted with AES-256-GCM.

KV is what the prompts said, and a store shared by several engines (or reachable by anyone on
its network) could be read, or fed bytes that then steer generation. So with a secret every
object is sealed: its header (the first of its parts) is associated data, authenticated but
left readable, and the rest is encrypted under a fresh random 12-byte nonce with a 16-byte tag,
stored as header | nonce | ciphertext | tag. An object that does not open, written without
the secret, under another one, or altered in any byte, is `FORGED`: a miss, never KV, and
never removed by the page store's healing, since the three look alike (removals pass through
to the backend only for objects that open but fail their checksum).

A wrapper, so every backend is sealed alike, third-party ones included. It runs inside the
caller's deadline (under `GuardedStorage`), sealing into and opening from staging that each
call owns until it returns (registered with the backend, so a zero-copy one stays so), in
backend calls of at most RUN_BYTES so a large batch needs no large buffer.
Random nonces are safe for about 2^32 objects per key (NIST SP 800-38D).
"""
from __future__ import annotations

import ctypes
import os
import stat
from collections.abc import Callable, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import UsageError
from .base import FORGED, MISSING, StorageAdapter, buffer_address, call_abandoned
from .staging import StagingPool
from .wrapping import WrappingStorage

SECRET_BYTES = 32               # least a secret file holds (random bytes)
NONCE_BYTES, TAG_BYTES = 12, 16
SEAL_BYTES = NONCE_BYTES + TAG_BYTES   # what sealing adds to an object
RUN_BYTES = 32 << 20            # most bytes one call to the backend moves: its staging's size
_KEY_INFO = b"hicache-async sealed store v1"


def load_key(path: str) -> AESGCM:
    """The AES-256-GCM key derived (HKDF-SHA256) from the secret file at `path`.

    A file that is missing, unreadable, shorter than SECRET_BYTES, or open to group or
    others is a UsageError naming the path, never the contents.
    """
    what = f"--storage-secret-file {path}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise UsageError(f"{what}: cannot read it: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{what}: not a regular file")
        if st.st_mode & 0o077:
            raise UsageError(f"{what} is open to group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                             f"chmod 600 it")
        secret = os.read(fd, 1 << 16)
    except OSError as e:
        raise UsageError(f"{what}: cannot read it: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(secret) < SECRET_BYTES:
        raise UsageError(f"{what} holds {len(secret)} bytes; a secret is at least {SECRET_BYTES} random bytes")
    return AESGCM(HKDF(hashes.SHA256(), 32, salt=None, info=_KEY_INFO).derive(secret))


def _split(parts: Sequence) -> tuple[list[memoryview], list[memoryview]]:
    """An object's associated data (its first part, when it has several) and its body."""
    views = [memoryview(p).cast("B") for p in parts]
    return (views[:1], views[1:]) if len(views) > 1 else ([], views)


def _slices(buf: memoryview, sizes: list[int]) -> list[memoryview]:
    out, at = [], 0
    for n in sizes:
        out.append(buf[at:at + n])
        at += n
    return out


class SealedStorage(WrappingStorage):
    def __init__(self, inner: StorageAdapter, key: AESGCM) -> None:
        super().__init__(inner)
        self._aead = key
        self._staging = StagingPool(inner.register_memory)

    def __repr__(self) -> str:
        return f"SealedStorage({self.inner!r})"   # the key never shows

    # -- sealing -----------------------------------------------------------------------------

    def _seal(self, parts: Sequence, out: memoryview) -> None:
        """`out` = associated data | nonce | ciphertext | tag for one object's parts."""
        aad, body = _split(parts)
        head = sum(p.nbytes for p in aad)
        if aad:
            out[:head] = aad[0]
        nonce = os.urandom(NONCE_BYTES)
        out[head:head + NONCE_BYTES] = nonce
        plain = body[0] if len(body) == 1 else b"".join(body)
        self._aead.encrypt_into(nonce, plain, out[:head], out[head + NONCE_BYTES:])

    def _open(self, parts: Sequence, sealed: memoryview, got: int) -> int:
        """Open one object read into `sealed` (`got`: the inner result) into the caller's parts;
        what batch_get_parts reports for it."""
        if got == MISSING or call_abandoned():     # abandoned: the caller's buffers are not ours
            return MISSING
        if got != sealed.nbytes:
            return FORGED
        aad, body = _split(parts)
        head = sum(p.nbytes for p in aad)
        plain = body[0] if len(body) == 1 else memoryview(bytearray(sealed.nbytes - head - SEAL_BYTES))
        try:
            self._aead.decrypt_into(sealed[head:head + NONCE_BYTES], sealed[head + NONCE_BYTES:],
                                    sealed[:head], plain)
        except InvalidTag:      # GCM has written the body before it checked the tag: wipe it
            ctypes.memset(buffer_address(plain), 0, plain.nbytes)
            return FORGED
        if aad:
            aad[0][:] = sealed[:head]
        at = 0
        for part in body if len(body) > 1 else ():
            part[:] = plain[at:at + part.nbytes]
            at += part.nbytes
        return sealed.nbytes - SEAL_BYTES

    # -- the adapter protocol ----------------------------------------------------------------

    def batch_set(self, keys: list[str], values: list) -> list[bool]:
        return self.batch_set_parts(keys, [[v] for v in values])

    def batch_set_parts(self, keys: list[str], parts: list[Sequence[memoryview]],
                        ready: Callable[[int], None] | None = None) -> list[bool]:
        """Each object is sealed when the backend asks for it (`ready`), after the caller's
        own `ready` made its header final, so what the backend skips is never sealed."""
        sizes = [sum(memoryview(p).nbytes for p in ps) + SEAL_BYTES for ps in parts]
        out: list[bool] = []
        for run in _runs(sizes):
            if call_abandoned():    # the caller has moved on: its pages may hold other data
                return out + [False] * (len(keys) - run.start)
            with self._staging.lease(sum(sizes[i] for i in run)) as buf:
                sealed = _slices(buf, sizes[run.start:run.stop])

                def seal(j: int, run: range = run, sealed: list = sealed) -> None:
                    if ready is not None:
                        ready(run.start + j)
                    self._seal(parts[run.start + j], sealed[j])

                out += self.inner.batch_set_parts(keys[run.start:run.stop], [[s] for s in sealed], ready=seal)
        return out

    def batch_get(self, keys: list[str], buffers: list[memoryview]) -> list[int]:
        """Objects up to each buffer's size, as the contract's batch_get reads them."""
        sizes = [memoryview(b).nbytes + SEAL_BYTES for b in buffers]
        with self._staging.lease(sum(sizes)) as buf:
            sealed = _slices(buf, sizes)
            got = self.inner.batch_get(keys, sealed)
            return [n if n == MISSING else FORGED if n < SEAL_BYTES else
                    self._open([memoryview(b).cast("B")[:n - SEAL_BYTES]], s[:n], n)
                    for b, s, n in zip(buffers, sealed, got)]

    def batch_get_parts(self, keys: list[str], parts: list[Sequence[memoryview]],
                        landed: Callable[[int, list[int]], None] | None = None) -> list[int]:
        """Each object is opened as the backend lands it, while still in cache."""
        sizes = [sum(memoryview(p).nbytes for p in ps) + SEAL_BYTES for ps in parts]
        out: list[int] = []

        def report(start: int, results: list[int]) -> None:
            out.extend(results)
            if landed is not None:
                landed(start, results)

        for run in _runs(sizes):
            if call_abandoned():    # the caller has moved on: its buffers are not ours to fill
                report(run.start, [MISSING] * (len(keys) - run.start))
                break
            with self._staging.lease(sum(sizes[i] for i in run)) as buf:
                sealed = _slices(buf, sizes[run.start:run.stop])

                def opened(start: int, results: list[int], run: range = run, sealed: list = sealed) -> None:
                    at = run.start + start
                    if at == len(out) and results:
                        report(at, [self._open(parts[at + j], sealed[start + j], n) for j, n in enumerate(results)])

                got = self.inner.batch_get_parts(keys[run.start:run.stop], [[s] for s in sealed], landed=opened)
                opened(len(out) - run.start, got[len(out) - run.start:])
        return out

def _runs(sizes: list[int]) -> list[range]:
    """Consecutive runs of objects of at most RUN_BYTES (one object at least), a backend call each."""
    runs, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        if acc and acc + n > RUN_BYTES:
            runs.append(range(start, i))
            start, acc = i, 0
        acc += n
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs
