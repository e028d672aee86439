"""What decides a page's bytes is in the namespace: the checkpoint's bytes (a fine-tune saved
over the last one misses), SGLang's settings that change its KV, and the bytes of each startup
LoRA adapter, whose id in SGLang's page hashes names only its name and path. A model that
cannot be fingerprinted stops the start, unless the operator names it."""
import json
import logging

import pytest
from sglang.srt.lora.lora_registry import LoRARef
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str

from hicache_async.errors import UsageError
from tests.plugins.sglang import harness as h
from tests.plugins.sglang.test_keys_and_misses import HASHES, backend, seeded, slots

ROPE = json.dumps({"rope_scaling": {"rope_type": "linear", "factor": 2.0}})


def _reads(extra: dict) -> list[bool]:
    return backend(h.host_pool("mha", "page_first", pages=4), extra).batch_get_v1(HASHES, slots())


@pytest.fixture
def written(tmp_path, checkpoint):
    """A store holding 4 pages written while serving `checkpoint` with default settings."""
    extra = {"storage_path": str(tmp_path / "l3")}
    with h.published(model_path=str(checkpoint)):
        assert backend(seeded(h.host_pool("mha", "page_first", pages=4), 5), extra).batch_set_v1(
            HASHES, slots()) == [True] * 4
    return extra


@pytest.mark.parametrize("setting", [{"json_model_override_args": ROPE}, {"quantization": "fp8"},
                                     {"kv_cache_dtype": "fp8_e4m3"}, {"revision": "v2"}])
def test_a_setting_that_changes_the_kv_misses(written, checkpoint, setting):
    assert _reads(written) == [True] * 4
    with h.published(model_path=str(checkpoint), **setting):
        assert _reads(written) == [False] * 4


def test_a_checkpoint_saved_over_misses_and_its_fingerprint_is_logged(tmp_path, caplog):
    model = h.tiny_checkpoint(tmp_path / "ckpt")
    extra = {"storage_path": str(tmp_path / "l3")}
    with h.published(model_path=str(model)), caplog.at_level(logging.INFO, logger="hicache_sglang"):
        writer = backend(seeded(h.host_pool("mha", "page_first", pages=4), 6), extra)
        assert writer.batch_set_v1(HASHES, slots()) == [True] * 4
        h.tiny_checkpoint(model, weights=bytes(reversed(range(256))) * 64)    # same path, same size
        assert _reads(extra) == [False] * 4
    logged = [r.getMessage() for r in caplog.records if r.name == "hicache_sglang.identity"]
    assert writer.model_id.startswith("checkpoint-") and f"model namespace {writer.model_id} ({model}" in logged[0]


def test_a_model_that_cannot_be_fingerprinted_stops_the_start_unless_named(tmp_path):
    extra = {"storage_path": str(tmp_path / "l3")}
    with h.published(model_path="org/never-downloaded"):
        with pytest.raises(UsageError) as err:
            _reads(extra)
        assert "'org/never-downloaded' is not a local checkpoint" in str(err.value) and "model_id" in str(err.value)
        assert "\n" not in str(err.value)
        named = backend(h.host_pool("mha", "page_first", pages=4), {**extra, "model_id": "org/model@v1"})
        assert named.model_id == "org/model@v1" and named.batch_get_v1(HASHES, slots()) == [False] * 4


def _lora(path, name="support") -> dict:
    """SGLang's server args with one `--lora-paths` adapter, as its arg hook resolves them."""
    return dict(enable_lora=True, lora_paths=[LoRARef(lora_id=LoRARef.deterministic_id(name, str(path)),
                                                      lora_name=name, lora_path=str(path))])


def test_a_startup_adapter_retrained_in_place_misses(tmp_path, checkpoint):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"A" * 512)
    lora_id = _lora(adapter)["lora_paths"][0].lora_id
    tokens = list(range(h.PAGE))
    assert get_storage_hash_str(RadixKey(tokens, extra_key=lora_id), page_size=h.PAGE) != \
        get_storage_hash_str(RadixKey(tokens), page_size=h.PAGE)     # SGLang keys the adapter's id...
    extra = {"storage_path": str(tmp_path / "l3")}
    with h.published(model_path=str(checkpoint), **_lora(adapter)):
        writer = backend(seeded(h.host_pool("mha", "page_first", pages=4), 7), extra)
        assert writer.batch_set_v1(HASHES, slots()) == [True] * 4 and _reads(extra) == [True] * 4
        (adapter / "adapter_model.safetensors").write_bytes(b"B" * 512)
        assert _lora(adapter)["lora_paths"][0].lora_id == lora_id     # ...which retraining keeps
        assert _reads(extra) == [False] * 4


def test_an_adapter_that_cannot_be_read_stops_the_start(tmp_path, checkpoint):
    with h.published(model_path=str(checkpoint), **_lora(tmp_path / "missing", name="support")):
        with pytest.raises(UsageError) as err:
            _reads({"storage_path": str(tmp_path / "l3")})
    assert str(err.value).startswith("hicache-async: LoRA 'support': adapter ") and "\n" not in str(err.value)
