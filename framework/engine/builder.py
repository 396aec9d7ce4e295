"""``EngineBuilder``: the steps from a model name to a running engine, one method each.

``EngineBuilder(model=..., **options).build()`` does everything (the options are
:class:`~framework.engine.args.EngineArgs` fields); plugin authors and tests can run the steps one
by one (``open_source``, ``model_config``, ``load_model``, ``select_attention_backend``,
``allocate_kv_cache``) and inspect or replace what each produced. Each step's work lives in its
own module: :mod:`~framework.engine.model_loading` (source, config, weights),
:mod:`~framework.engine.quant_choice`, :mod:`~framework.engine.tensor_parallel_start`,
:mod:`~framework.engine.attention_choice`, :mod:`~framework.engine.kv_cache_sizing`,
:mod:`~framework.engine.cuda_graphs` and :mod:`~framework.distributed.all_reduce_policy`.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from framework import distributed, isq, registries
from framework.attention_backend import AttentionBackend, AttentionLayerConfig
from framework.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from framework.distributed.all_reduce_policy import AllReducePolicy
from framework.distributed.launch import WorkerGroup
from framework.distributed.messages import StepMessage
from framework.engine import kv_cache_sizing, model_loading, state_cache, tensor_parallel_start
from framework.engine.args import EngineArgs
from framework.engine.attention_choice import choose_attention_backend
from framework.engine.built_engine import Engine
from framework.engine.cuda_graphs import CUDAGraphRunner, capture_decode_graphs
from framework.engine.engine import EngineCore
from framework.engine.kv_cache_manager import KVCacheManager
from framework.engine.model_runner import ModelRunner
from framework.engine.oom_hints import out_of_memory_names_the_flag
from framework.engine.quant_choice import resolve_quant_config
from framework.engine.sampler import Sampler
from framework.engine.structured_outputs import StructuredOutputManager
from framework.engine.summary import engine_summary, log_summary
from framework.engine.worker_spec import spawn_workers
from framework.errors import ConfigError
from framework.kv_cache import KVCache
from framework.layers.attention import Attention
from framework.loader.format import WeightFormat
from framework.multimodal.inputs import VisionSpec
from framework.platform import Platform, platform_for_device


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
        self.parallel, self.device = tensor_parallel_start.place_rank(args, tp_rank)
        self.all_reduce_policy = AllReducePolicy.resolve(args.all_reduce, self.device, self.parallel.num_nodes)
        self.workers: WorkerGroup | None = None
        self.cache = CacheConfig.from_args(args)
        self.scheduler = SchedulerConfig.from_args(args, args.max_model_len)  # again once the context length is known
        self.platform: Platform = platform_for_device(self.device.type)  # a CPU device on a CUDA machine: the CPU's
        self.source: WeightFormat | None = None
        self.config: ModelConfig | None = None
        self.torch_model: torch.nn.Module | None = None
        self.isq_report: isq.IsqReport | None = None  # what --isq did, once the model is loaded
        #: hybrid models (linear-attention layers): the per-layer state specs and the slot count
        self.state_specs: list[state_cache.StateCacheSpec] = []
        self.num_state_slots = 0
        self.vision: VisionSpec | None = None  # how the model takes images (a vision model, once loaded)

    # --- steps ---------------------------------------------------------------------------
    def open_source(self) -> WeightFormat:
        """Resolve ``model``/``weights``/``file`` to a local path and open its weight format."""
        self.source_path, self.source = model_loading.open_source(self.args)
        return self.source

    def model_config(self) -> ModelConfig:
        """The model's config (and its tokenizer and generation config) for this device."""
        source = self.source or self.open_source()
        setup = model_loading.read_model_config(source, self.args, self.device, self.source_path)
        self.config, self._tokenizer, self._generation = setup
        self.scheduler = SchedulerConfig.from_args(self.args, self.config.max_model_len)
        return self.config

    def load_model(self) -> torch.nn.Module:
        """Build the architecture's class and stream the weights in."""
        config = self.config or self.model_config()
        model_cls = registries.model_architectures(self.platform).get(config.architecture).load()
        quant_config = resolve_quant_config(
            self.source, config, self.args.quantization, self.platform, self.device, model_cls, self.args.isq
        )
        self.isq_report = None if self.args.isq is None else isq.IsqReport(self.args.isq)
        started = time.perf_counter()
        self.torch_model = model_loading.load_model(
            model_cls, config, quant_config, self.source, self.device, self.args.seed, self.isq_report
        )
        self.load_seconds = time.perf_counter() - started
        self.vision = model_loading.vision_spec(model_cls, config, self.source_path, self.source)
        return self.torch_model

    def release_model(self, error: BaseException | None = None) -> None:
        """Drop the (partly) built model and return its device memory: after a failed step nothing
        stays half-loaded, even while the caller holds ``error`` (whose finished frames lose their locals)."""
        self.torch_model = None
        model_loading.release_device_memory(self.device, error)

    def attention_layers(self) -> list[AttentionLayerConfig]:
        model = self.torch_model or self.load_model()
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        return [m.config for m in sorted(layers, key=lambda m: m.layer_index)]

    def select_attention_backend(self) -> AttentionBackend:
        """Choose among backends that validate (:mod:`~framework.engine.attention_choice`) and set it up."""
        layers = self.attention_layers()
        self.kv_dtype = kv_cache_sizing.effective_kv_dtype(layers, self.cache.cache_dtype, self.platform)
        self.backend_name = choose_attention_backend(
            layers, self.config, self.kv_dtype.name, self.args.attention_backend, self.platform
        )
        backend = registries.attention_backends(self.platform).get(self.backend_name).load()()
        backend.initialize(layers, self.config.dtype, self.cache.block_size, self.device)
        return backend

    def plan_state_cache(self) -> None:
        """A hybrid model's state cache: its layers' specs and how many sequences get a slot
        (:func:`~framework.engine.state_cache.num_state_slots`); prefix caching turned off (see
        :mod:`~framework.engine.state_cache`). Nothing for a model without linear-attention layers."""
        model = self.torch_model or self.load_model()
        self.state_specs = state_cache.state_cache_specs(model, self.config.dtype)
        if not self.state_specs:
            return
        budget = None if self.cache.num_blocks else kv_cache_sizing.kv_budget_bytes(self.cache, self.device)
        per_slot = sum(spec.bytes_per_slot for spec in self.state_specs)
        slots = state_cache.num_state_slots(self.scheduler.max_num_seqs, per_slot, budget)
        self.num_state_slots = distributed.min_over_ranks(slots)  # every rank serves the same sequences
        state_cache.log_plan(self.state_specs, self.num_state_slots, self.scheduler.max_num_seqs)
        if self.cache.enable_prefix_caching:
            state_cache.log.info(
                "prefix caching is off: this model's linear-attention layers keep a state per sequence"
            )
            self.cache.enable_prefix_caching = False

    @property
    def state_cache_bytes(self) -> int:
        return self.num_state_slots * sum(spec.bytes_per_slot for spec in self.state_specs)

    def allocate_kv_cache(self, backend: AttentionBackend) -> list[KVCache]:
        """Size the KV cache to its budget (:mod:`~framework.engine.kv_cache_sizing`), less what a
        hybrid model's state cache takes, and allocate it."""
        config, cache, layers = self.config, self.cache, self.attention_layers()
        specs = [backend.kv_cache_spec(layer, self.kv_dtype, config.dtype, cache.block_size) for layer in layers]
        per_block = kv_cache_sizing.bytes_per_block(specs)
        num_blocks = kv_cache_sizing.num_kv_blocks(
            cache,
            self.device,
            per_block,
            config.max_model_len,
            self.scheduler.max_num_seqs,
            reserved_bytes=self.state_cache_bytes,
        )
        kv_cache_sizing.warn_if_short(num_blocks, cache.block_size, config.max_model_len)
        caches = kv_cache_sizing.allocate_kv_caches(specs, num_blocks, self.device)
        kv_cache_sizing.load_checkpoint_scales(self.torch_model, caches)
        self.num_blocks = num_blocks
        self.kv_cache_bytes = per_block * num_blocks
        return caches

    def capture_cuda_graphs(
        self, backend: AttentionBackend, kv_caches: list[KVCache], state_caches: list | None = None
    ) -> CUDAGraphRunner | None:
        """Capture decode graphs when on CUDA, enabled, and the backend allows it (a hybrid model's
        graphs carry its state slots: at most ``num_state_slots`` rows)."""
        max_num_seqs = self.scheduler.max_num_seqs
        if self.state_specs:
            max_num_seqs = min(max_num_seqs, self.num_state_slots)
        graphs, self.graph_summary = capture_decode_graphs(
            self.torch_model,
            backend,
            self.backend_name,
            kv_caches,
            enabled=self.args.enable_cuda_graphs,
            max_num_seqs=max_num_seqs,
            max_model_len=self.config.max_model_len,
            block_size=self.cache.block_size,
            sink_block=self.num_blocks,
            device=self.device,
            state_caches=state_caches,
            spare_state_slot=self.num_state_slots,
        )
        return graphs

    def start_tensor_parallel(self) -> None:
        """Join the tensor-parallel group (no-op with one rank); rank 0 first starts its node's workers.

        Refuses, before any process starts, an architecture that cannot be sharded.
        """
        parallel = self.parallel
        if not parallel.is_parallel:
            return
        config = self.config or self.model_config()
        spec = registries.model_architectures(self.platform).get(config.architecture)
        tensor_parallel_start.prepare_group(parallel, self.device, config.architecture, spec.supports_tensor_parallel)
        if ranks := tensor_parallel_start.workers_to_spawn(parallel):
            self.workers = spawn_workers(self.worker_args(), ranks)
        tensor_parallel_start.init_group(
            parallel, self.device, self.workers, self.all_reduce_policy, config, self.scheduler.max_num_seqs
        )

    def worker_args(self) -> EngineArgs:
        """This engine's options as another rank of the group gets them (the settled port and size)."""
        return tensor_parallel_start.worker_args(self.args, self.parallel, self.device)

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
            tensor_parallel_start.enable_fused_norm(
                self.all_reduce_policy, self.torch_model, config, self.scheduler.max_num_seqs
            )
        backend = self.select_attention_backend()
        self.plan_state_cache()
        with out_of_memory_names_the_flag("allocating the KV cache"):
            kv_caches = self.allocate_kv_cache(backend)
            states = state_cache.allocate_state_caches(self.state_specs, self.num_state_slots, self.device)
        with out_of_memory_names_the_flag("capturing CUDA graphs"):
            graphs = self.capture_cuda_graphs(backend, kv_caches, states)
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
            state_caches=states,
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
            worker_error = tensor_parallel_start.leave_after_failure(self.workers, error)
            self.release_model(error)
            if worker_error is not None:
                raise worker_error from error
            raise
        engine_config = EngineConfig(
            config, self.cache, self.scheduler, str(self.device), self.backend_name, self.args.seed
        )
        kv_manager = KVCacheManager.for_cache(self.num_blocks, self.cache)
        slots = state_cache.StateSlotManager(self.num_state_slots) if self.state_specs else None
        core = EngineCore(
            engine_config,
            runner,
            kv_manager,
            structured_outputs=grammars,
            async_scheduling=async_scheduling,
            state_slots=slots,
        )
        summary = engine_summary(self, core)
        log_summary(self, summary)
        return Engine(
            core, self._tokenizer, config, self._generation, self.backend_name, summary, self.workers, self.vision
        )
