"""vLLM's `kv_load_failure_policy`: our loads may fail by design, so vLLM must recompute them.

A planned load from a host slot that is not trustworthy when the step runs reports its blocks
as load errors (`get_block_ids_with_load_errors`) instead of serving them; under vLLM's default
`fail` each such request would end in an error. vLLM's scheduler reads the policy just after it
builds its connector (`Scheduler.__init__`), so the scheduler connector's start-up sets it.
"""
from __future__ import annotations

import structlog

log = structlog.get_logger(__name__)


def recompute_load_failures(kv_transfer_config) -> None:
    """Make vLLM recompute the blocks a load could not fill, whatever the operator left."""
    if kv_transfer_config.kv_load_failure_policy != "recompute":
        log.info("hicache: kv_load_failure_policy set to recompute: a failed load recomputes its blocks",
                 was=kv_transfer_config.kv_load_failure_policy)
        kv_transfer_config.kv_load_failure_policy = "recompute"
