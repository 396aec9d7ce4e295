"""``EngineBuilder``: the steps from a model name to a running engine, one method each.

``EngineBuilder(model=...).build()`` does everything; plugin authors and tests can run the
steps one by one (``open_source``, ``model_config``, ``load_model``, ``select_attention_backend``,
``allocate_kv_cache``) and inspect or replace what each produced.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from framework import distributed, plugins, registries
from framework.attention_backend import AttentionBackend, AttentionLayerConfig
from framework.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, resolve_dtype
from framework.distributed.config import DEFAULT_MASTER_PORT, ParallelConfig, free_port
from framework.distributed.fast_all_reduce import all_reduce_for_dtype, buffer_bytes, resolve_all_reduce
from framework.distributed.launch import WorkerGroup
from framework.distributed.messages import StepMessage
from framework.engine.cuda_graphs import CUDAGraphRunner
from framework.engine.engine import EngineCore
from framework.engine.kv_cache_manager import KVCacheManager
from framework.engine.model_runner import ModelRunner
from framework.engine.sampler import Sampler
from framework.engine.structured_outputs import StructuredOutputManager
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

#: Without --mem, a CPU KV cache takes at most this much (kv_fraction of free RAM is too greedy
#: on a shared machine, and CPU decoding is compute-bound long before it needs more).
CPU_DEFAULT_KV_BYTES = 2 << 30


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
    """Builds an :class:`Engine`; keyword arguments mirror the ``fw serve`` flags.

    ``all_reduce`` (``--all-reduce``) picks the tensor-parallel all-reduce: ``auto`` (default:
    ``flashinfer`` for bf16 models on one host where FlashInfer's fused kernel is built already, else ``symm_mem``
    when every rank is a Hopper-or-newer GPU of one host with peer access, else ``nccl``),
    ``symm_mem`` (one-shot on NVLink peer memory for decode-sized tensors; an error where it cannot
    run), ``nccl``, or ``flashinfer`` (symm_mem where it can run, plus FlashInfer's fused all-reduce
    + residual add + RMS norm for decode steps of models whose norms take the all-reduce).
    """

    def __init__(self, model: str | None = None, *, weights: str | None = None, file: str | None = None,
                 revision: str | None = None, dtype: str | torch.dtype = "auto", device: str | None = None,
                 max_model_len: int | None = None, block_size: int = 16, kv_fraction: float = 0.7,
                 mem_mb: int | None = None, num_blocks: int | None = None, enable_prefix_caching: bool = True,
                 prefix_cache_max_tokens: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, prefill_chunk_size: int = 8192,
                 attention_backend: str = "auto", quantization: str | None = None, seed: int = 0,
                 enable_cuda_graphs: bool = True, load_format: str = "auto",
                 yarn_scaling_factor: float | None = None, tensor_parallel_size: int | None = None,
                 device_ids: list[int] | None = None, num_nodes: int = 1, node_rank: int = 0,
                 master_addr: str = "127.0.0.1", master_port: int | None = None, rendezvous_timeout: float = 300.0,
                 distributed_timeout: float = 600.0, tp_rank: int | None = None,
                 async_scheduling: bool | None = None, all_reduce: str = "auto") -> None:
        # every argument, for the other tensor-parallel ranks (which build the same engine as their rank)
        self._init_kwargs = {name: value for name, value in locals().items() if name != "self"}
        if isinstance(dtype, torch.dtype):
            self._init_kwargs["dtype"] = str(dtype).removeprefix("torch.")
        self.model, self.weights, self.file, self.revision = model, weights, file, revision
        self.dtype_name = dtype
        self.parallel = ParallelConfig(tensor_parallel_size, num_nodes, node_rank, device_ids, master_addr, master_port,
                                       rendezvous_timeout, distributed_timeout, tp_rank)
        self.device = self.parallel.device(device)
        self.all_reduce = resolve_all_reduce(all_reduce, self.device)  # nccl, symm_mem, auto or flashinfer (validated)
        if self.parallel.is_parallel and self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before anything touches CUDA: no context on another rank's GPU
        self.workers: WorkerGroup | None = None
        self.max_model_len = max_model_len
        self.cache = CacheConfig(block_size=block_size, kv_fraction=kv_fraction, mem_mb=mem_mb,
                                 enable_prefix_caching=enable_prefix_caching,
                                 prefix_cache_max_tokens=prefix_cache_max_tokens, num_blocks=num_blocks)
        self.scheduler = SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max_num_batched_tokens or max(prefill_chunk_size, max_num_seqs),
                                         prefill_chunk_size=prefill_chunk_size)
        self.attention_backend = attention_backend
        self.quantization = quantization
        self.seed = seed
        self.enable_cuda_graphs = enable_cuda_graphs
        self.async_scheduling = async_scheduling
        self.load_format = load_format
        self.yarn_scaling_factor = yarn_scaling_factor
        self.platform: Platform = platform_for_device(self.device.type)  # a CPU device on a CUDA machine: the CPU's
        self.source: WeightFormat | None = None
        self.config: ModelConfig | None = None
        self.torch_model: torch.nn.Module | None = None

    # --- steps ---------------------------------------------------------------------------
    def open_source(self) -> WeightFormat:
        """Resolve ``model``/``weights``/``file`` to a local path and open its weight format."""
        plugins.load_plugins()
        path = resolve_local_path(self.model, self.weights, self.file, self.revision)
        self.source_path = path
        self.source = model_loader.open_model_source(Path(path), self.file, self.load_format)
        return self.source

    def model_config(self) -> ModelConfig:
        source = self.source or self.open_source()
        hf_config = source.hf_config()
        if self.yarn_scaling_factor:
            hf_config = with_yarn_scaling(hf_config, self.yarn_scaling_factor)
        generation = source.generation_config()
        tokenizer = source.tokenizer()
        eos = set(_as_list(generation.get("eos_token_id"))) | set(_as_list(hf_config.get("eos_token_id")))
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        eos |= tokenizer.extra_eos_token_ids
        dtype = resolve_dtype(self.dtype_name, self.device, hf_config.get("torch_dtype") or hf_config.get("dtype"))
        self.config = ModelConfig.from_hf_config(hf_config, dtype=dtype, max_model_len=self.max_model_len,
                                                 eos_token_ids=frozenset(eos), source=str(self.model or self.weights or self.source_path))
        self._tokenizer, self._generation = tokenizer, generation
        return self.config

    def load_model(self) -> torch.nn.Module:
        """Build the architecture's class and stream the weights in."""
        config = self.config or self.model_config()
        spec = registries.model_architectures(self.platform).get(config.architecture)
        model_cls = spec.load()
        quant_config = self._quant_config()
        if quant_config is not None:
            quant_config.packed_modules_mapping = dict(getattr(model_cls, "packed_modules_mapping", {}))
        torch.manual_seed(self.seed)
        model = model_loader.build_model(model_cls, config, quant_config, self.device)
        if quant_config is not None:
            verify_quant_methods(model, config.dtype, self.device)
        assert self.source is not None
        if self.source.name == "dummy":
            self.source.device = self.device  # each rank draws the (identical, seeded) tensors on its own device
        weights = model_loader.with_progress(self.source.iter_weights(), self.source.num_weights(), "Loading weights")
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
        checkpoint = self.source.quantization_config()
        name = plugins.call_first("resolve_quantization_method", model_config=self.config, quantization_config=checkpoint,
                                  requested=self.quantization, platform=self.platform)
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
        """Choose among backends that validate; a requested one that cannot run says why."""
        registry = registries.attention_backends(self.platform)
        layers = self.attention_layers()
        layout = registries.model_architectures(self.platform).get(self.config.architecture).kv_cache_layout
        mismatched = sorted({layer.kv_cache_layout for layer in layers} - {layout})
        if mismatched:
            raise ConfigError(f"{self.config.architecture} registers KV layout {layout!r} but its attention layers "
                              f"use {', '.join(map(repr, mismatched))}: fix the plugin's ModelSpec.kv_cache_layout")
        refusals: dict[str, list[str]] = {}
        candidates = []
        for spec in registry:
            reasons = spec.unavailable_reasons(self.platform)
            if layout not in spec.kv_cache_layouts:
                reasons.append(f"KV layout {layout!r} unsupported (it reads: {', '.join(spec.kv_cache_layouts)})")
            if self.cache.cache_dtype not in spec.kv_cache_dtypes:
                reasons.append(f"kv dtype {self.cache.cache_dtype} unsupported")
            dtype_name = str(self.config.dtype).removeprefix("torch.")
            if spec.model_dtypes and dtype_name not in spec.model_dtypes:
                reasons.append(f"model dtype {dtype_name} unsupported (supports {', '.join(spec.model_dtypes)})")
            if not reasons:
                reasons = spec.load().validate(layers, self.cache.cache_dtype, self.platform)
            if reasons:
                refusals[spec.name] = reasons
            else:
                candidates.append(spec)
        requested = self.attention_backend
        if requested not in (None, "auto"):
            registry.get(requested)  # unknown names list the valid ones
            if requested in refusals:
                raise ConfigError(f"attention backend {requested!r} cannot run: {'; '.join(refusals[requested])}")
        if not candidates:
            detail = "; ".join(f"{name}: {', '.join(why)}" for name, why in refusals.items())
            raise ConfigError(f"no attention backend can run this model here ({detail})")
        name = plugins.call_first("select_attention_backend", candidates=candidates, requested=requested,
                                  model_config=self.config, platform=self.platform)
        for refused, why in refusals.items():
            log.info("attention backend %s not used: %s", refused, "; ".join(why))
        self.backend_name = name
        backend = registry.get(name).load()()
        backend.initialize(layers, self.config.dtype, self.cache.block_size, self.device)
        return backend

    def num_kv_blocks(self, bytes_per_block: int) -> int:
        """Blocks that fit the budget: ``num_blocks``, ``--mem``, or ``kv_fraction`` of free memory."""
        cache = self.cache
        if cache.num_blocks:
            return cache.num_blocks
        if cache.mem_mb:
            budget = cache.mem_mb << 20
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cache.kv_fraction)
        else:
            budget = min(int(_available_ram() * cache.kv_fraction), CPU_DEFAULT_KV_BYTES)
        most_useful = -(-self.config.max_model_len // cache.block_size) * self.scheduler.max_num_seqs
        # every rank holds the same blocks (of its own heads): the tightest device decides
        return distributed.min_over_ranks(max(1, min(budget // bytes_per_block, most_useful)))

    def allocate_kv_cache(self, backend: AttentionBackend) -> list[torch.Tensor]:
        config = self.config
        layers = self.attention_layers()
        dtype = config.dtype
        element = torch.empty((), dtype=dtype).element_size()
        # standard: K and V per KV head; mla: one latent vector per token (kv_elements_per_token)
        per_block = sum(self.cache.block_size * layer.kv_elements_per_token * element for layer in layers)
        num_blocks = self.num_kv_blocks(per_block)
        if num_blocks * self.cache.block_size < config.max_model_len:
            log.warning("KV cache holds %d tokens, less than the context length %d: long requests will be preempted "
                        "or refused; raise --mem / --kv-fraction or lower --max-model-len",
                        num_blocks * self.cache.block_size, config.max_model_len)
        # one extra block at the end: the sink that CUDA-graph padding rows write into
        caches = [torch.zeros(backend.layer_kv_cache_shape(layer, num_blocks + 1, self.cache.block_size),
                              dtype=dtype, device=self.device) for layer in layers]
        self.num_blocks = num_blocks
        self.kv_cache_bytes = per_block * num_blocks
        return caches

    def capture_cuda_graphs(self, backend: AttentionBackend, kv_caches: list[torch.Tensor]) -> CUDAGraphRunner | None:
        """Capture decode graphs when on CUDA, enabled, and the backend allows it."""
        self.graph_summary = "off"
        if self.device.type != "cuda" or not self.enable_cuda_graphs:
            return None
        if not backend.supports_cuda_graphs:
            self.graph_summary = f"off (attention backend {self.backend_name} cannot be graphed)"
            return None
        graphs = CUDAGraphRunner(self.torch_model, backend, kv_caches, max_num_seqs=self.scheduler.max_num_seqs,
                                 max_model_len=self.config.max_model_len, block_size=self.cache.block_size,
                                 sink_block=self.num_blocks, device=self.device)
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
            raise ConfigError("this process already runs a tensor-parallel engine; close it (LLM.close() or "
                              "Engine.shutdown()) before building another")
        config = self.config or self.model_config()
        spec = registries.model_architectures(self.platform).get(config.architecture)
        if not spec.supports_tensor_parallel:
            raise ConfigError(f"architecture {config.architecture} cannot be sharded for tensor parallelism yet "
                              f"(its plugin sets supports_tensor_parallel=False); run it on one device (--tp 1)")
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
            kwargs = {**self._init_kwargs, **self._parallel_kwargs()}
            self.workers = WorkerGroup.spawn(kwargs, list(range(1, parallel.ranks_per_node)))
        distributed.init_tensor_parallel(parallel.rank, parallel.tensor_parallel_size, self.device,
                                         master_addr=parallel.master_addr, master_port=parallel.master_port,
                                         rendezvous_timeout_s=parallel.rendezvous_timeout,
                                         timeout_s=parallel.distributed_timeout,
                                         check_workers=self.workers.failure if self.workers is not None else None)
        self.set_up_all_reduce(config)

    def set_up_all_reduce(self, config: ModelConfig) -> None:
        """Every rank, once the group exists: settle ``self.all_reduce`` to what sums the layers'
        outputs (``nccl``, ``symm_mem``, or ``flashinfer``, whose fused kernel comes once the model
        is built: :meth:`enable_fused_all_reduce_norm`), setting symm_mem up where it is chosen.

        ``auto`` on GPUs of one host takes ``flashinfer`` for bf16 models (the dtype it was measured
        in) where every rank has FlashInfer's module built (:meth:`auto_flashinfer_or_not`), and falls
        back from it if its set-up fails; asked for by name, it must set up.
        """
        self._fused_norm_required = self.all_reduce == "flashinfer"
        if (self.all_reduce == "auto" and self.device.type == "cuda" and config.dtype == torch.bfloat16
                and self.parallel.num_nodes == 1):
            self.all_reduce = self.auto_flashinfer_or_not()
        fused = self.all_reduce == "flashinfer"
        # what sums everything no norm fuses: flashinfer takes symm_mem where it can run, as auto does
        plain = all_reduce_for_dtype("auto" if fused else self.all_reduce, config.dtype)
        if plain in ("symm_mem", "auto"):
            enabled = distributed.enable_symm_mem_all_reduce(
                self.device, buffer_bytes(self.scheduler.max_num_seqs, config.hidden_size, config.dtype),
                required=plain == "symm_mem")
            plain = "symm_mem" if enabled else "nccl"
        self._plain_all_reduce = plain
        self.all_reduce = "flashinfer" if fused else plain  # the fused kernel comes once the model is built

    def _parallel_kwargs(self) -> dict[str, Any]:
        """The builder keyword arguments that place another rank of this group."""
        p = self.parallel
        return dict(device=None if p.device_ids is not None else self.device.type, device_ids=p.device_ids,
                    tensor_parallel_size=p.tensor_parallel_size, num_nodes=p.num_nodes, node_rank=p.node_rank,
                    master_addr=p.master_addr, master_port=p.master_port, rendezvous_timeout=p.rendezvous_timeout,
                    distributed_timeout=p.distributed_timeout)

    def _build_runner(self) -> ModelRunner:
        """Every rank's part: the sharded model, attention backend, KV cache and decode graphs."""
        self.start_tensor_parallel()
        self.load_model()
        self.enable_fused_all_reduce_norm()
        backend = self.select_attention_backend()
        kv_caches = self.allocate_kv_cache(backend)
        sampler = Sampler(eos_token_ids=sorted(self.config.eos_token_ids))
        runner = ModelRunner(self.torch_model, backend, kv_caches, self.cache.block_size, self.device, sampler)
        runner.graph_runner = self.capture_cuda_graphs(backend, kv_caches)
        return runner

    def auto_flashinfer_or_not(self) -> str:
        """``--all-reduce auto`` on GPUs: ``flashinfer`` where every rank has FlashInfer's fused
        all-reduce built already (measured faster than symm_mem alone on two H200s; auto never waits
        for its JIT build), else ``auto`` (symm_mem or NCCL). Every rank calls it and all decide alike."""
        from framework.distributed.flashinfer_all_reduce import unavailable_reason

        reason = unavailable_reason()
        if distributed.min_over_ranks(int(reason is None)):
            return "flashinfer"
        log.info("--all-reduce auto: no fused all-reduce + RMS norm (%s)", reason or "another rank cannot run it")
        return "auto"

    def enable_fused_all_reduce_norm(self) -> None:
        """``--all-reduce flashinfer`` on a built model: FlashInfer's fused all-reduce + residual add
        + RMS norm when the model's norms take the all-reduce (every rank builds the same model, so
        all decide alike; before the KV cache is sized, which then leaves room for its workspace);
        a model whose norms do not keeps the plain all-reduce, and the summary says which."""
        if self.all_reduce != "flashinfer" or not self.parallel.is_parallel:
            return
        assert self.torch_model is not None and self.config is not None
        if not any(isinstance(module, RMSNorm) and module.reduces_input for module in self.torch_model.modules()):
            log.info("--all-reduce flashinfer: %s's norms do not take the all-reduce; %s sums everything",
                     self.config.architecture, self._plain_all_reduce)
            self.all_reduce = self._plain_all_reduce
            return
        try:
            distributed.enable_flashinfer_all_reduce_norm(self.device, self.scheduler.max_num_seqs,
                                                          self.config.hidden_size, self.config.dtype)
        except ConfigError as error:  # raised on every rank alike
            if self._fused_norm_required:
                raise
            log.warning("--all-reduce auto: %s sums everything, since %s", self._plain_all_reduce, error)
            self.all_reduce = self._plain_all_reduce

    def use_async_scheduling(self) -> bool:
        """``async_scheduling`` as asked; by default on for CUDA (on the CPU nothing would overlap)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device.type == "cuda"

    def build_worker(self) -> ModelRunner:
        """A tensor-parallel worker's runner (rank > 0): no scheduler, tokenizer work or sampling."""
        return self._build_runner()

    def build(self) -> Engine:
        """Run every step and return the engine (on rank 0 of a tensor-parallel group: with its workers)."""
        try:
            runner = self._build_runner()
        except BaseException as error:
            reason = self.workers.wait_for_failure(1.0) if self.workers is not None else None
            if self.workers is not None:
                self.workers.close()
            distributed.destroy_tensor_parallel()
            self.release_model(error)
            if reason is not None and not isinstance(error, FwError):  # the worker's own error is above in the log
                raise ModelLoadError(f"{reason} while the model was loading (its error is printed above)") from error
            raise
        if self.parallel.is_parallel:
            runner.broadcast = functools.partial(distributed.broadcast_message, message_type=StepMessage)
        cache = self.cache
        max_cached = None if cache.prefix_cache_max_tokens is None else cache.prefix_cache_max_tokens // cache.block_size
        kv_manager = KVCacheManager(self.num_blocks, cache.block_size, cache.enable_prefix_caching, max_cached)
        # rank 0 only: the workers of a tensor-parallel group never sample
        grammars = StructuredOutputManager(self._tokenizer, vocab_size=self.config.vocab_size,
                                           stop_token_ids=sorted(self.config.eos_token_ids), device=self.device)
        runner.structured_outputs = grammars
        engine_config = EngineConfig(self.config, cache, self.scheduler, str(self.device), self.backend_name, self.seed)
        core = EngineCore(engine_config, runner, kv_manager, structured_outputs=grammars,
                          async_scheduling=self.use_async_scheduling())
        runner.share_sampled = core.async_scheduling and self.parallel.is_parallel
        summary = {
            "model": self.config.source,
            "architecture": self.config.architecture,
            "dtype": str(self.config.dtype).removeprefix("torch."),
            "device": str(self.device),
            "max_model_len": self.config.max_model_len,
            "kv_blocks": self.num_blocks,
            "kv_tokens": self.num_blocks * cache.block_size,
            "kv_bytes": self.kv_cache_bytes,
            "attention_backend": self.backend_name,
            "cuda_graphs": self.graph_summary,
            "async_scheduling": core.async_scheduling,
            "weight_format": self.source.name,
            "weight_bytes": model_bytes(self.torch_model),
            "checkpoint_bytes": self.source.checkpoint_bytes(),
            "plugins": [info.name for info in plugins.loaded_plugins()],
            "tensor_parallel_size": self.parallel.tensor_parallel_size,
        }
        if self.parallel.is_parallel:
            summary["device"] = (f"{self.device} + {self.parallel.tensor_parallel_size - 1} more rank(s) "
                                 f"(tensor parallel {self.parallel.tensor_parallel_size}, {self.parallel.num_nodes} node(s))")
            summary["all_reduce"] = self.all_reduce
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB", self.num_blocks, cache.block_size,
                 self.num_blocks * cache.block_size, self.kv_cache_bytes / 2**20)
        checkpoint = summary["checkpoint_bytes"]
        log.info("Weights: %.2f GiB on %s%s", summary["weight_bytes"] / 2**30, self.device,
                 f" (checkpoint files {checkpoint / 2**30:.2f} GiB)" if checkpoint else "")
        return Engine(core, self._tokenizer, self.config, self._generation, self.backend_name, summary, self.workers)


def model_bytes(model: torch.nn.Module) -> int:
    """Device bytes of ``model``'s parameters and buffers (each shared tensor once): the memory its
    weights take on this rank, packed quantized weights at their packed size."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def with_yarn_scaling(hf_config: dict[str, Any], factor: float) -> dict[str, Any]:
    """The config with YaRN rope scaling by ``factor`` (``--yarn-scaling-factor``), as candle-vllm does:
    the context grows ``factor`` times from the model's own ``max_position_embeddings``."""
    if factor <= 1.0:
        raise ConfigError(f"--yarn-scaling-factor must be > 1, got {factor}")
    config = dict(hf_config)
    original = int(config.get("max_position_embeddings") or 2048)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original}
    params = config.pop("rope_parameters", None) or {}
    if "rope_theta" in params and "rope_theta" not in config:
        config["rope_theta"] = params["rope_theta"]
    config["max_position_embeddings"] = int(original * factor)
    return config


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
