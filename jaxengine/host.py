"""One model's engine in this process, built once from ``EngineArgs`` for both fronts, the offline
``LLM`` and the server's ``AsyncEngine``: the model (and a speculative proposer's) on its mesh,
the tokenizer, the ``EngineConfig`` the options resolve to, the runner and the engine of each
data-parallel replica, the autopilot, and across processes the step channel; and the request
intake both fronts use (checks, queueing, LoRA adapters, prompt encoding)."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxengine.autopilot import attach_autopilot
from jaxengine.core.structured_output import GrammarCompiler
from jaxengine.engine import Engine
from jaxengine.engine_args import EngineArgs
from jaxengine.generation_config import generation_defaults
from jaxengine.kernels.matmul.openblas import use_cpu_matmul_kernels
from jaxengine.kernels.paged_attention.backend import select_attention
from jaxengine.lora_request import LoRARequest
from jaxengine.models.config import ModelConfig
from jaxengine.models.lora_weights import attach_lora
from jaxengine.models.mesh import check_replica_devices, kv_head_repeats, make_mesh, replica_devices
from jaxengine.models.recurrent import set_form as set_recurrent_form
from jaxengine.output_processor import beam_stop_check
from jaxengine.parallel import multihost
from jaxengine.parallel.data_parallel import DataParallelEngine
from jaxengine.parallel.step_channel import StepChannel
from jaxengine.request import LatencyTargets, Request
from jaxengine.runner.kernel_check import check_model_kernels
from jaxengine.runner.model_runner import ModelRunner
from jaxengine.sampling_params import BeamSearchParams, SamplingParams
from jaxengine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class EngineHost:
    """The engine of one model, built from ``EngineArgs`` (see the module's docstring). ``LLM``
    is this with the blocking ``generate``/``chat``/``beam_search``; the server's
    ``AsyncEngine`` drives one from its engine thread."""

    def __init__(self, args: EngineArgs, *, module=None, model_config: ModelConfig | None = None,
                 progress: bool = True) -> None:
        """Build the engine of ``args`` (``module``: an already built model with its
        ``model_config``, for benchmarks on random weights). ``progress``: show loading and
        compilation progress."""
        self.distributed = multihost.initialize(args)       # before any other JAX use
        if self.distributed is not None:
            if self.distributed.is_worker:
                raise RuntimeError(f"process {self.distributed.process_id} of a distributed job runs process "
                                   f"0's steps: call jaxengine.multihost_worker.run_worker(engine_args) there "
                                   f"(python -m jaxengine.serve does it)")
            if module is not None:
                raise ValueError("model: across processes the model loads from a checkpoint, not a module")
            if args.data_parallel_size > 1:
                raise ValueError("data_parallel_size: across processes the job is one replica over every "
                                 "process's devices; run one job per replica instead")
            args = multihost.engine_args_for_job(args)
        self._build(args, module, model_config, progress)
        engines = [self._engine(self.runner, 0)] + [
            self._engine(self._runner(self._replica_model(self._module_copies, r, mesh, progress), mesh, progress), r)
            for r, mesh in enumerate(self._meshes[1:], 1)]
        self._attach_autopilots(engines, progress)
        self.engine = engines[0] if len(engines) == 1 else DataParallelEngine(engines)
        self.loras: dict[str, LoRARequest] = {}      # adapters served by name (lora_modules, add_lora)
        self._lora_ids = itertools.count(1)
        for name, path in args.named_lora_modules().items():
            self.load_lora(name, path)
        if self.channel is not None:
            self.runner.channel = self.channel      # from now on each launch goes to the others too

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, progress: bool = True) -> "EngineHost":
        return cls(engine_args, progress=progress)

    @classmethod
    def for_worker(cls, engine_args: EngineArgs, *, progress: bool = False) -> "EngineHost":
        """On a process other than 0 of a distributed job: the model's share and the compiled
        steps only (no tokenizer, scheduler or engine), ready for ``multihost_worker.Worker``."""
        self = cls.__new__(cls)
        self.distributed = multihost.initialize(engine_args)
        if self.distributed is None or not self.distributed.is_worker:
            raise ValueError("EngineHost.for_worker: for processes other than 0 of a distributed job")
        self._build(dataclasses.replace(multihost.engine_args_for_job(engine_args), skip_tokenizer_init=True),
                    None, None, progress)
        return self

    def _attach_autopilots(self, engines: list[Engine], progress: bool) -> None:
        """With latency targets: each replica's autopilot, on the configured cost profile or on
        one calibrated now on the first replica (after every bucket is compiled: a compile on the
        same cores would skew the times)."""
        if self.config.autopilot is None:
            return
        profile = None
        for engine in engines:
            if profile is None and self.config.autopilot.cost_profile is None:
                self.wait_until_compiled()
            profile = attach_autopilot(engine, profile, progress=progress).cost.profile

    def _build(self, args: EngineArgs, module, model_config: ModelConfig | None, progress: bool) -> None:
        """The first replica's model on its mesh, the engine configuration and its runner with
        the compiled steps (and, across processes, the channel to the others, warmed up)."""
        self.engine_args = args
        use_cpu_matmul_kernels(args.cpu_matmul_kernels)       # before any model is built
        self._meshes = _replica_meshes(args.tensor_parallel_size, args.data_parallel_size)
        self.mesh = self._meshes[0]
        self._load(args, module, model_config, progress)
        self.generation_defaults = generation_defaults(args.generation_config, self.model_path)
        if self.generation_defaults:
            logger.info("request defaults from the checkpoint's generation_config.json: %s", self.generation_defaults)
        self._load_draft(args, progress)
        self._module_copies = _copies(module, len(self._meshes) - 1)    # before the first runner shards it
        self.config = args.create_engine_config(self.model_config, devices=list(self.mesh.devices.flat),
                                                draft_config=self.draft_config, dtype=self.dtype)
        self.kv_dtype = jnp.dtype(self.config.runner.kv_dtype)
        # What the check found (the server's /health and /metrics show it).
        self.kernel_check = check_model_kernels(self.model, self.model_config, args.block_size, self.dtype,
                                                kv_dtype=self.kv_dtype,
                                                enabled=False if args.skip_kernel_check else None)
        if self.distributed is not None:
            multihost.check_same_kernels(self.model)
        self.grammar_compiler = None if self.tokenizer is None else GrammarCompiler(
            self.tokenizer, self.model_config.vocab_size, self._eos_token_id())
        if self.config.lora is not None and self.distributed is not None:
            raise ValueError("enable_lora: adapters are served by one process (a job over several processes "
                             "does not load them yet)")
        self._log_kv_cache()
        self.runner = self._runner(self.model, self.mesh, progress)   # the first replica's under data parallelism
        self.channel = None
        if self.distributed is not None:
            self.channel = StepChannel(self.runner, self.distributed)
            self.channel.warm_up()

    def _load_draft(self, args: EngineArgs, progress: bool) -> None:
        """The draft model of ``speculative_config`` method draft_model (on the model's mesh) or
        eagle3 (its head, placed by the drafter), in the model's dtype; its vocabulary must be the
        model's."""
        from jaxengine.config import MODEL_PROPOSERS
        from jaxengine.models.eagle3 import load_eagle3
        from jaxengine.models.weights import load_model

        self.draft_model = self.draft_config = None
        spec = args.speculative()
        if spec is None or spec.method not in MODEL_PROPOSERS:
            return
        if args.data_parallel_size > 1 or self.distributed is not None:
            raise ValueError("speculative_config.model: a draft model runs in one process on one replica "
                             "(data_parallel_size 1, one process)")
        start = time.perf_counter()
        attention_fn = select_attention(args.attention_backend)
        if spec.method == "mtp":
            from jaxengine.models.weights import load_mtp

            if self.model_path.suffix == ".gguf" or not self.model_path.is_dir():
                raise ValueError("speculative_config.method: 'mtp' reads the model's checkpoint folder's "
                                 "multi-token prediction layer (a safetensors folder)")
            self.draft_model, self.draft_config = load_mtp(self.model_path, self.model, self.model_config, self.dtype,
                                                           mesh=self.mesh, attention_fn=attention_fn, **_layout(args))
            return
        if spec.method == "eagle3":
            self.draft_model, self.draft_config = load_eagle3(Path(spec.model), self.model, self.dtype, attention_fn)
            if kv_head_repeats(self.draft_config.layer, args.tensor_parallel_size) > 1:
                raise ValueError(f"tensor_parallel_size: the EAGLE-3 head's {self.draft_config.layer.num_kv_heads} "
                                 f"KV heads cannot be split {args.tensor_parallel_size} ways")
        else:
            self.draft_model, self.draft_config = load_model(Path(spec.model), self.dtype, mesh=self.mesh,
                                                             attention_fn=attention_fn, **_layout(args))
        if self.draft_config.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"speculative_config.model: the draft model's vocabulary has "
                             f"{self.draft_config.vocab_size} tokens, the model's {self.model_config.vocab_size}: "
                             f"a draft must share the model's tokenizer")
        if progress:
            print(f"jaxengine: loaded the draft model {Path(spec.model).name} in {time.perf_counter() - start:.1f} s",
                  flush=True)

    def _log_kv_cache(self) -> None:
        cc = self.config.cache
        per_block = self.engine_args.kv_bytes_per_block(self.model_config, self.kv_dtype, self.draft_config)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB per device), %s, %d tokens per GiB", cc.num_gpu_blocks,
                    cc.block_size, cc.num_gpu_blocks * per_block / (1 << 20), self.kv_dtype.name,
                    self.kv_cache_capacity()["tokens_per_gib"])

    def kv_cache_capacity(self) -> dict[str, int]:
        """The KV pool's ``tokens`` (one replica's) and ``tokens_per_gib`` (tokens one GiB of a
        device's memory holds: what a token costs there, latent attention's cache included)."""
        cc = self.config.cache
        per_block = self.engine_args.kv_bytes_per_block(self.model_config, self.kv_dtype, self.draft_config)
        # A token of a long sequence takes a block's place in each full-attention group (a sliding
        # group holds a window's whatever the length; a model whose every layer slides, in each group).
        places = sum(w is None for w in cc.group_windows) or len(cc.group_windows)
        return {"tokens": cc.num_gpu_blocks * cc.block_size // places,
                "tokens_per_gib": (1 << 30) * cc.block_size // (per_block * places)}

    def _engine(self, runner: ModelRunner, replica: int) -> Engine:
        rc = self.config.runner
        return Engine(self.config, runner, eos_token_id=self._eos_token_id(), async_scheduling=rc.async_scheduling,
                      trace_file=rc.trace_file(replica), grammar_compiler=self.grammar_compiler)

    def _runner(self, model, mesh, progress: bool) -> ModelRunner:
        args, rc = self.engine_args, self.config.runner
        spec = self.config.speculative
        draft = None if self.draft_model is None else (self.draft_model, self.draft_config, spec.num_speculative_tokens,
                                                       spec.draft_sampling == "sampled")
        lora = self.config.lora
        targets = None if lora is None else attach_lora(model, lora.max_loras, lora.max_lora_rank, self.dtype)
        set_recurrent_form(model, args.recurrent_form)
        return ModelRunner(model, self.model_config, self.config, dtype=self.kv_dtype, warm_up=args.warm_up,
                           progress=progress, mesh=mesh, compile_mode=rc.compile_mode, draft=draft,
                           lora_targets=targets)

    def _replica_model(self, modules: list, replica: int, mesh, progress: bool):
        """Data-parallel replica ``replica``'s model: a copy of the given module, or the
        checkpoint read again straight into its shardings on ``mesh``."""
        if modules:
            return self.kernel_check.apply(modules[replica - 1])      # copied before the check
        from jaxengine.models.weights import load_model

        start = time.perf_counter()
        model, _ = load_model(self.model_path, self.dtype, mesh=mesh,
                              attention_fn=select_attention(self.engine_args.attention_backend),
                              **_layout(self.engine_args))
        if progress:
            print(f"jaxengine: loaded replica {replica} in {time.perf_counter() - start:.1f} s", flush=True)
        return self.kernel_check.apply(model)

    def _load(self, args: EngineArgs, module, model_config: ModelConfig | None, progress: bool) -> None:
        from jaxengine.default_model import default_model_path
        from jaxengine.models.weights import checkpoint_dtype, load_model

        if module is not None:
            if model_config is None:
                raise ValueError("model_config: required with a model module")
            if kv_head_repeats(model_config, args.tensor_parallel_size) > 1:
                raise ValueError(f"tensor_parallel_size: a model module with {model_config.num_kv_heads} KV heads "
                                 f"cannot be split {args.tensor_parallel_size} ways; load it from a checkpoint, "
                                 f"which repeats its KV heads")
            self.model_path, self.model, self.model_config, self.tokenizer = Path("<module>"), module, model_config, None
            self.dtype = args.resolve_model_dtype(built=_module_dtype(module))
            return
        path = default_model_path(progress) if args.model is None else Path(args.model)
        self.model_path = path
        self.dtype = args.resolve_model_dtype(lambda: checkpoint_dtype(path))
        start = time.perf_counter()
        self.model, self.model_config = load_model(path, self.dtype, mesh=self.mesh,
                                                   attention_fn=select_attention(args.attention_backend),
                                                   **_layout(args))
        if progress:
            print(f"jaxengine: loaded {path.name} ({self.dtype.name}) in {time.perf_counter() - start:.1f} s",
                  flush=True)
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(path)

    def _eos_token_id(self) -> int | None:
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        eos = eos if eos is not None else self.model_config.eos_token_id
        return eos[0] if isinstance(eos, list) else eos

    # ---- the built engine ----
    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Wait until every step bucket is compiled (``compile_mode="background"`` compiles most
        of them while the engine already serves); benchmarks call it before measuring. False if
        ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(r.wait_until_compiled(None if deadline is None else max(0.0, deadline - time.monotonic()))
                   for r in self.runners)

    def compile_progress(self) -> tuple[int, int]:
        """(step buckets compiled, step buckets), over every replica."""
        return (sum(r.num_compiled_buckets for r in self.runners),
                sum(len(r.bucket_pairs()) for r in self.runners))

    @property
    def runners(self) -> list[ModelRunner]:
        """Every replica's runner."""
        engine = getattr(self, "engine", None)
        return [e.runner for e in engine.replicas] if isinstance(engine, DataParallelEngine) else [self.runner]

    # ---- the request intake both fronts use ----
    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams | BeamSearchParams, *,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None,
                    slo: LatencyTargets | None = None, lora_request: LoRARequest | None = None) -> Request:
        """Queue one request on the engine (``check_request`` it first); the caller steps the engine.
        ``arrival_time`` (the engine's clock, default now): when the request came in; ``slo``: its own
        latency targets for the autopilot."""
        stop_check = None
        if isinstance(params, BeamSearchParams):   # a beam's stop strings are checked as the search decides
            stop_check = beam_stop_check(self.tokenizer, params.sampling_params())
        return self.engine.add_request(request_id, token_ids, params, priority=priority, cache_salt=cache_salt,
                                       arrival_time=arrival_time, stop_check=stop_check, slo=slo,
                                       lora_request=lora_request)

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Serve an adapter by its name (read now: a bad one is a ValueError naming the file and
        field, and nothing changes). -> the request that selects it."""
        if lora_request.lora_name in self.loras:
            raise ValueError(f"lora_name: an adapter named {lora_request.lora_name!r} is already loaded")
        self.engine.read_adapter(lora_request)
        self.loras[lora_request.lora_name] = lora_request
        return lora_request

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """``add_lora`` under an id no adapter has had here (what the server's load endpoint does)."""
        used = {r.lora_int_id for r in self.loras.values()}
        for runner in self.runners:
            used.update(getattr(runner.lora, "paths", ()))
        lora_int_id = next(i for i in self._lora_ids if i not in used)
        return self.add_lora(LoRARequest(name, lora_int_id, path))

    def remove_lora(self, name: str) -> bool:
        """Stop serving an adapter by name (requests running with it finish); False if unknown."""
        request = self.loras.pop(name, None)
        if request is None:
            return False
        for engine in getattr(self.engine, "replicas", [self.engine]):
            if (slots := getattr(engine.runner, "lora", None)) is not None:
                slots.forget(request.lora_int_id)
        return True

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without sampling parameters gets: the checkpoint's generation defaults
        (``generation_config``) over the engine's."""
        return SamplingParams(**self.generation_defaults)

    def encode(self, prompt) -> list[int]:
        """Text -> token ids with the model's tokenizer; token-id lists pass through."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError("prompt: text needs a tokenizer (skip_tokenizer_init=True): pass token ids")
        return self.tokenizer.encode(prompt)

    def check_constraint(self, params: SamplingParams | BeamSearchParams) -> None:
        """Compile the request's structured-output grammar now (cached for the engine); a
        ValueError naming the field if it is invalid. The server skips this: there the engine
        compiles off its thread and an invalid constraint fails its request alone."""
        if params.structured_outputs is not None and self.grammar_compiler is not None:
            self.grammar_compiler.submit(params.structured_outputs).result()

    def check_request(self, ids: list[int], params: SamplingParams | BeamSearchParams) -> None:
        """Raise ValueError naming the field if this request can never be served."""
        if isinstance(params, BeamSearchParams):
            if self.config.speculative is not None:
                raise ValueError("speculative_config: beam search does not run with speculative decoding (this "
                                 "engine was started with it); start one without speculative_config")
            params = params.sampling_params()
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("prompt: must not be empty")
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary of {vocab} tokens")
        if bad := [t for t in params.stop_token_ids if t >= vocab]:
            raise ValueError(f"stop_token_ids: {bad[:5]} outside the vocabulary of {vocab} tokens")
        if bad := [t for t in (params.logit_bias or {}) if t >= vocab]:
            raise ValueError(f"logit_bias: token ids {bad[:5]} outside the vocabulary of {vocab} tokens")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (skip_tokenizer_init=True); use stop_token_ids")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError(f"{params.structured_outputs.field}: structured output needs a tokenizer "
                             f"(skip_tokenizer_init=True)")
        if params.n > self.config.scheduler.max_num_seqs:
            raise ValueError(f"n: {params.n} samples can never run together (max_num_seqs="
                             f"{self.config.scheduler.max_num_seqs})")
        limit = self.config.scheduler.max_model_len     # prompt + output <= limit, as the scheduler caps it
        if len(ids) >= limit:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room for output within the maximum "
                             f"context length of {limit} tokens")
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise ValueError(f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{len(ids) + params.max_tokens} exceeds the maximum context length of {limit} "
                             f"tokens")
        if len(ids) + params.min_tokens > limit:        # without max_tokens: the context length ends it first
            raise ValueError(f"min_tokens: prompt ({len(ids)} tokens) + min_tokens ({params.min_tokens}) = "
                             f"{len(ids) + params.min_tokens} exceeds the maximum context length of {limit} "
                             f"tokens")


def _layout(args: EngineArgs) -> dict:
    """How the model lays its weights out (over the mesh, beyond tensor parallelism's defaults;
    quantized or not)."""
    return {"expert_parallel": args.enable_expert_parallel, "quantization": args.quantization,
            "latent_attention_form": args.latent_attention_form}


def _replica_meshes(tensor_parallel_size: int, data_parallel_size: int) -> list:
    """One mesh per data-parallel replica, each on its own ``tensor_parallel_size`` devices."""
    if data_parallel_size > 1:
        check_replica_devices(tensor_parallel_size, data_parallel_size)
    return [make_mesh(replica_devices(tensor_parallel_size, r)) for r in range(data_parallel_size)]


def _copies(module, n: int) -> list:
    """``n`` copies of a model module (none for a checkpoint, which each replica reads itself)."""
    if module is None or n == 0:
        return []
    from flax import nnx

    return [nnx.clone(module) for _ in range(n)]


def _module_dtype(module) -> str:
    """The dtype an already built model holds its parameters in."""
    from flax import nnx

    return jax.tree.leaves(nnx.state(module, nnx.Param))[0].dtype.name
