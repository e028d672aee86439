"""`HiCacheConnector`: hicache-async as a vLLM KV connector (vLLM's v1 connector API).

vLLM owns the device KV and decides in one scheduler, so the split is vLLM's own: the
scheduler instance keeps the index of the host tier and decides (`scheduler.py`); each worker
instance holds its rank's host pool and moves its bytes (`worker.py`); each under vLLM's hybrid
KV cache manager once a KV cache group (`groups.py`, `kv_groups.py`). Everything under them
is the product's core: host pool, page store with verified objects, storage adapters, sealing,
guarded calls and spans. vLLM's own types and calls stay in this module.
"""
from __future__ import annotations

from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorWorkerMetadata,
                                                               SupportsHMA)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hicache_async.storage.sealed import load_key
from hicache_async.topology import RankCoords

from . import settings as config
from .groups import GroupedScheduler, GroupedWorker, GroupPlans, GroupReports
from .kv_groups import groups_of
from .kv_layout import layer_index, ordered_layers, version_family, worker_layout
from .load_failures import recompute_load_failures
from .model_identity import model_identity, refuse_unkeyable
from .plan import JobReports, StepPlan
from .prom import HiCachePromMetrics
from .scheduler import SchedulerSide
from .stats import Deltas, HiCacheStats
from .worker import WorkerSide

# vLLM's types, given at its edge: it passes a plan through to the workers and aggregates their
# reports; the scheduler and worker sides never import vLLM (a GPU machine may have none)
KVConnectorMetadata.register(StepPlan)
KVConnectorWorkerMetadata.register(JobReports)
KVConnectorMetadata.register(GroupPlans)
KVConnectorWorkerMetadata.register(GroupReports)


class HiCacheConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = config.parse(vllm_config.kv_transfer_config.kv_connector_extra_config)
        if self.settings.storage_secret_file:
            load_key(self.settings.storage_secret_file)     # a bad secret file stops start-up here
        parallel = vllm_config.parallel_config
        refuse_unkeyable(vllm_config)
        self.model_id = model_identity(vllm_config, self.settings.model_id)
        self.page_size = vllm_config.cache_config.block_size
        self.groups = groups_of(kv_cache_config, self.page_size, parallel.pipeline_parallel_size)
        self._deltas = Deltas()
        self.scheduler: GroupedScheduler | None = None
        self.worker: GroupedWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            recompute_load_failures(vllm_config.kv_transfer_config)     # read by vLLM's Scheduler after this
            workers = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
            self.scheduler = GroupedScheduler([
                SchedulerSide(self.settings, self.page_size, workers, self.model_id, group,
                              page_bytes=_page_bytes(kv_cache_config)) for group in self.groups])

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        cfg = self._vllm_config
        tp, pp = get_tp_group(), get_pp_group()
        coords = RankCoords(tp_rank=tp.rank_in_group, tp_size=tp.world_size,
                            pp_rank=pp.rank_in_group, pp_size=pp.world_size)
        model = cfg.model_config
        hybrid = len(self.groups) > 1
        sides, layers = [], {}
        for g, group in enumerate(self.groups):     # a plain model: one group, every layer
            mine = {n: kv_caches[n] for n in (group.layers if hybrid else kv_caches) if n in kv_caches}
            names = ordered_layers(mine) if not hybrid else sorted(mine, key=layer_index)
            layout = worker_layout(     # a state block is one state, not a page of tokens
                mine, num_blocks=self._kv_cache_config.num_blocks,
                block_size=1 if group.kind == "state" else self.page_size, coords=coords,
                total_layers=model.get_total_num_hidden_layers(), total_kv_heads=model.get_total_num_kv_heads(),
                mla=model.use_mla, model_id=self.model_id, group=group if hybrid else None,
                engine=f"{version_family(vllm.__version__)}|{_backend(cfg, names[0])}"
                       f"|cache_dtype={cfg.cache_config.cache_dtype}|layout={self._kv_cache_config.kv_cache_layout}")
            layers.update({name: (g, i) for i, name in enumerate(names)})
            sides.append(WorkerSide(self.settings, layout, coords, [kv_caches[n] for n in names]))
        self.worker = GroupedWorker(sides, layers, frozenset(g for g, group in enumerate(self.groups)
                                                             if group.kind == "state"))

    def bind_connector_metadata(self, connector_metadata) -> None:
        """Before every forward pass (or step without one): the worker times the pass from here
        and starts the plan's L3 reads beside it."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            self.worker.begin(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_layer(layer_name)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks a load could not fill from a trustworthy slot: vLLM recomputes them."""
        return self.worker.load_errors() if self.worker is not None else set()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """Head-major blocks (LBHNC): a block of a layer is then one run a head, so a step's copies
        are one gather or scatter a layer (`BlockCopies`); a token-major layout (NHD) would be a
        run a token and head, refused at start-up. MLA's one latent is one run in any layout."""
        model = vllm_config.model_config
        return None if model is None or model.use_mla else "LBHNC"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Loads run layer by layer beside attention (`wait_for_layer_load`); a full CUDA graph
        would replay attention without them, so vLLM captures piecewise graphs (said once at
        start-up by the worker)."""
        return True

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """Saves run once per step, after the forward pass (`wait_for_save`): a block's bytes
        are final only when every token of its page has been written."""

    def wait_for_save(self) -> None:
        """Issues the step's saves and returns: they land on events the worker reports."""
        self.worker.finish(self._get_connector_metadata())

    def handle_preemptions(self, kv_connector_metadata) -> None:
        self.worker.preempted(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose saves landed: vLLM frees the blocks it kept for them."""
        return self.worker.finished_sending(self._get_connector_metadata()) or None, None

    def build_connector_worker_meta(self):
        return self.worker.reports() if self.worker is not None else None

    def get_kv_connector_stats(self):
        if self.worker is not None:
            return self._deltas.take(self.worker.totals())
        return self._deltas.take(dict(self.scheduler.counts), self.scheduler.observed())

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None):
        return HiCacheStats(data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """Our metrics on vLLM's `/metrics`, built in its front end (`prom.py`)."""
        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.allocated(request, num_external_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        if not num_external_tokens:
            return {}
        st = self.scheduler.requests.get(request.request_id)
        from_l3 = st.from_l3 if st is not None else 0
        split = {CacheHitSource.HOST: num_external_tokens - from_l3, CacheHitSource.DISK: from_l3}
        return {k: v for k, v in split.items() if v}

    def build_connector_meta(self, scheduler_output):
        state = scheduler_output.kv_connector_block_state     # vLLM clears it before the workers see the plan
        return self.scheduler.build(scheduler_output.num_scheduled_tokens, self._kv_cache_manager.get_block_ids,
                                    scheduler_output.preempted_req_ids or (),
                                    state.boundary_state_offloads if state is not None else None)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.first_tokens()
        self.scheduler.reported(connector_output.kv_connector_worker_meta)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """True keeps the request's blocks until its saves landed (`get_finished`)."""
        keep, params = self.scheduler.finished(request)
        return keep, params or None

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """vLLM's call under its hybrid KV cache manager: every group's blocks at once."""
        return self.request_finished(request, block_ids[0])

    def take_events(self):
        return self.scheduler.events.take()


def _page_bytes(kv_cache_config) -> int:
    """A block's KV bytes over every layer (the prior of an L3 read's time a page); 1 MiB
    where vLLM gave no KV cache config."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups) or 1 << 20


def _backend(vllm_config, layer_name: str) -> str:
    """The attention backend's name: its kernels decide the bytes of a block."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    backend = getattr(layer, "attn_backend", None) or getattr(layer, "get_attn_backend", lambda: None)()
    return backend.get_name() if backend is not None else "unknown"
