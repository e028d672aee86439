"""`RequestKeys` and the fingerprints under it, one class under test with stand-ins for vLLM's
Request, LoRARequest and multimodal features (the real engine's runs are in test_request_keys)."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import structlog
import torch
from hicache_vllm import request_keys
from hicache_vllm.request_keys import RequestKeys

from hicache_async.fingerprint import SAMPLE, SAMPLES, adapter_fingerprint, checkpoint_fingerprint
from hicache_async.keys import page_hashes

PAGE = 4


@dataclass
class Req:
    all_token_ids: list[int]
    request_id: str = "r"
    cache_salt: str | None = None
    lora_request: object = None
    prompt_embeds: torch.Tensor | None = None
    mm_features: list = field(default_factory=list)
    _prompt_embeds_per_block_hashes: dict = field(default_factory=dict)    # vLLM's cache of them


def hashes(req: Req, keys: RequestKeys | None = None) -> list[str]:
    out: list[str] = []
    assert settled(keys or RequestKeys(PAGE), req, out)
    return out


def settled(keys: RequestKeys, req: Req, out: list[str]) -> bool:
    """`extend`'s answer once the adapter's digest has run (None till then: ask again)."""
    deadline = time.monotonic() + 10
    while (answer := keys.extend(req, out)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return answer


def write_adapter(folder, weights: bytes = b"A" * 100):
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def lora(folder, lora_id: int = 1, inplace: bool = False):
    return SimpleNamespace(lora_name="x", lora_int_id=lora_id, lora_path=str(folder), load_inplace=inplace)


def image(identifier: str, offset: int, length: int = 3):
    return SimpleNamespace(modality="image", identifier=identifier,
                           mm_position=SimpleNamespace(offset=offset, length=length))


def test_plain_requests_keep_the_plain_chain():
    assert hashes(Req(list(range(10)))) == page_hashes(range(8), PAGE)
    assert hashes(Req(list(range(10)), cache_salt="t")) == page_hashes(range(8), PAGE, salt="t")


def test_multimodal_items_key_the_pages_they_fall_in():
    tokens = [7] * 12
    plain = hashes(Req(tokens))
    a = hashes(Req(tokens, mm_features=[image("cat", 5)]))
    b = hashes(Req(tokens, mm_features=[image("dog", 5)]))
    moved = hashes(Req(tokens, mm_features=[image("cat", 4)]))
    assert a[0] == plain[0] and a[1] != plain[1]           # page 0 holds no image
    assert a[1] != b[1] and a[1] != moved[1]                 # another image, or the same one elsewhere
    assert a == hashes(Req(tokens, mm_features=[image("cat", 5)]))


def test_prompt_embeddings_key_each_page_by_its_slice():
    e = torch.randn(8, 16, dtype=torch.bfloat16)
    other = e.clone()
    other[5] += 1
    a, b = hashes(Req([0] * 8, prompt_embeds=e)), hashes(Req([0] * 8, prompt_embeds=other))
    assert a[0] == b[0] and a[1] != b[1]
    assert a[0] != hashes(Req([0] * 8))[0]


def test_an_adapter_is_named_by_its_bytes_once_per_id(tmp_path):
    folder = write_adapter(tmp_path / "lora")
    keys = RequestKeys(PAGE)
    first = hashes(Req(list(range(8)), lora_request=lora(folder)), keys)
    assert first != hashes(Req(list(range(8))))
    (folder / "adapter_model.safetensors").write_bytes(b"B" * 100)   # saved over, same name and size
    assert hashes(Req(list(range(8)), lora_request=lora(folder)), keys) == first   # vLLM keeps id 1's weights
    assert hashes(Req(list(range(8)), lora_request=lora(folder, inplace=True)), keys) != first


def test_an_adapter_is_named_by_the_files_vllm_loads_only(tmp_path):
    """vLLM reads adapter_config.json and the first of adapter_model.safetensors/.bin/.pt: an
    optimizer state, a .git folder, another weights format or a dangling link beside them
    names nothing; a byte of what it loads does."""
    folder = write_adapter(tmp_path / "lora")
    key = hashes(Req(list(range(8)), lora_request=lora(folder)))
    (folder / "optimizer.pt").write_bytes(os.urandom(1 << 20))
    (folder / ".git").mkdir()
    (folder / ".git" / "index").write_bytes(b"x")
    (folder / "adapter_model.bin").write_bytes(b"other format")
    (folder / "gone").symlink_to(tmp_path / "nowhere")
    assert hashes(Req(list(range(8)), lora_request=lora(folder))) == key
    (folder / "adapter_config.json").write_text('{"r": 16}')
    assert hashes(Req(list(range(8)), lora_request=lora(folder))) != key


def test_an_adapter_digest_runs_off_the_scheduler_thread_once(tmp_path, monkeypatch):
    """The first requests of an adapter are asked to come back (None) until its one digest,
    on a thread of its own, is done; then they are keyed."""
    release, calls = threading.Event(), []

    def slow(path, names):
        calls.append(threading.current_thread())
        release.wait(10)
        return "d1"

    monkeypatch.setattr(request_keys, "adapter_fingerprint", slow)
    folder, keys = write_adapter(tmp_path / "lora"), RequestKeys(PAGE)
    a, b = Req(list(range(8)), "a", lora_request=lora(folder)), Req(list(range(8)), "b", lora_request=lora(folder))
    out_a, out_b = [], []
    assert keys.extend(a, out_a) is None and keys.extend(b, out_b) is None and out_a == out_b == []
    release.set()
    assert settled(keys, a, out_a) and settled(keys, b, out_b)
    assert out_a == out_b == page_hashes(range(8), PAGE, adapter="d1")
    assert len(calls) == 1 and calls[0] is not threading.current_thread()


def test_a_keying_error_leaves_the_request_unkeyed_without_raising(tmp_path, monkeypatch):
    """A file gone between listing and reading (OSError) or anything else raised while keying:
    False (no hit, no save), one warning naming the request; the next request tries again."""
    calls = []

    def vanished(path, names):
        calls.append(path)
        raise FileNotFoundError(f"{path}/adapter_model.safetensors")

    monkeypatch.setattr(request_keys, "adapter_fingerprint", vanished)
    folder, keys = write_adapter(tmp_path / "lora"), RequestKeys(PAGE)
    out: list[str] = []
    with structlog.testing.capture_logs() as logged:
        assert settled(keys, Req(list(range(8)), "a", lora_request=lora(folder)), out) is False
        assert settled(keys, Req(list(range(8)), "b", lora_request=lora(folder)), []) is False
        assert keys.extend(Req([2**40] * 8, "c"), []) is False      # a token id no key can hold
    assert out == [] and len(calls) == 2
    warned = [e for e in logged if e["event"] == "hicache: request not cached"]
    assert [e["request"] for e in warned] == ["a", "b", "c"]
    assert "FileNotFoundError" in warned[0]["reason"] and "adapter_model.safetensors" in warned[0]["reason"]


def test_an_adapter_that_cannot_be_read_leaves_the_request_unkeyed(tmp_path):
    gone = lora(tmp_path / "gone", lora_id=2)
    assert settled(RequestKeys(PAGE), Req(list(range(8)), lora_request=gone), []) is False


def test_a_checkpoint_fingerprint_follows_its_bytes_and_settings_not_its_path(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * 20_000)
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(b)
    assert checkpoint_fingerprint(a, {"quantization": "fp8"}) != checkpoint_fingerprint(a)
    weights = bytearray((b / "model.safetensors").read_bytes())
    weights[:4] = b"\xff\xff\xff\xff"
    (b / "model.safetensors").write_bytes(bytes(weights))
    assert checkpoint_fingerprint(a) != checkpoint_fingerprint(b)


def test_an_adapter_is_read_whole_where_a_checkpoint_is_sampled(tmp_path):
    """A byte between a large file's samples: the checkpoint's blind spot (documented), never
    an adapter's."""
    a, b = tmp_path / "a", tmp_path / "b"
    size = 5_000_000
    between = (size - SAMPLE) // (SAMPLES - 1) + SAMPLE + 1000      # past sample 1's end, before sample 2
    for folder, byte in ((a, 0), (b, 1)):
        folder.mkdir()
        weights = bytearray(size)
        weights[between] = byte
        (folder / "model.safetensors").write_bytes(bytes(weights))
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(b)
    assert adapter_fingerprint(a) != adapter_fingerprint(b)


def test_a_checkpoint_in_a_cache_folder_is_fingerprinted_by_its_own_files(tmp_path):
    """A hub snapshot lies under ~/.cache: only `.cache` folders inside the checkpoint are skipped."""
    snapshot = tmp_path / ".cache" / "hub" / "snapshot"
    (snapshot / ".cache").mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / ".cache" / "lock.json").write_text("{}")
    fingerprint = checkpoint_fingerprint(snapshot)
    (snapshot / ".cache" / "lock.json").write_text('{"changed": 1}')
    assert checkpoint_fingerprint(snapshot) == fingerprint
