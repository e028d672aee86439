"""What the connector's start-up decides: the model's namespace (load format, the snapshot vLLM
loads), what it refuses in one line, and vLLM's load-failure policy. Configs are vLLM's own
(`EngineArgs`) where vLLM can build them here; stand-ins only for what it cannot (a hub
snapshot under `--download-dir`, parallel and speculative settings this machine cannot run)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hicache_vllm.model_identity import model_identity, refuse_unkeyable
from vllm.config import SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.structured_output import StructuredOutputManager

from hicache_async.errors import UsageError

BLOCK = 32


def engine_config(model, policy: str | None = None, **args):
    transfer = {"kv_connector": "HiCacheConnector", "kv_connector_module_path": "hicache_vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": {"storage": "none"}}
    if policy is not None:
        transfer["kv_load_failure_policy"] = policy
    return EngineArgs(model=str(model), skip_tokenizer_init=True, block_size=BLOCK, max_model_len=2048,
                      enforce_eager=True, kv_transfer_config=transfer, **args).create_engine_config()


@pytest.mark.parametrize("policy", [None, "fail", "recompute"])
def test_vllms_scheduler_recomputes_failed_loads_whatever_the_operator_left(llama, policy):
    """vLLM reads the policy in `Scheduler.__init__` just after building our connector: the
    real scheduler, built over our connector, recomputes."""
    cfg = engine_config(llama, policy)
    assert cfg.kv_transfer_config.kv_load_failure_policy == (policy or "fail")     # vLLM's default is fail
    cfg.cache_config.num_gpu_blocks = 16
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    scheduler = Scheduler(cfg, kv, StructuredOutputManager(cfg), block_size=BLOCK)
    assert type(scheduler.connector).__name__ == "HiCacheConnector"
    assert scheduler.recompute_kv_load_failures
    assert cfg.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_vllm_captures_piecewise_graphs_for_the_connector_it_resolves(llama):
    """Loads wait layer by layer beside attention: vLLM must not capture full graphs around
    them (it overrides `cudagraph_mode` for a connector that says so; on CPU it captures none)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = engine_config(llama)
    connector = KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
    assert connector.__name__ == "HiCacheConnector"
    assert connector.requires_piecewise_for_cudagraph(cfg.kv_transfer_config.kv_connector_extra_config)


def test_a_dummy_load_over_a_real_folder_is_another_model(llama):
    real, dummy = (model_identity(engine_config(llama, load_format=f), None) for f in ("auto", "dummy"))
    assert real != dummy and real.split("@")[0] == dummy.split("@")[0] == str(llama)


def stand_in(model: str, *, download_dir: str | None = None, load_format: str = "auto", spec=None, **parallel):
    """A VllmConfig's fields that start-up reads."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, model_weights="", revision=None, code_revision=None,
                                     hf_overrides={}, hf_config=SimpleNamespace(), dtype=torch.bfloat16,
                                     quantization=None, is_hybrid=False, is_attention_free=False),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        load_config=SimpleNamespace(load_format=load_format, download_dir=download_dir),
        parallel_config=SimpleNamespace(**{"decode_context_parallel_size": 1, "prefill_context_parallel_size": 1,
                                           **parallel}),
        speculative_config=spec)


def hub_snapshot(cache, repo: str, weights: bytes):
    """A Hugging Face cache holding one snapshot of `repo`, as `snapshot_download` leaves it."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(weights)
    return snapshot


def test_a_hub_model_is_fingerprinted_from_the_snapshot_under_download_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a = hub_snapshot(tmp_path / "a", "org/m", b"a" * 1000)
    hub_snapshot(tmp_path / "b", "org/m", b"b" * 1000)
    ident_a, ident_b = (model_identity(stand_in("org/m", download_dir=str(tmp_path / d)), None) for d in "ab")
    assert ident_a != ident_b and ident_a.startswith("org/m@")
    (a / "model.safetensors").write_bytes(b"c" * 1000)
    assert model_identity(stand_in("org/m", download_dir=str(tmp_path / "a")), None) not in (ident_a, ident_b)


def test_a_vouched_model_id_still_names_its_load_format(tmp_path):
    """An unreadable checkpoint the operator names (`model_id`): its settings still split the
    namespace, so dummy weights never share the real ones' pages."""
    missing = str(tmp_path / "nowhere")
    with pytest.raises(UsageError, match="model_id to vouch"):
        model_identity(stand_in(missing), None)
    real = model_identity(stand_in(missing), "org/m")
    dummy = model_identity(stand_in(missing, load_format="dummy"), "org/m")
    assert real.startswith("org/m@") and dummy.startswith("org/m@") and real != dummy


def speculative(method: str) -> SpeculativeConfig:
    """vLLM's own SpeculativeConfig, its method alone set: building one needs the draft's checkpoint."""
    spec = SpeculativeConfig.__new__(SpeculativeConfig)
    object.__setattr__(spec, "method", method)
    return spec


@pytest.mark.parametrize("config, named", [
    (dict(prefill_context_parallel_size=2), "prefill_context_parallel_size=2 is not supported"),
    (dict(decode_context_parallel_size=2), "decode_context_parallel_size=2 is not supported"),
    (dict(spec=speculative("eagle")), "speculative method 'eagle'"),
    (dict(spec=speculative("mtp")), "speculative method 'mtp'"),
    (dict(spec=speculative("draft_model")), "speculative method 'draft_model'"),
])
def test_what_cannot_be_keyed_or_counted_is_refused_in_one_line(tmp_path, config, named):
    with pytest.raises(UsageError) as err:
        refuse_unkeyable(stand_in(str(tmp_path), **config))
    assert named in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("method", ["ngram", "suffix", "medusa"])
def test_drafts_without_kv_of_their_own_are_accepted(tmp_path, method):
    refuse_unkeyable(stand_in(str(tmp_path), spec=speculative(method)))
