"""`RequestKeys` and the fingerprints under it, one class under test with stand-ins for vLLM's
Request, LoRARequest and multimodal features (the real engine's runs are in test_request_keys)."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
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
    assert (keys or RequestKeys(PAGE)).extend(req, out)
    return out


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
    folder = tmp_path / "lora"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"A" * 100)
    lora = SimpleNamespace(lora_name="x", lora_int_id=1, lora_path=str(folder), load_inplace=False)
    keys = RequestKeys(PAGE)
    first = hashes(Req(list(range(8)), lora_request=lora), keys)
    assert first != hashes(Req(list(range(8))))
    (folder / "adapter_model.safetensors").write_bytes(b"B" * 100)   # saved over, same name and size
    assert hashes(Req(list(range(8)), lora_request=lora), keys) == first   # vLLM keeps id 1's weights
    reloaded = SimpleNamespace(**{**vars(lora), "load_inplace": True})
    assert hashes(Req(list(range(8)), lora_request=reloaded), keys) != first


def test_an_adapter_that_cannot_be_read_leaves_the_request_unkeyed(tmp_path):
    lora = SimpleNamespace(lora_name="x", lora_int_id=2, lora_path=str(tmp_path / "gone"), load_inplace=False)
    assert not RequestKeys(PAGE).extend(Req(list(range(8)), lora_request=lora), [])


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
