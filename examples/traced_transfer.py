"""Copy a few KV pages from the device pool (L1) to the host pool (L2) under a traced step.

Send the spans to Jaeger (see tracing/README.md):
    OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4318 python examples/traced_transfer.py
or write them to a file that Jaeger's UI can open offline:
    python examples/traced_transfer.py --trace-file /tmp/transfer.json
"""
from __future__ import annotations

import argparse
import time
import uuid

import structlog
import torch

from hicache_async.layout import KVLayout
from hicache_async.parallel.topology import RankCoords
from hicache_async.telemetry.sdk import setup_telemetry
from hicache_async.telemetry.spans import CacheMetrics, finish_transfer, request_link, start_transfer, step_span
from hicache_async.transfer.pool import DevicePool, HostPool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace-file", help="also write the spans as OTLP JSON to this path")
    args = parser.parse_args()

    coords, run_id = RankCoords(), uuid.uuid4().hex[:8]
    telemetry = setup_telemetry(service_name="hicache-example", coords=coords, run_id=run_id,
                                trace_file=args.trace_file)
    log = structlog.get_logger("traced_transfer")
    metrics = CacheMetrics()
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=8, page_size=4)
    device, host = DevicePool(layout, num_pages=8), HostPool(layout, num_pages=8)
    device.tensor.normal_()
    src, dst = device.alloc.alloc(4), host.alloc.alloc(4)

    with step_span(run_id, step=0, coords=coords):
        # One transfer serves two requests that share this prefix: link it to both.
        nbytes = len(src) * layout.page_bytes
        span = start_transfer("write", pages=len(src), nbytes=nbytes, coords=coords,
                              links=[request_link(run_id, 1), request_link(run_id, 2)])
        started = time.perf_counter()
        host.tensor[dst] = device.tensor[:, src].transpose(0, 1)  # layer-major -> page-major
        finish_transfer(span)
        metrics.transfer("write", nbytes, time.perf_counter() - started)
        log.info("pages written to host", pages=len(src))
    assert torch.equal(host.tensor[dst[0], 1], device.tensor[1, src[0]])
    telemetry.shutdown()
    log.info("done", run_id=run_id, trace_file=args.trace_file)


if __name__ == "__main__":
    main()
