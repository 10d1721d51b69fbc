"""A vLLM engine without a GPU or a model: vLLM's real ``Scheduler`` (with the kvferry
connector it creates from a ``KVTransferConfig``), a worker-side ``KvferryConnector`` whose
KV is memfd-backed CPU tensors, and a "forward pass" that writes deterministic bytes for the
scheduled tokens (:func:`vllm_support.forward`).

The worker connector is driven as the installed vLLM's model runner drives it, found from
what that vLLM has (:data:`RUNNER`): 0.33+ start synchronous loads before the forward and
asynchronous ones after it and ask ``get_transfer_results``; 0.26 starts every load before
the forward, calls ``wait_for_save`` only on steps with a forward and asks ``get_finished``.
Cross-layer KV reaches the connector as 0.26 hands it over (one tensor, through
``register_cross_layers_kv_cache``) or as 0.33+ do (per-layer views of a BLHNC allocation).

The model is a tiny Llama ``config.json`` written into a temporary folder (no model hub,
``skip_tokenizer_init=True``); ``cache_config.num_gpu_blocks`` is set by hand.

Run as a script it is one engine process of the two-process test: ``--save`` computes a
prompt and saves it, ``--load`` loads it and checks every loaded byte, printing one JSON
line (``ENGINE {...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_support import (  # noqa: E402
    block_contents, empty, expected_block, forward, kv_tensors,
)

LAYERS, KV_HEADS, HEAD_SIZE = 2, 2, 32
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_SIZE,
    "num_hidden_layers": LAYERS,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


def model_dir(tmp: Path) -> str:
    d = Path(tmp) / "tiny-llama"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(d)


class _Runner:
    """How the installed vLLM's model runner drives a worker connector."""

    def __init__(self) -> None:
        import dataclasses

        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        def names(cls):
            return {f.name for f in dataclasses.fields(cls)}

        #: 0.33+: sync loads start before the forward, async ones after it.
        self.sync_flag = "has_sync_kv_loads" in names(SchedulerOutput)
        #: 0.33+: get_transfer_results (failed_recving); 0.26: get_finished.
        self.transfer_results = hasattr(KVConnectorBase_V1, "get_transfer_results")
        #: 0.26: cross-layer KV through register_cross_layers_kv_cache.
        self.cross_layer_register = hasattr(KVConnectorBase_V1, "prefer_cross_layer_blocks")
        #: 0.34: a resumed (preempted) request comes back among the new requests.
        from vllm.v1.core.sched.output import CachedRequestData

        self.resumed_as_new = "resumed_req_ids" not in names(CachedRequestData)
        self.output_fields = names(ModelRunnerOutput)
        self.kv_output_fields = names(KVConnectorOutput)

    def __repr__(self) -> str:
        return repr(self.__dict__)


def runner() -> _Runner:
    global RUNNER
    if RUNNER is None:
        RUNNER = _Runner()
    return RUNNER


RUNNER: Any = None


def vllm_config(tmp: Path, extra: Dict[str, Any], *, block_size: int = 16,
                num_blocks: int = 64, prefix_caching: bool = True,
                policy: str = "recompute", kv_role: str = "kv_both",
                max_batched: int = 1024, served_model_name: str = "tiny-llama",
                async_scheduling: bool = True, kv_events: Any = None):
    from vllm.config import (
        CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig,
    )

    mc = ModelConfig(model=model_dir(tmp), skip_tokenizer_init=True, dtype="float32",
                     max_model_len=4096, served_model_name=served_model_name)
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched,
                         max_model_len=4096, enable_chunked_prefill=True,
                         is_encoder_decoder=False, async_scheduling=async_scheduling)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    kt = KVTransferConfig(
        kv_connector="KvferryConnector",
        kv_connector_module_path="kvferry.vllm",
        kv_role=kv_role,
        kv_connector_extra_config=dict(extra),
        kv_load_failure_policy=policy,
    )
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                    device_config=DeviceConfig(device="cpu"), kv_transfer_config=kt)
    vc.cache_config.num_gpu_blocks = num_blocks
    if kv_events is not None:
        # vLLM's --kv-events-config: the scheduler publishes its KV events (and the
        # connector's) on a ZMQ PUB socket.
        vc.kv_events_config = kv_events
    # vLLM 0.33+: the engine core resolves the layout before connectors exist; tensors
    # below match it. (0.26 has no such setting: its FlashAttention NHD is LBNHC.)
    if hasattr(vc.cache_config, "kv_cache_layout"):
        vc.cache_config.kv_cache_layout = "LBNHC"
    return vc


def kv_cache_config(vc, num_blocks: int):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    tensors = []
    if runner().cross_layer_register:
        # vLLM 0.26 names each layer's tensor (its cross-layer KV is laid out from them).
        from vllm.v1.kv_cache_interface import KVCacheTensor

        page = 2 * vc.cache_config.block_size * KV_HEADS * HEAD_SIZE * 4
        tensors = [KVCacheTensor(size=page * num_blocks, shared_by=[n]) for n in names]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(names, FullAttentionSpec(
            block_size=vc.cache_config.block_size, num_kv_heads=KV_HEADS,
            head_size=HEAD_SIZE, dtype=torch.float32))],
    )


def cross_layer_kv_026(vc, num_blocks: int, block_size: int):
    """vLLM 0.26's cross-layer KV as its model runner allocates it for FlashAttention
    (``allocate_uniform_kv_caches``; on a memfd here): one tensor in the backend's
    physical order with the layers dimension, and the per-layer views its layers use.
    Returns (tensor, backend, {layer: view})."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as backend

    with set_current_vllm_config(vc):
        shape = (LAYERS,) + tuple(backend.get_kv_cache_shape(
            num_blocks, block_size, KV_HEADS, HEAD_SIZE))
        order = backend.get_kv_cache_stride_order(include_num_layers_dimension=True)
    big = empty(tuple(shape[i] for i in order), torch.float32)
    logical = big.permute(*[order.index(i) for i in range(len(order))])
    views = {f"model.layers.{i}.self_attn.attn": logical[i] for i in range(LAYERS)}
    return big, backend, views


class Engine:
    """One engine: scheduler (with its connector) and ``tp`` worker connectors (TP ranks,
    each with KV of its own), whose outputs vLLM's ``KVOutputAggregator`` combines as the
    executor does."""

    def __init__(self, tmp: Path, extra: Dict[str, Any], *, num_blocks: int = 64,
                 block_size: int = 16, layout: str = "LBNHC", tp: int = 1, **kw: Any):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from kvferry.vllm import KvferryConnector

        self.block_size = block_size
        self.driver = runner()
        self.vc = vllm_config(Path(tmp), extra, block_size=block_size, num_blocks=num_blocks, **kw)
        if hasattr(self.vc.cache_config, "kv_cache_layout"):
            self.vc.cache_config.kv_cache_layout = layout
        self.vc.parallel_config.tensor_parallel_size = tp
        self.kvc = kv_cache_config(self.vc, num_blocks)
        if self.vc.scheduler_config.async_scheduling:
            # vLLM's default (as `vllm serve` runs it).
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler as Scheduler
        self.scheduler = Scheduler(
            vllm_config=self.vc, kv_cache_config=self.kvc, log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vc), block_size=block_size,
        )
        import kvferry.vllm.connector as conn

        self.tp = tp
        self.workers, self.kvs = [], []
        real_rank = conn._tp_rank
        try:
            for rank in range(tp):
                conn._tp_rank = lambda r=rank: r  # what vLLM's TP group says in rank r
                w = KvferryConnector(self.vc, KVConnectorRole.WORKER, self.kvc)
                if layout == "BLHNC" and self.driver.cross_layer_register:
                    # vLLM 0.26 hands over cross-layer KV only where the connector prefers it.
                    assert w.prefer_cross_layer_blocks
                    big, backend, kv = cross_layer_kv_026(self.vc, num_blocks, block_size)
                    w.register_cross_layers_kv_cache(big, backend)
                else:
                    kv = kv_tensors(LAYERS, num_blocks, KV_HEADS, block_size, HEAD_SIZE, layout)
                    w.register_kv_caches(kv)
                self.workers.append(w)
                self.kvs.append(kv)
        finally:
            conn._tp_rank = real_rank
        self.worker, self.kv = self.workers[0], self.kvs[0]
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.aggregator = KVOutputAggregator.from_connector(self.worker, tp)
        self.requests: Dict[str, Any] = {}
        self.outputs: Dict[str, List[int]] = {}
        self.finished: set = set()
        self.invalid_reported: set = set()
        self.invalid_steps: List[set] = []
        # vLLM 0.33+: loads reported failed per request.
        self.failed_recving: set = set()
        self.failed_steps: List[set] = []
        self.stats_log: List[Any] = []
        self.stats: Dict[str, Any] = {}
        self.scheduled_tokens: Dict[str, int] = {}
        # As vLLM's EngineCore does: requests carry vLLM's own block hashes (its prefix
        # cache), seeded per process; kvferry's hashes are its own.
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        fn = get_hash_fn_by_name(self.vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(fn)
        self.block_hasher = get_request_block_hasher(block_size, fn)

    @property
    def connector(self):
        return self.scheduler.connector

    def add(self, req_id: str, tokens: List[int], max_tokens: int = 2, **req_kw: Any) -> Any:
        """Adds a request; ``req_kw`` go to vLLM's ``Request`` (``lora_request``,
        ``cache_salt``)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=sp,
                      pooling_params=None, block_hasher=self.block_hasher, **req_kw)
        self.scheduler.add_request(req)
        self.requests[req_id] = req
        self.outputs[req_id] = []
        return req

    def block_ids(self, req_id: str) -> List[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def step(self, before_worker=None) -> Any:
        """One engine step; ``before_worker(so)`` runs between scheduling and the workers
        (to kill a node after its lease was granted, say)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        if before_worker is not None:
            before_worker(so)
        meta = so.kv_connector_metadata
        run = self.driver
        forward_step = so.total_num_scheduled_tokens > 0
        # 0.33+: sync loads before the forward, async ones after; 0.26: all before.
        load_first = so.has_sync_kv_loads if run.sync_flag else True
        for w in self.workers:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            if load_first:
                w.start_load_kv(None)
            if forward_step:
                # As vLLM's attention layers do: each waits for its own layer to land.
                side = w.worker_side
                for name in list(getattr(side, "_layer_index", {})):
                    w.wait_for_layer_load(name)
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            end = req.num_computed_tokens
            start = end - n
            toks = list(req.all_token_ids)
            for rank, kv in enumerate(self.kvs):
                forward(kv, toks, self.block_ids(rid), start, min(end, len(toks)),
                        self.block_size, rank=rank)
            self.scheduled_tokens[rid] = self.scheduled_tokens.get(rid, 0) + n
            req_ids.append(rid)
            # A token is sampled once the whole sequence has been computed.
            sampled.append([(sum(toks) + len(toks)) % 997 + 1] if end >= len(toks) else [])
        outs_per_rank = []
        for w in self.workers:
            if not load_first:
                w.start_load_kv(None)
            if forward_step or run.sync_flag:
                # 0.26 calls wait_for_save only after a forward.
                w.wait_for_save()
            kvo: Dict[str, Any] = {}
            if run.transfer_results:
                res = w.get_transfer_results(so.finished_req_ids)
                kvo.update(finished_sending=res.finished_sending or None,
                           finished_recving=res.finished_recving or None,
                           failed_recving=res.failed_recving)
            else:
                sending, recving = w.get_finished(so.finished_req_ids)
                kvo.update(finished_sending=sending, finished_recving=recving)
            kvo.update(invalid_block_ids=w.get_block_ids_with_load_errors(),
                       kv_connector_stats=w.get_kv_connector_stats())
            w.clear_connector_metadata()
            mro: Dict[str, Any] = dict(
                req_ids=req_ids,
                sampled_token_ids=sampled,
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=None,
                kv_connector_output=KVConnectorOutput(**kvo),
            )
            if "req_id_to_index" in run.output_fields:  # up to 0.33
                mro["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
            outs_per_rank.append(ModelRunnerOutput(**mro))
        out = self.aggregator.aggregate(outs_per_rank) if self.tp > 1 else outs_per_rank[0]
        kvout = out.kv_connector_output
        invalid = set(kvout.invalid_block_ids or ())
        self.invalid_reported |= invalid
        self.invalid_steps.append(invalid)
        failed = set(getattr(kvout, "failed_recving", None) or ())
        self.failed_recving |= failed
        self.failed_steps.append(failed)
        eco = self.scheduler.update_from_output(so, out)
        from kvferry.vllm.stats import merge

        for outs in eco.values():
            for o in outs.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
            # vLLM's own stats: the workers' counters aggregated with the scheduler's.
            sst = getattr(outs, "scheduler_stats", None)
            self.stats_log.append(None if sst is None else sst.kv_connector_stats)
            if sst is not None and sst.kv_connector_stats:
                self.stats = merge(self.stats, sst.kv_connector_stats)
        return so

    def run(self, until=None, max_steps: int = 200, sleep: float = 0.002) -> int:
        """Steps until ``until()`` (default: no request left); returns the steps taken."""
        for i in range(max_steps):
            if until is not None and until():
                return i
            if until is None and not self.scheduler.has_requests():
                return i
            self.step()
            time.sleep(sleep)
        raise AssertionError(f"not done after {max_steps} steps")

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
        if self.connector is not None:
            self.connector.shutdown()


def prompt(n: int, seed: int = 1) -> List[int]:
    return [(seed * 7919 + i * 104729) % 997 + 1 for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--instance", required=True)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--tmp", required=True)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", action="store_true")
    mode.add_argument("--load", action="store_true")
    a = ap.parse_args()
    eng = Engine(Path(a.tmp), {"address": a.address, "instance": a.instance})
    toks = prompt(a.tokens, seed=5)
    bs = eng.block_size
    eng.add("r", toks)
    result: Dict[str, Any] = {"pythonhashseed": os.environ.get("PYTHONHASHSEED")}
    if a.save:
        eng.run()
        # The saves ran before the request's blocks were freed.
        result["saved_blocks"] = eng.stats.get("saved_blocks", 0)
    else:
        eng.step()
        req = eng.requests["r"]
        result["status"] = str(req.status)
        result["matched_tokens"] = req.num_computed_tokens
        ids = eng.block_ids("r")
        eng.run(until=lambda: "WAITING_FOR_REMOTE_KVS" not in str(req.status))
        ok = True
        loaded = result["matched_tokens"] // bs
        for i in range(loaded):
            got = block_contents(eng.kv, ids[i])
            want = expected_block(eng.kv, toks, i, bs)
            ok = ok and all(bool((g == w_).all()) for g, w_ in zip(got, want))
        result["loaded_blocks"] = loaded
        result["bytes_ok"] = ok
        eng.run()
        result["invalid"] = sorted(eng.invalid_reported)
    eng.shutdown()
    print("ENGINE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
