"""``EngineBuilder``: the steps from a model name to a running engine, one method each.

``EngineBuilder(model=..., **options).build()`` does everything (the options are
:class:`~framework.engine.args.EngineArgs` fields); plugin authors and tests can run the steps one
by one (``open_source``, ``model_config``, ``load_model``, ``select_attention_backend``,
``allocate_kv_cache``) and inspect or replace what each produced. The decisions live beside it:
:mod:`~framework.engine.attention_choice`, :mod:`~framework.engine.kv_cache_sizing` and
:mod:`~framework.distributed.all_reduce_policy`.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from framework import distributed, isq, plugins, registries
from framework.attention_backend import AttentionBackend, AttentionLayerConfig
from framework.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, resolve_dtype, with_yarn_scaling
from framework.distributed.all_reduce_policy import AllReducePolicy
from framework.distributed.config import DEFAULT_MASTER_PORT, ParallelConfig, free_port
from framework.distributed.launch import WorkerGroup
from framework.distributed.messages import StepMessage
from framework.engine import kv_cache_sizing
from framework.engine.args import EngineArgs
from framework.engine.attention_choice import choose_attention_backend
from framework.engine.cuda_graphs import CUDAGraphRunner
from framework.engine.engine import EngineCore
from framework.engine.kv_cache_manager import KVCacheManager
from framework.engine.model_runner import ModelRunner
from framework.engine.oom_hints import out_of_memory_names_the_flag
from framework.engine.sampler import Sampler
from framework.engine.structured_outputs import StructuredOutputManager
from framework.engine.summary import engine_summary, log_summary
from framework.engine.worker_spec import spawn_workers
from framework.errors import ConfigError, FwError, ModelLoadError
from framework.layers.attention import Attention
from framework.layers.layernorm import RMSNorm
from framework.loader import model_loader
from framework.loader.format import WeightFormat
from framework.loader.source import resolve_local_path
from framework.platform import Platform, platform_for_device
from framework.quantization import build_quant_config, verify_quant_methods
from framework.tokenizer import Tokenizer

log = logging.getLogger("fw.engine")


@dataclass(slots=True)
class Engine:
    """A built engine: the core plus what callers need to speak text to it."""

    core: EngineCore
    tokenizer: Tokenizer
    model_config: ModelConfig
    generation_config: dict[str, Any]
    attention_backend: str
    summary: dict[str, Any]
    workers: WorkerGroup | None = None  # this node's other tensor-parallel ranks (rank 0 only)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the group (no-op on one device); idempotent."""
        if self.workers is not None:
            self.workers.stopping = True
        if distributed.is_tensor_parallel():
            try:
                distributed.broadcast_message(StepMessage(shutdown=True), StepMessage)
            except Exception:  # a worker is already gone: reaping below is all that is left
                pass
            # every rank leaves the group together (the workers on the shutdown message), then the
            # workers are reaped: terminating them first would leave rank 0's NCCL teardown waiting
            self.core.runner.release_cuda_graphs()
        distributed.destroy_tensor_parallel()
        if self.workers is not None:
            self.workers.close()


class EngineBuilder:
    """Builds an :class:`Engine` from :class:`EngineArgs` (the ``fw serve`` engine flags)."""

    def __init__(
        self, model: str | None = None, *, args: EngineArgs | None = None, tp_rank: int | None = None, **options: Any
    ) -> None:
        """``EngineBuilder(model, **options)`` with the :class:`EngineArgs` fields as keyword options,
        or ``EngineBuilder(args=...)``; ``tp_rank`` places a tensor-parallel worker. Every option is
        validated here, before anything is downloaded."""
        if args is None:
            args = EngineArgs.from_options(**({"model": model} if model is not None else {}), **options)
        elif model is not None or options:
            raise ConfigError("give EngineBuilder either args= or keyword options, not both")
        args.check_names()
        self.args = args
        self.parallel = ParallelConfig(
            args.tensor_parallel_size,
            args.num_nodes,
            args.node_rank,
            args.device_ids,
            args.master_addr,
            args.master_port,
            args.rendezvous_timeout,
            args.distributed_timeout,
            tp_rank,
        )
        self.device = self.parallel.device(args.device)
        self.all_reduce_policy = AllReducePolicy.resolve(args.all_reduce, self.device, self.parallel.num_nodes)
        if self.parallel.is_parallel and self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before anything touches CUDA: no context on another rank's GPU
        self.workers: WorkerGroup | None = None
        self.cache = CacheConfig(
            block_size=args.block_size,
            kv_fraction=args.kv_fraction,
            mem_mb=args.mem_mb,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_cache_max_tokens=args.prefix_cache_max_tokens,
            num_blocks=args.num_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        self.scheduler = SchedulerConfig.from_args(args, args.max_model_len)  # again once the context length is known
        self.platform: Platform = platform_for_device(self.device.type)  # a CPU device on a CUDA machine: the CPU's
        self.source: WeightFormat | None = None
        self.config: ModelConfig | None = None
        self.torch_model: torch.nn.Module | None = None

    # --- steps ---------------------------------------------------------------------------
    def open_source(self) -> WeightFormat:
        """Resolve ``model``/``weights``/``file`` to a local path and open its weight format."""
        plugins.load_plugins()
        path = resolve_local_path(self.args.model, self.args.weights, self.args.file, self.args.revision)
        self.source_path = path
        self.source = model_loader.open_model_source(Path(path), self.args.file, self.args.load_format)
        return self.source

    def model_config(self) -> ModelConfig:
        source = self.source or self.open_source()
        hf_config = source.hf_config()
        if self.args.yarn_scaling_factor:
            hf_config = with_yarn_scaling(hf_config, self.args.yarn_scaling_factor)
        generation = source.generation_config()
        tokenizer = source.tokenizer()
        eos = set(_as_list(generation.get("eos_token_id"))) | set(_as_list(hf_config.get("eos_token_id")))
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        eos |= tokenizer.extra_eos_token_ids
        dtype = resolve_dtype(self.args.dtype, self.device, hf_config.get("torch_dtype") or hf_config.get("dtype"))
        self.config = ModelConfig.from_hf_config(
            hf_config,
            dtype=dtype,
            max_model_len=self.args.max_model_len,
            eos_token_ids=frozenset(eos),
            source=str(self.args.model or self.args.weights or self.source_path),
        )
        self._tokenizer, self._generation = tokenizer, generation
        self.scheduler = SchedulerConfig.from_args(self.args, self.config.max_model_len)
        return self.config

    def load_model(self) -> torch.nn.Module:
        """Build the architecture's class and stream the weights in."""
        config = self.config or self.model_config()
        spec = registries.model_architectures(self.platform).get(config.architecture)
        model_cls = spec.load()
        quant_config = self._quant_config()
        if quant_config is not None:
            quant_config.packed_modules_mapping = dict(getattr(model_cls, "packed_modules_mapping", {}))
        torch.manual_seed(self.args.seed)
        model = model_loader.build_model(model_cls, config, quant_config, self.device)
        if quant_config is not None:
            verify_quant_methods(model, config.dtype, self.device)
        assert self.source is not None
        if self.source.name == "dummy":
            self.source.device = self.device  # each rank draws the (identical, seeded) tensors on its own device
        self.num_weight_tensors = self.source.num_weights()
        weights = self.source.iter_weights()
        self.isq_report = None
        if self.args.isq is not None:
            self.isq_report = isq.IsqReport(self.args.isq)
            weights = isq.quantize_stream(weights, quant_config, self.device, self.isq_report)
        label = "Loading weights" if self.args.isq is None else f"Quantizing ({self.args.isq}) and loading weights"
        weights = model_loader.with_progress(weights, self.source.num_weights(), label)
        started = time.perf_counter()
        try:
            loaded = model_loader.load_weights(model, weights)
            model_loader.check_all_loaded(model, loaded, config.source)
            model_loader.finish_loading(model, self.device)
        except BaseException as error:
            del model
            self.release_model(error)
            if isinstance(error, ModelLoadError) and not str(error).startswith(config.source):
                raise ModelLoadError(f"{config.source}: {error}") from None  # which model, beside which tensor
            raise
        if self.isq_report is not None:
            log.info("%s; load took %.2f s", self.isq_report.describe(), time.perf_counter() - started)
        self.torch_model = model.eval()
        return self.torch_model

    def release_model(self, error: BaseException | None = None) -> None:
        """Drop the (partly) built model and return its device memory: after a failed step nothing
        stays half-loaded, even while the caller holds ``error`` (whose finished frames lose their locals)."""
        self.torch_model = None
        if error is not None:
            traceback.clear_frames(error.__traceback__)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _quant_config(self):
        assert self.source is not None and self.config is not None
        if self.args.isq is not None:
            return isq.build_isq_config(self.args.isq, self.source, self.config, self.device, self.config.source)
        checkpoint = self.source.quantization_config()
        declared = (checkpoint or {}).get("quant_method")
        if self.args.quantization is not None and declared is not None and declared != self.args.quantization:
            raise ConfigError(
                f"--quantization {self.args.quantization} disagrees with the checkpoint {self.config.source}, "
                f"which is quantized with {declared!r}: leave --quantization out (the checkpoint's "
                f"method is used) or give --quantization {declared}"
            )
        name = plugins.call_first(
            "resolve_quantization_method",
            model_config=self.config,
            quantization_config=checkpoint,
            requested=self.args.quantization,
            platform=self.platform,
        )
        if name is None:
            return None
        spec = registries.quantization_methods(self.platform).get(name)
        reasons = spec.unavailable_reasons(self.platform)
        if reasons:
            raise ConfigError(f"quantization method {name!r} cannot run here: {'; '.join(reasons)}")
        return build_quant_config(spec.load(), checkpoint or {}, self.config, self.device)

    def attention_layers(self) -> list[AttentionLayerConfig]:
        model = self.torch_model or self.load_model()
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        return [m.config for m in sorted(layers, key=lambda m: m.layer_index)]

    def select_attention_backend(self) -> AttentionBackend:
        """Choose among backends that validate (:mod:`~framework.engine.attention_choice`) and set it up."""
        layers = self.attention_layers()
        self.backend_name = choose_attention_backend(
            layers, self.config, self.cache.cache_dtype, self.args.attention_backend, self.platform
        )
        backend = registries.attention_backends(self.platform).get(self.backend_name).load()()
        backend.initialize(layers, self.config.dtype, self.cache.block_size, self.device)
        return backend

    def allocate_kv_cache(self, backend: AttentionBackend) -> list[torch.Tensor]:
        """Size the KV cache to its budget (:mod:`~framework.engine.kv_cache_sizing`) and allocate it."""
        config, cache, layers = self.config, self.cache, self.attention_layers()
        per_block = kv_cache_sizing.bytes_per_block(layers, cache.block_size, config.dtype)
        num_blocks = kv_cache_sizing.num_kv_blocks(
            cache, self.device, per_block, config.max_model_len, self.scheduler.max_num_seqs
        )
        if num_blocks * cache.block_size < config.max_model_len:
            log.warning(
                "KV cache holds %d tokens, less than the context length %d: long requests will be preempted "
                "or refused; raise --mem / --kv-fraction / --gpu-memory-utilization or lower --max-model-len",
                num_blocks * cache.block_size,
                config.max_model_len,
            )
        caches = kv_cache_sizing.allocate_kv_caches(
            backend, layers, num_blocks, cache.block_size, config.dtype, self.device
        )
        self.num_blocks = num_blocks
        self.kv_cache_bytes = per_block * num_blocks
        return caches

    def capture_cuda_graphs(self, backend: AttentionBackend, kv_caches: list[torch.Tensor]) -> CUDAGraphRunner | None:
        """Capture decode graphs when on CUDA, enabled, and the backend allows it."""
        self.graph_summary = "off"
        if self.device.type != "cuda" or not self.args.enable_cuda_graphs:
            return None
        if not backend.supports_cuda_graphs:
            self.graph_summary = f"off (attention backend {self.backend_name} cannot be graphed)"
            return None
        graphs = CUDAGraphRunner(
            self.torch_model,
            backend,
            kv_caches,
            max_num_seqs=self.scheduler.max_num_seqs,
            max_model_len=self.config.max_model_len,
            block_size=self.cache.block_size,
            sink_block=self.num_blocks,
            device=self.device,
        )
        seconds, memory = graphs.capture()
        self.graph_summary = f"{len(graphs.buckets)} decode graphs (batch 1..{graphs.buckets[-1]}) in {seconds:.1f} s, {memory / 2**20:.0f} MiB"
        log.info("CUDA graphs: %s", self.graph_summary)
        return graphs

    def start_tensor_parallel(self) -> None:
        """Join the tensor-parallel group (no-op with one rank); rank 0 first starts its node's workers.

        Refuses, before any process starts, an architecture that cannot be sharded.
        """
        parallel = self.parallel
        if not parallel.is_parallel:
            return
        if distributed.is_tensor_parallel():
            raise ConfigError(
                "this process already runs a tensor-parallel engine; close it (LLM.close() or "
                "Engine.shutdown()) before building another"
            )
        config = self.config or self.model_config()
        spec = registries.model_architectures(self.platform).get(config.architecture)
        if not spec.supports_tensor_parallel:
            raise ConfigError(
                f"architecture {config.architecture} cannot be sharded for tensor parallelism yet "
                f"(its plugin sets supports_tensor_parallel=False); run it on one device (--tp 1)"
            )
        if parallel.master_port is None:
            if parallel.num_nodes > 1:
                parallel.master_port = DEFAULT_MASTER_PORT
            else:
                parallel.master_port = free_port(parallel.master_addr)
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, torch.get_num_threads() // parallel.ranks_per_node))
        from framework.distributed.numa import bind_to_numa_node

        bind_to_numa_node(parallel.local_rank)
        if parallel.rank == 0 and parallel.ranks_per_node > 1:
            self.workers = spawn_workers(self.worker_args(), list(range(1, parallel.ranks_per_node)))
        distributed.init_tensor_parallel(
            parallel.rank,
            parallel.tensor_parallel_size,
            self.device,
            master_addr=parallel.master_addr,
            master_port=parallel.master_port,
            rendezvous_timeout_s=parallel.rendezvous_timeout,
            timeout_s=parallel.distributed_timeout,
            check_workers=self.workers.failure if self.workers is not None else None,
        )
        with out_of_memory_names_the_flag("setting the all-reduce up"):
            self.all_reduce_policy.set_up(config.dtype, config.hidden_size, self.scheduler.max_num_seqs)

    def worker_args(self) -> EngineArgs:
        """This engine's options as another rank of the group gets them (the settled port and size)."""
        p = self.parallel
        return self.args.replace(
            device=None if p.device_ids is not None else self.device.type,
            device_ids=p.device_ids,
            tensor_parallel_size=p.tensor_parallel_size,
            master_port=p.master_port,
        )

    @property
    def all_reduce(self) -> str:
        """The all-reduce this engine sums with (settled once the group exists)."""
        return self.all_reduce_policy.name

    def _build_runner(
        self,
        *,
        structured_outputs: StructuredOutputManager | None = None,
        broadcast: Any = None,
        share_sampled: bool = False,
    ) -> ModelRunner:
        """Every rank's part: the sharded model, attention backend, KV cache and decode graphs."""
        self.start_tensor_parallel()
        with out_of_memory_names_the_flag("loading the weights"):
            self.load_model()
        config = self.config
        if self.parallel.is_parallel:
            self.all_reduce_policy.enable_fused_norm(
                norms_take_all_reduce(self.torch_model),
                config.architecture,
                self.scheduler.max_num_seqs,
                config.hidden_size,
                config.dtype,
            )
        backend = self.select_attention_backend()
        with out_of_memory_names_the_flag("allocating the KV cache"):
            kv_caches = self.allocate_kv_cache(backend)
        with out_of_memory_names_the_flag("capturing CUDA graphs"):
            graphs = self.capture_cuda_graphs(backend, kv_caches)
        return ModelRunner(
            self.torch_model,
            backend,
            kv_caches,
            self.cache.block_size,
            self.device,
            Sampler(eos_token_ids=sorted(config.eos_token_ids)),
            graph_runner=graphs,
            broadcast=broadcast,
            structured_outputs=structured_outputs,
            share_sampled=share_sampled,
        )

    def use_async_scheduling(self) -> bool:
        """``async_scheduling`` as asked; by default on for CUDA (on the CPU nothing would overlap)."""
        if self.args.async_scheduling is not None:
            return self.args.async_scheduling
        return self.device.type == "cuda"

    def build_worker(self) -> ModelRunner:
        """A tensor-parallel worker's runner (rank > 0): no scheduler, tokenizer work or sampling."""
        return self._build_runner()

    def build(self) -> Engine:
        """Run every step and return the engine (on rank 0 of a tensor-parallel group: with its workers)."""
        try:
            config = self.config or self.model_config()
            # rank 0 only: the workers of a tensor-parallel group never sample
            grammars = StructuredOutputManager(
                self._tokenizer,
                vocab_size=config.vocab_size,
                stop_token_ids=sorted(config.eos_token_ids),
                device=self.device,
            )
            async_scheduling = self.use_async_scheduling()
            broadcast = functools.partial(distributed.broadcast_message, message_type=StepMessage)
            runner = self._build_runner(
                structured_outputs=grammars,
                broadcast=broadcast if self.parallel.is_parallel else None,
                share_sampled=async_scheduling and self.parallel.is_parallel,
            )
        except BaseException as error:
            reason = self.workers.wait_for_failure(1.0) if self.workers is not None else None
            if self.workers is not None:
                self.workers.close()
            distributed.destroy_tensor_parallel()
            self.release_model(error)
            if reason is not None and not isinstance(error, FwError):  # the worker's own error is above in the log
                raise ModelLoadError(f"{reason} while the model was loading (its error is printed above)") from error
            raise
        cache = self.cache
        max_cached = (
            None if cache.prefix_cache_max_tokens is None else cache.prefix_cache_max_tokens // cache.block_size
        )
        kv_manager = KVCacheManager(self.num_blocks, cache.block_size, cache.enable_prefix_caching, max_cached)
        engine_config = EngineConfig(config, cache, self.scheduler, str(self.device), self.backend_name, self.args.seed)
        core = EngineCore(
            engine_config, runner, kv_manager, structured_outputs=grammars, async_scheduling=async_scheduling
        )
        summary = engine_summary(self, core)
        log_summary(self, summary)
        return Engine(core, self._tokenizer, config, self._generation, self.backend_name, summary, self.workers)


def norms_take_all_reduce(model: torch.nn.Module) -> bool:
    """Whether some RMS norm of ``model`` sums its input over the ranks (what the fused kernel replaces)."""
    return any(isinstance(module, RMSNorm) and module.reduces_input for module in model.modules())


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
