"""``KvferryConnector``: vLLM's ``KVConnectorBase_V1`` over a kvferry node (vLLM 0.26,
0.33, 0.34; what differs between them is found from the installed vLLM by
:mod:`kvferry.vllm.compat`).

This module imports vLLM; the logic lives in :mod:`kvferry.vllm.scheduler` and
:mod:`kvferry.vllm.worker`, which do not. Enable it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": "127.0.0.1:7200"}}'
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from . import compat
from .config import ConfigError, KvferryConfig, parse_extra_config
from .kvcache import cross_layer_views
from .metadata import StepMetadata
from .namespace import model_namespace
from .scheduler import SchedulerSide
from .stats import COUNTERS, merge, reduce_summary
from .worker import WorkerSide

try:  # vLLM 0.33+: where an external hit came from (host memory or a peer node)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # vLLM 0.26
    CacheHitSource = None  # type: ignore[assignment,misc]

try:  # vLLM 0.33+: transfer results with failed receives per request
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM 0.26: get_finished and get_block_ids_with_load_errors only
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

#: What the installed vLLM offers (see :mod:`kvferry.vllm.compat`).
API = compat.probe()

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "KvferryConnector",
    "KvferryConnectorMetadata",
    "KvferryConnectorStats",
    "KvferryPromMetrics",
]

log = logging.getLogger("kvferry.vllm")


def _kv_cache_access(kv_transfer_config: Any) -> Any:
    """What vLLM 0.34's ``kv_cache_access`` is told (:mod:`kvferry.vllm.vmm`): EXPORTS_FD
    where the driver can export the extensible (VMM) KV cache's memory as fds for the node
    to map, else LEGACY_IPC (CUDA IPC handles; vLLM then switches the extensible cache off,
    and :mod:`kvferry.vllm.vmm` logs why), or what ``kv_cache_access`` in the extra config
    says."""
    from vllm.config.kv_transfer import KVCacheAccess

    from . import vmm

    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    return vmm.as_flags(vmm.supported_access(extra), KVCacheAccess)


@dataclass
class KvferryConnectorMetadata(StepMetadata, KVConnectorMetadata):
    """:class:`StepMetadata` as vLLM's connector metadata."""


@dataclass
class KvferryConnectorStats(KVConnectorStats):
    """The connector's counters (:data:`kvferry.vllm.stats.COUNTERS`) for one interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvferryConnectorStats":
        if other is not None and other.data:
            self.data = merge(self.data, other.data)
        return self

    def reduce(self) -> Dict[str, Any]:
        return reduce_summary(self.data)

    def is_empty(self) -> bool:
        return not self.data


LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class KvferryPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvferry_<counter>_total`` per counter, ``vllm:kvferry_load_duration_seconds``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: Dict[str, Dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(
                name=f"vllm:kvferry_{name}", documentation=doc, labelnames=labelnames
            )
            self._counters[name] = {
                idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        hist = self._histogram_cls(
            name="vllm:kvferry_load_duration_seconds",
            documentation="Duration of kvferry loads into vLLM's KV, per rank.",
            labelnames=labelnames,
            buckets=LOAD_BUCKETS,
        )
        self._hist = {idx: hist.labels(*v) for idx, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and engine_idx in per_engine and value:
                per_engine[engine_idx].inc(value)
        hist = self._hist.get(engine_idx)
        if hist is not None:
            for s in transfer_stats_data.get("load_seconds_samples", ()):
                hist.observe(s)


def _early_loads(cfg: KvferryConfig, async_scheduling: bool, tp: int, pp: int) -> bool:
    """Whether the scheduler starts synchronous loads itself (load_start "scheduler"): only
    where no kernel of an earlier step can still touch the blocks it allocates (vLLM
    schedules synchronously, one pipeline stage) and one rank loads (its board slot is
    rank 0's)."""
    if cfg.load_start != "scheduler":
        return False
    why = ("vLLM schedules asynchronously" if async_scheduling
           else f"TP {tp}" if tp > 1 else f"{pp} pipeline stages" if pp > 1 else None)
    if why:
        log.warning('kvferry: load_start "scheduler" needs synchronous scheduling, TP 1 and '
                    "one pipeline stage (here: %s); loads start on the worker", why)
        return False
    return True


def _served_model(vllm_config: "VllmConfig") -> str:
    """The first served model name (as vLLM's own metrics name the model), else the
    model as given (a Hugging Face id or a path)."""
    mc = vllm_config.model_config
    name = getattr(mc, "served_model_name", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name or mc.model)


def _kv_dtype(vllm_config: "VllmConfig") -> str:
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).replace("torch.", "")


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group)
    except Exception:  # noqa: BLE001 - not initialised (tests, a single process)
        return 0


def _backend_name(vllm_config: "VllmConfig") -> str:
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        return ",".join(b.get_name() for b in get_current_attn_backends(vllm_config))
    except Exception:  # noqa: BLE001 - only used in messages
        return ""


def check_supported(vllm_config: "VllmConfig", kv_cache_config: Optional["KVCacheConfig"]) -> None:
    """Refuses, at engine start, what the connector cannot serve correctly."""
    pc = vllm_config.parallel_config
    if getattr(pc, "pipeline_parallel_size", 1) > 1:
        raise ConfigError(
            "kvferry: pipeline parallelism is not supported (each stage holds other layers); "
            "use tensor parallelism"
        )
    if getattr(pc, "decode_context_parallel_size", 1) > 1:
        raise ConfigError("kvferry: decode context parallelism is not supported")
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) > 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        raise ConfigError(
            f"kvferry: the model has {len(groups)} KV cache groups ({kinds}); kvferry serves "
            "models with one attention group (recurrent and sliding-window groups are not "
            "supported)"
        )
    for g in groups:
        spec = type(g.kv_cache_spec).__name__
        if "Mamba" in spec or "Recurrent" in spec:
            raise ConfigError(f"kvferry: KV cache group {spec} (recurrent state) is not supported")


def _per_layer_why(vllm_config: Any, api: Any) -> str:
    """Why vLLM handed per-layer KV tensors although ``kv_layout = "cross_layer"`` asked for
    cross-layer blocks (loads then copy each layer of each block on its own)."""
    head = (
        'kvferry: kv_layout = "cross_layer" was asked for, but vLLM registered one KV tensor '
        "per layer, so each load copies every layer of every block on its own"
    )
    if api.cross_layer == "register" and bool(getattr(vllm_config, "use_v2_model_runner", False)):
        # vLLM 0.26: Model Runner V2 (its default for dense models where Triton is present)
        # registers per-layer tensors only; the V1 runner allocates cross-layer blocks.
        return (
            f"{head}: vLLM's Model Runner V2 (its default for this model) does not offer "
            "cross-layer KV; start vLLM with VLLM_USE_V2_MODEL_RUNNER=0 to get it"
        )
    return (
        f"{head}: the attention backend does not lay blocks outermost (vLLM fell back to its "
        "own layout)"
    )


class KvferryConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by a kvferry node (see the module doc and README)."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: Optional["KVCacheConfig"] = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.cfg = parse_extra_config(ktc.kv_connector_extra_config)
        compat.check_hooks(KVConnectorBase_V1, type(self))
        check_supported(vllm_config, kv_cache_config)
        if compat.warn_if_untested(API) is False:
            log.debug("kvferry: vLLM %s (%s)", API.version, API)
        self._kv_cache_config_ref = kv_cache_config
        pc = vllm_config.parallel_config
        instance = self.cfg.instance or f"vllm-{ktc.engine_id}"
        dp_size = getattr(pc, "data_parallel_size", 1) or 1
        if dp_size > 1 and not self.cfg.instance:
            instance += f"-dp{getattr(pc, 'data_parallel_rank', 0)}"
        model = self.cfg.model or _served_model(vllm_config)
        kv_dtype = _kv_dtype(vllm_config)
        block_size = int(vllm_config.cache_config.block_size)
        tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self.scheduler_side: Optional[SchedulerSide] = None
        self.worker_side: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            if ktc.kv_load_failure_policy != "recompute" and ktc.is_kv_consumer:
                log.warning(
                    "kvferry: kv_load_failure_policy is %r: a kvferry load that fails (node "
                    "killed mid-load) fails its request; set \"kv_load_failure_policy\": "
                    "\"recompute\" to recompute its blocks instead",
                    ktc.kv_load_failure_policy,
                )
            async_sched = getattr(vllm_config.scheduler_config, "async_scheduling",
                                  True) is not False
            self.scheduler_side = SchedulerSide(
                self.cfg,
                instance=instance,
                model=model,
                kv_dtype=kv_dtype,
                block_size=block_size,
                tp_size=tp_size,
                layout_tag=str(
                    getattr(kv_cache_config, "kv_cache_layout", None)
                    or getattr(vllm_config.cache_config, "kv_cache_layout", None)
                    or ""
                ),
                load=ktc.is_kv_consumer,
                save=ktc.is_kv_producer,
                # Resolved by vLLM before the connector is made (None only in a config
                # that was never finished: treated as vLLM's default, on).
                async_scheduling=async_sched,
                early_loads=_early_loads(self.cfg, async_sched, tp_size,
                                         int(getattr(pc, "pipeline_parallel_size", 1) or 1)),
                events=compat.engine_events(vllm_config, self.cfg.events),
            )
        else:
            num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
            if not num_blocks:
                num_blocks = int(vllm_config.cache_config.num_gpu_blocks or 0)
            self.worker_side = WorkerSide(
                self.cfg,
                instance=instance,
                model=model,
                kv_dtype=kv_dtype,
                tp_rank=_tp_rank(),
                tp_size=tp_size,
                num_blocks=num_blocks,
                backend=_backend_name(vllm_config),
            )
        log.info(
            "kvferry: %s connector for instance %s, node %s (model %s as namespace %s, %s, "
            "block size %d, TP %d, loads %s%s; vLLM %s)",
            role.name.lower(), instance, self.cfg.address, model, model_namespace(model),
            kv_dtype, block_size, tp_size, self.cfg.load_mode,
            ", direct GPU loads asked" if self.cfg.direct_gpu else "", API.version,
        )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        # Called while the engine starts (layout resolution): bad settings fail here first.
        cfg = parse_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        if cfg.kv_layout == "cross_layer" and API.cross_layer == "layout":
            return "BLHNC"
        # vLLM 0.26 knows "NHD"/"HND" only, and asks for cross-layer KV through
        # prefer_cross_layer_blocks instead.
        return None

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        # vLLM 0.26: one KV tensor for all layers, handed to register_cross_layers_kv_cache
        # (where the attention backend lays blocks outermost; vLLM falls back otherwise).
        return self.cfg.kv_layout == "cross_layer" and API.cross_layer == "register"

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        # vLLM 0.34 (see _kv_cache_access).
        return _kv_cache_access(kv_transfer_config)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # vLLM 0.33+: sleep releases the KV cache's memory and restores it later; the
        # connector follows (unregister_kv_caches / restore_kv_caches: the node forgets the
        # instance, then it is registered afresh), but sleep mode has not been run on a GPU
        # with kvferry, so vLLM refuses it at start rather than risk loads into memory it
        # no longer reads.
        return False

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        # kvferry names a block by the tokens up to its end; KV that depends on tokens after
        # the block (EAGLE block drop's lookahead) would be shared under the wrong name.
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a save that does not happen is a later miss, nothing more.
        return False

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        assert self.worker_side is not None
        layout = self.worker_side.register_kv_caches(kv_caches)
        if self.cfg.kv_layout == "cross_layer" and layout.kind != "cross_layer":
            log.warning("%s", _per_layer_why(self._vllm_config, API))

    def unregister_kv_caches(self) -> None:
        # vLLM 0.33+: the KV cache's memory is released (sleep, a weight update).
        if self.worker_side is not None:
            self.worker_side.release()

    def restore_kv_caches(self) -> None:
        # vLLM 0.33+: the KV cache has memory again; registered afresh.
        if self.worker_side is not None:
            self.worker_side.restore()

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        """vLLM 0.26's cross-layer KV: one tensor for all layers, in the backend's physical
        order; registered as the per-layer views vLLM's own layers use."""
        assert self.worker_side is not None
        self.worker_side.register_kv_caches(
            cross_layer_views(kv_cache, attn_backend, self._kv_cache_config_ref)
        )

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.worker_side is not None:
            self.worker_side.handle_preemptions(kv_connector_metadata)  # type: ignore[arg-type]

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None:
            # Every step binds its metadata first, with or without a forward.
            self.worker_side.begin_step(connector_metadata)  # type: ignore[arg-type]

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self.worker_side is not None and self.has_connector_metadata():
            self.worker_side.start_load(self._get_connector_metadata())  # type: ignore[arg-type]

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Async loads finish between steps; sync loads are waited for layer by layer on the
        # node's completion board (or finished in start_load_kv where there is none).
        if self.worker_side is not None:
            self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Whole blocks are saved after the step (wait_for_save).
        return None

    def wait_for_save(self) -> None:
        if self.worker_side is not None and self.has_connector_metadata():
            self.worker_side.submit_saves(self._get_connector_metadata())  # type: ignore[arg-type]

    def get_finished(self, finished_req_ids: set) -> Tuple[Optional[set], Optional[set]]:
        # vLLM 0.26: a failed load's blocks go to get_block_ids_with_load_errors.
        if self.worker_side is None:
            return None, None
        sending, recving = self.worker_side.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set) -> Any:
        # vLLM 0.33+: a failed asynchronous load is reported as failed_recving (and as
        # finished), so vLLM recomputes the request or fails it, as its policy says.
        if self.worker_side is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self.worker_side.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set:
        if self.worker_side is None:
            return set()
        return self.worker_side.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> Optional[KvferryConnectorStats]:
        side = self.worker_side or self.scheduler_side
        data = side.take_stats() if side is not None else {}
        return KvferryConnectorStats(data=data) if data else None

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: "Request") -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.on_new_request(request)

    def may_load_async(self, request: "Request") -> bool:
        # vLLM 0.34, with --max-num-inflight-kv-loads: whether this request may load
        # asynchronously (a hit is known only after the query).
        return self.scheduler_side is not None and self.scheduler_side.may_load_async(request)

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int):
        if num_external_tokens <= 0 or CacheHitSource is None or self.scheduler_side is None:
            return {}
        host, p2p = self.scheduler_side.hit_sources(request, num_external_tokens)
        out = {}
        if host:
            out[CacheHitSource.HOST] = host
        if p2p:
            out[CacheHitSource.P2P] = p2p
        return out

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        assert self.scheduler_side is not None
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        step = self.scheduler_side.build_connector_meta(scheduler_output)
        return KvferryConnectorMetadata(step.loads, step.saves, step.preempted)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.update_connector_output(connector_output)

    def take_events(self):
        # vLLM's scheduler asks once a step: kvferry's tiers as this engine's KV events.
        if self.scheduler_side is None:
            return ()
        return self.scheduler_side.take_events()

    def request_finished(self, request: "Request", block_ids: list) -> Tuple[bool, Optional[dict]]:
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, block_ids)

    # ------------------------------------------------------------------ metrics

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> KVConnectorStats:
        return KvferryConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
