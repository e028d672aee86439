"""What an operator sees: spans per transfer over real OTLP/HTTP, named by vLLM's request ids."""
from __future__ import annotations

from .engines import RESET, gen, run_engine


def test_every_transfer_is_a_span_with_vllms_request_ids(llama, prompts, tmp_path, otlp_receiver):
    extra = {"storage": "file", "storage_path": str(tmp_path / "l3")}
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    run_engine(llama, [gen(prompts["p"]), RESET, gen(prompts["p"])], extra, env=env)
    kinds = ("write", "load", "backup")
    otlp_receiver.wait_for(lambda r: all(r.spans_named(f"hicache.transfer.{k}") for k in kinds), timeout=20)
    for kind in kinds:
        for span in otlp_receiver.spans_named(f"hicache.transfer.{kind}"):
            assert span.attributes["vllm.request_ids"], kind
            assert span.attributes["hicache.pages"] > 0
    (load,) = otlp_receiver.spans_named("hicache.transfer.load")
    assert load.attributes["hicache.pages"] == 9 and load.resource["service.name"] == "hicache-vllm"
    assert otlp_receiver.spans_named("hicache.storage.batch_set")
