"""The model runner: SchedulerOutput -> padded bucketed arrays -> one jitted step -> sampled tokens."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxengine.config import EngineConfig
from jaxengine.core.kv_cache_manager import cdiv
from jaxengine.core.scheduler_output import BlockMoves, ModelRunnerOutput, SchedulerOutput, StepLimits
from jaxengine.models.config import ModelConfig
from jaxengine.models.eagle3 import Eagle3Config
from jaxengine.models.mtp import MTPConfig
from jaxengine.models.forward import make_forward
from jaxengine.models.llama import init_kv_caches
from jaxengine.models.hybrid import init_state_pools
from jaxengine.models.mesh import kv_cache_sharding, place_model, replicated, shard_kernels
from jaxengine.buckets import step_buckets
from jaxengine.runner.compile import COMPILE_MODES, BackgroundCompiler, compile_stages, limits_of, step_pairs
from jaxengine.runner.compile_cache import enable_persistent_cache
from jaxengine.runner.input_batch import InputBatch, StepInputs
from jaxengine.runner.kv_cache import BlockMover
from jaxengine.runner.lora_slots import LoRASlots
from jaxengine.sample.metadata import SamplingMetadata
from jaxengine.sample.sampler import SamplerOutput, logprobs_of, sample
from jaxengine.sampling_params import MAX_LOGPROBS
from jaxengine.spec_decode.drafter import Drafter, ProposalRows
from jaxengine.spec_decode.eagle_drafter import EagleDrafter
from jaxengine.spec_decode.ngram import NgramProposer
from jaxengine.spec_decode.verify import verify_drafts

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05      # an empty step waits this long at most for buckets still compiling


def _sample_head(model, hidden, logits_indices, smd: SamplingMetadata, prompt_lp_want, prompt_lp_target,
                 *sampled_drafts, max_rows: int):
    """Sample the rows asked for; score prompt tokens only in steps where a request wants
    prompt logprobs (full-width logits for every token are costly). The sampled tokens also come
    back padded to ``max_rows``: the next step's input when it is launched before they are read.
    ``sampled_drafts``: (the drafter's distributions [rows, k, V], ``StepInputs.sampled_drafts``)."""
    drafts = None
    if sampled_drafts:
        probs, refs = sampled_drafts
        drafts = (refs[0], probs.reshape(-1, probs.shape[-1])[refs[1]])
    result = sample(model.compute_logits(hidden[logits_indices]), smd, MAX_LOGPROBS, drafts)
    next_tokens = jnp.zeros(max_rows, jnp.int32).at[:result.token_ids.shape[0]].set(result.token_ids)
    t = hidden.shape[0]
    nothing = (jnp.zeros(t, jnp.float32), jnp.zeros((t, MAX_LOGPROBS), jnp.int32),
               jnp.zeros((t, MAX_LOGPROBS), jnp.float32))
    prompt_lp = jax.lax.cond(jnp.any(prompt_lp_want),
                             lambda: logprobs_of(model.compute_logits(hidden), prompt_lp_target, MAX_LOGPROBS),
                             lambda: nothing)
    return result, prompt_lp, next_tokens


class PendingStep:
    """A launched step; ``result()`` waits for the device and returns the sampled tokens."""

    def __init__(self, runner: "ModelRunner", out: SchedulerOutput, inputs, slots, device_result) -> None:
        self.runner, self.out, self.inputs, self.slots, self.device_result = runner, out, inputs, slots, device_result
        self._result: ModelRunnerOutput | None = None if inputs is not None else ModelRunnerOutput([])

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            self._result = self.runner._collect(self)
        return self._result


class CompilationError(RuntimeError):
    """A compilation after start-up while compilations are forbidden."""


class ModelRunner:
    """Runs the steps on a device ``mesh`` (the engine always gives one, of one device or more):
    the model's parameters sit in their shardings, its kernels run per shard, the KV cache is
    split on its KV-head axis, and every host input and sampled result is replicated.
    ``model_config`` is the model as the mesh runs it (``models.mesh.mesh_model_config``).
    Without a mesh the runner takes the unsharded path on the default device (the baseline
    that scripts/bench_sharding.py measures the mesh against)."""

    def __init__(self, model, model_config: ModelConfig, config: EngineConfig, *, dtype=jnp.float32,
                 warm_up: bool = True, progress: bool = True, token_buckets: list[int] | None = None,
                 request_buckets: list[int] | None = None, mesh: Mesh | None = None, compile_mode: str = "eager",
                 before_compile: Callable[[tuple[int, int]], None] | None = None, draft=None,
                 lora_targets: tuple[str, ...] | None = None) -> None:
        """``warm_up``: compile the step buckets and block moves at start-up, every one before
        returning (``compile_mode="eager"``) or the smallest bucket now and the others on a thread
        (``"background"``, ``compile_in_background``; ``before_compile`` runs there before each).
        Without it each compiles on first use, counted in ``num_compiles``. ``draft``: (the draft
        model, its config, k, sampled) of the ``draft_model``, ``eagle3`` or ``mtp`` proposer
        (``spec_decode.drafter``), whose steps compile with these, and whether it samples its
        drafts; the ``ngram`` proposer comes from ``config.speculative``. With either, each step
        proposes after it samples (``out.propose``) and returns the drafts in its output. ``lora_targets``: the modules the
        model has LoRA slots for (``models.lora.attach_lora``; with ``config.lora``)."""
        sc, cc = config.scheduler, config.cache
        self.mesh = mesh
        self._replicated = None if mesh is None else replicated(mesh)
        if mesh is not None:
            shard_kernels(model, mesh)
            place_model(model, mesh)
        self.block_size = cc.block_size
        if token_buckets is None and request_buckets is None:        # the configuration's (``EngineArgs``)
            self.token_buckets, self.request_buckets = config.step_buckets()
        else:
            self.token_buckets, self.request_buckets = step_buckets(sc.max_num_batched_tokens, sc.max_num_seqs,
                                                                    token_buckets, request_buckets)
        self.batch = InputBatch(sc.max_num_seqs, sc.max_model_len, cdiv(sc.max_model_len, cc.block_size),
                                cc.block_size, self.token_buckets, self.request_buckets, placement=self._replicated,
                                num_groups=len(model_config.kv_groups), with_states=model_config.is_hybrid,
                                snapshot_interval=cc.state_snapshot_interval if cc.enable_prefix_caching else 0,
                                vocab_size=model_config.vocab_size,
                                num_lora_slots=0 if config.lora is None else config.lora.max_loras)
        self.kv_caches = init_kv_caches(model_config, cc.num_gpu_blocks, cc.block_size, dtype, grouped=True,
                                        sharding=None if mesh is None else kv_cache_sharding(mesh, model_config))
        # A hybrid model's recurrent state pools ride after the KV arrays (``models.qwen3_5``).
        self.num_kv_arrays = len(self.kv_caches)
        self.state_mover = None
        if model_config.is_hybrid:
            self.kv_caches += init_state_pools(model_config, cc.num_state_slots, self._replicated)
            self.state_mover = BlockMover(cc.num_state_slots, cc.num_cpu_state_slots,
                                          tuple((n,) for n in model_config.state_slot_sizes()),
                                          len(model_config.linear_attention_layers), jnp.float32, sc.max_num_seqs,
                                          on_compile=self._note_compile, mesh=mesh)

        def make_mover(shapes, num_layers, kv_dtype) -> BlockMover:
            """The block moves of a cache of these blocks (the model's, a drafter's)."""
            return BlockMover(cc.num_gpu_blocks, cc.num_cpu_blocks, shapes, num_layers, kv_dtype, sc.max_num_seqs,
                              on_compile=self._note_compile, mesh=mesh)
        self.mover = make_mover(model_config.kv_block_shapes(cc.block_size), model_config.kv_group_size,
                                self.kv_caches[0].dtype)
        spec = config.speculative
        self.ngram = None if spec is None or spec.method != "ngram" else NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
        self.drafter = None
        if draft is not None:
            draft_model, draft_config, k, sampled = draft
            drafter = EagleDrafter if isinstance(draft_config, (Eagle3Config, MTPConfig)) else Drafter
            self.drafter = drafter(draft_model, draft_config, k=k, num_gpu_blocks=cc.num_gpu_blocks,
                                   block_size=cc.block_size, max_blocks_per_seq=cdiv(sc.max_model_len, cc.block_size),
                                   row_buckets=self.request_buckets, dtype=dtype, make_mover=make_mover,
                                   mesh=mesh, on_compile=self._note_compile, sampled=sampled)
        aux_layers = getattr(self.drafter, "aux_layers", ())
        self.batch.with_following_ids = bool(aux_layers)
        max_rows = self.request_buckets[-1]
        self.state, self.step_fn = make_forward(model, head=functools.partial(_sample_head, max_rows=max_rows),
                                                mesh=mesh, expert_counts=True, aux_layers=aux_layers)
        self.lora = None if config.lora is None else LoRASlots(config.lora, model_config, lora_targets)
        if self.lora is not None:
            self.state = self.lora.write(self.state, 0, None)      # compiles the slot writes now
        self._previous_tokens = self._zero_tokens(max_rows)      # the last launched step's tokens
        self._uncollected: collections.deque[PendingStep] = collections.deque()
        self.num_compiles = 0            # compilations after start-up
        self.device_wait_s = 0.0         # time blocked on the device's results (the rest is host work)
        self.num_launches = 0
        self.num_idle_launches = 0       # launched when no earlier step was still computing
        self.idle_s = 0.0                # device idle before those launches, from the last result read
        self._last_ready: float | None = None
        self.forbid = False
        # Under several processes (process 0 only): sends each launch's moves and inputs to the
        # others and watches for a peer that is gone (``parallel.step_channel.StepChannel``).
        self.channel = None
        # (tokens, rows) -> step. A background compile adds an entry once its compile is done, and
        # raises the limits once a stage's entries are all in.
        self._executables: dict[tuple[int, int], jax.stages.Compiled] = {}
        self._limits = limits_of((self.token_buckets[-1], self.request_buckets[-1]))
        self._compiler: BackgroundCompiler | None = None
        # Steps compile against the caches' shapes: a background compile must not touch the
        # caches themselves, which each step donates.
        self._kv_spec = jax.tree.map(lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=c.sharding),
                                     self.kv_caches)
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode: must be one of {list(COMPILE_MODES)}, got {compile_mode!r}")
        if warm_up:
            enable_persistent_cache()
            if compile_mode == "eager":
                self.compile_all(progress)
            else:
                self.compile_in_background(progress, before_compile)

    # ---- compilation ----
    def bucket_pairs(self) -> list[tuple[int, int]]:
        """Every (token bucket, row bucket) a step can pad to (``buckets.step_bucket``). Rows
        count samples too: one short prompt with n = 32 pads to 32 tokens and 32 rows."""
        return step_pairs(self.token_buckets, self.request_buckets)

    def compile_all(self, progress: bool = True) -> None:
        """Compile ahead of time an executable per bucket and the block moves; a compiled
        executable never compiles again, so a step can only compile by reaching a bucket that
        has none."""
        start = time.perf_counter()
        self._compile_moves()
        stages = compile_stages(self.token_buckets, self.request_buckets)
        pairs = [pair for stage in stages for pair in stage.pairs]
        for pair in tqdm(pairs, desc="compiling buckets", disable=not progress):
            self._compile_pair(pair)
        self._limits = limits_of(stages[-1].largest)
        self._say(f"compiled {len(pairs)} step buckets in {time.perf_counter() - start:.1f} s", progress)

    def compile_in_background(self, progress: bool = True,
                              before_compile: Callable[[tuple[int, int]], None] | None = None) -> None:
        """Compile the block moves and the smallest bucket now, the other buckets on a thread
        (in the stages of ``compile_stages``, largest last). Until a stage is done,
        ``step_limits`` keeps the steps within the buckets compiled so far, so none compiles on
        the serving path."""
        start = time.perf_counter()
        self._compile_moves()
        first, *rest = compile_stages(self.token_buckets, self.request_buckets)
        for pair in first.pairs:
            self._compile_pair(pair)
        self._limits = limits_of(first.largest)
        total = len(self.bucket_pairs())
        elapsed = time.perf_counter() - start
        if not rest:
            self._say(f"compiled {total} step buckets in {elapsed:.1f} s", progress)
            return
        self._say(f"compiled the smallest step bucket in {elapsed:.1f} s; compiling the other {total - 1} in "
                  f"the background (until then steps stay within the buckets compiled)", progress)
        self._compiler = BackgroundCompiler(
            rest, self._compile_pair, self._publish, before_compile=before_compile,
            on_done=lambda seconds: self._say(f"all {total} step buckets compiled ({seconds:.1f} s in the "
                                              f"background)", progress))
        self._compiler.start()

    def _compile_moves(self) -> None:
        """The block moves (and a draft model's moves and proposal steps)."""
        self.mover.compile_all(self.kv_caches[:self.num_kv_arrays])
        if self.state_mover is not None:
            self.state_mover.compile_all(self.kv_caches[self.num_kv_arrays:])
        if self.drafter is not None:
            self.drafter.mover.compile_all(self.drafter.kv_caches)
            self.drafter.compile_proposals()

    def _compile_pair(self, pair: tuple[int, int]) -> None:
        inputs = self._with_sampled_drafts(self.batch.padded(*pair), None)
        executable = self._compile_step(inputs)
        if self.drafter is not None:        # before the step is published as compiled
            self.drafter.compile_step(pair, inputs, self._draft_ids(inputs), executable.out_info[1])
        self._executables[pair] = executable

    def compiled_programs(self) -> dict[str, jax.stages.Compiled]:
        """Every program compiled so far, by name: the steps per bucket, the block moves, and a
        drafter's steps and moves (what a check of the compiled code reads)."""
        programs = {f"step {pair}": executable for pair, executable in self._executables.items()}
        programs.update({f"block {name}": move for name, move in self.mover.compiled_programs().items()})
        if self.state_mover is not None:
            programs.update({f"state {name}": move for name, move in self.state_mover.compiled_programs().items()})
        if self.drafter is not None:
            programs.update({f"draft {name}": program for name, program in self.drafter.compiled_programs().items()})
        return programs

    def _publish(self, limits: StepLimits) -> None:
        self._limits = limits
        logger.info("step buckets compiled up to %d tokens and %d rows (%d of %d)", *limits,
                    len(self._executables), len(self.bucket_pairs()))

    @staticmethod
    def _say(message: str, progress: bool) -> None:
        if progress:
            print(f"jaxengine: {message}", flush=True)
        else:
            logger.info(message)

    def step_limits(self) -> StepLimits:
        """The most tokens and sequences a step may hold now: the configured limits once every
        bucket is compiled, less while some are still compiling in the background."""
        return self._limits

    @property
    def num_compiled_buckets(self) -> int:
        return len(self._executables)

    @property
    def is_compiling(self) -> bool:
        """Buckets are being compiled in the background."""
        return self._compiler is not None and self._compiler.is_running

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background compilation (if any) to finish; False if ``timeout`` passed first."""
        return self._compiler is None or self._compiler.wait(timeout)

    def close(self) -> None:
        """Stop compiling in the background (after the compile in progress)."""
        if self._compiler is not None:
            self._compiler.close()

    def _compile_step(self, inputs: StepInputs):
        return self.step_fn.lower(*self._step_args(inputs, self._kv_spec)).compile()

    def _executable(self, inputs: StepInputs):
        executable = self._executables.get(inputs.bucket)
        if executable is None:
            self._note_compile(f"step bucket {inputs.bucket}")
            executable = self._executables[inputs.bucket] = self._compile_step(inputs)
        return executable

    @contextlib.contextmanager
    def forbid_compiles(self):
        """Within this block any compilation raises CompilationError (tests use it)."""
        previous, self.forbid = self.forbid, True
        try:
            yield
        finally:
            self.forbid = previous

    def _note_compile(self, what: str) -> None:
        """Called before a compilation after start-up: counted and logged, or refused."""
        if self.forbid:
            raise CompilationError(f"compilation after start-up: {what}")
        self.num_compiles += 1
        logger.warning("jaxengine: compilation after start-up (%s); %d so far", what, self.num_compiles)

    # ---- one step ----
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.dispatch(out).result()

    def dispatch(self, out: SchedulerOutput) -> "PendingStep":
        """Prepare the inputs and launch the step without waiting for it (JAX dispatches
        asynchronously); ``result()`` of the returned handle waits. One earlier step may still be
        uncollected (async scheduling): its tokens reach this step's inputs on the device."""
        if len(self._uncollected) > 1:
            raise RuntimeError("dispatch: two earlier steps are uncollected")
        # Host preparation (process 0 only under several processes) ...
        self.batch.update(out)
        moves = BlockMoves(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy, out.states_to_copy,
                           out.states_to_swap_out, out.states_to_swap_in)
        inputs, slots = self.batch.prepare(out, self._lora_rows(out)) if out.seq_ids else (None, None)
        inputs = self._with_sampled_drafts(inputs, out)
        if inputs is None and not moves:
            self._wait_for_buckets()
            return PendingStep(self, out, None, None, None)
        if inputs is not None:
            self._count_launch()
        # ... then the device launch, which every process runs (the others get the same moves and
        # inputs from process 0 through the channel, as it launches).
        with self.channel.sending(moves, inputs) if self.channel is not None else contextlib.nullcontext():
            device_result = self.launch(moves, inputs)
        if inputs is None:
            return PendingStep(self, out, None, None, None)
        step = PendingStep(self, out, inputs, slots, device_result)
        self._uncollected.append(step)
        return step

    def _lora_rows(self, out: SchedulerOutput) -> np.ndarray | None:
        """With LoRA slots: the step's adapters put in slots, and each row's slot (-1: base)."""
        if self.lora is None:
            return None
        adapters = [seq.request.lora_adapter for seq in out.scheduled_seqs]
        self.state, slot_of = self.lora.activate(self.state, [a for a in adapters if a is not None])
        return self.lora.row_slots(adapters, slot_of)

    def _wait_for_buckets(self) -> None:
        """An empty step while buckets compile in the background: requests may be waiting for
        them (a prompt that cannot be chunked, a group of more sequences than the limits allow);
        wait a moment for the next stage instead of letting the engine spin on the cores the
        compiler needs."""
        if self.is_compiling:
            self._compiler.wait_for_stage(IDLE_WAIT_S)

    def launch(self, moves: BlockMoves, inputs: StepInputs | None):
        """The device part of a step: apply the block moves, then launch the compiled step for
        ``inputs`` (None: moves only). Returns the step's device result without waiting for it."""
        if moves:
            kv, states = self.kv_caches[:self.num_kv_arrays], self.kv_caches[self.num_kv_arrays:]
            kv = self.mover.apply(kv, moves.swap_out, moves.swap_in, moves.copy)
            if self.state_mover is not None:
                # A fork's copy first: it reads its parent's slot before a swap in refills a freed one.
                states = self.state_mover.apply(states, [], [], moves.state_copy)
                states = self.state_mover.apply(states, moves.state_swap_out, moves.state_swap_in, [])
            self.kv_caches = (*kv, *states)
            if self.drafter is not None:
                self.drafter.apply_moves(moves)
        if inputs is None:
            return None
        if self.drafter is not None:          # the draft model's cache takes the step's tokens too
            self.drafter.before_step(inputs, self._draft_ids(inputs))
        device_result = self._run(inputs)
        self._previous_tokens = device_result[2]
        if self.drafter is not None:          # an EAGLE-3 head's takes them after the step
            self.drafter.after_step(inputs, device_result)
        return device_result

    def _with_sampled_drafts(self, inputs: StepInputs | None, out: SchedulerOutput | None) -> StepInputs | None:
        """With sampled drafts, the step's ``sampled_drafts`` (none for a compile's padding)."""
        if inputs is None or self.drafter is None or not self.drafter.sampled:
            return inputs
        rows = len(inputs.logits_indices)
        refs = np.stack([np.full(rows, -1, np.int32), np.zeros(rows, np.int32)]) if out is None else \
            self.drafter.sampled_drafts(out, rows)
        return dataclasses.replace(inputs, sampled_drafts=refs)

    def _draft_ids(self, inputs: StepInputs) -> tuple:
        return inputs.input_ids, self._previous_tokens, inputs.prev_index

    def reset_previous_tokens(self) -> None:
        """Forget the last launched step's tokens (they may hold a failed step's error)."""
        self._previous_tokens = self._zero_tokens(self._previous_tokens.shape[0])

    def abandon_uncollected(self) -> None:
        """After a failed step: forget the launched steps not collected (their sequences are
        being aborted) and check that the device state survived. Raises when the KV cache is
        lost: donated to a call that failed, or written by a computation that failed."""
        self._uncollected.clear()
        if self.channel is not None:
            self.channel.reset()      # the other processes forget it too
        self.reset_previous_tokens()
        jax.block_until_ready(self.kv_caches)

    def _zero_tokens(self, n: int) -> jax.Array:
        return jax.device_put(np.zeros(n, np.int32), self._replicated)

    def _count_launch(self) -> None:
        """Is the device idle as this step launches? (Busy: an earlier step is still computing.)"""
        self.num_launches += 1
        if self._uncollected and not self._uncollected[-1].device_result[2].is_ready():
            return
        self.num_idle_launches += 1
        if not self._uncollected and self._last_ready is not None:
            self.idle_s += time.perf_counter() - self._last_ready

    def _collect(self, step: "PendingStep") -> ModelRunnerOutput:
        if not self._uncollected or self._uncollected[0] is not step:
            raise RuntimeError("steps must be collected in launch order")
        self._uncollected.popleft()
        out, inputs, slots = step.out, step.inputs, step.slots
        result, prompt_lp, _, expert_tokens = step.device_result[:4]
        wait = time.perf_counter()
        with self.channel.waiting("reading a step's results") if self.channel is not None else \
                contextlib.nullcontext():
            tokens = np.asarray(result.token_ids)[:inputs.num_sample_rows]
        self._last_ready = time.perf_counter()
        self.device_wait_s += self._last_ready - wait
        samples = np.asarray(out.num_samples, np.int32)
        first = np.cumsum(samples) - samples
        tolist = tokens.tolist()
        sampled = [tolist[f:f + k] for f, k in zip(first.tolist(), out.num_samples)]
        if out.draft_token_ids:
            sampled = verify_drafts(out.seq_ids, out.draft_token_ids, sampled)
        self.batch.record_samples(out, slots, sampled)
        return ModelRunnerOutput(sampled, self._logprobs(slots, result, first, samples, sampled),
                                 self._prompt_logprobs(inputs, slots, out, prompt_lp),
                                 tuple(np.asarray(expert_tokens).tolist()) if expert_tokens.shape[0] else (),
                                 self._propose(out, slots, first, sampled) if out.propose else {})

    def _propose(self, out: SchedulerOutput, slots: np.ndarray, first: np.ndarray,
                 sampled: list[list[int]]) -> dict[int, list[int]]:
        """Speculative decoding, once the step is verified: the drafts of the sequences the
        scheduler asked for (``out.propose``: the most tokens each), from their tokens now, this
        step's outputs included (the input batch holds them)."""
        rows = [i for i, seq_id in enumerate(out.seq_ids) if sampled[i] and seq_id in out.propose]
        if not rows:
            return {}
        seq_ids = [out.seq_ids[i] for i in rows]
        counts = np.asarray([out.propose[seq_id] for seq_id in seq_ids], np.int32)
        num_out = np.asarray([len(sampled[i]) for i in rows], np.int32)
        num_draft = np.asarray([len(out.draft_token_ids.get(seq_id, ())) for seq_id in seq_ids], np.int32)
        index = np.asarray(rows)
        row_slots = slots[index]
        # The row's first sample follows its scheduled tokens (less its draft); its last output token
        # is num_out - 1 positions on.
        positions = (np.asarray(out.num_computed_tokens, np.int32)[index]
                     + np.asarray(out.num_scheduled_tokens, np.int32)[index] - num_draft + num_out - 1)
        batch = self.batch
        if self.drafter is None:
            return {seq_id: self.ngram.propose(batch.tokens[slot, :end], n)
                    for seq_id, slot, end, n in zip(seq_ids, row_slots.tolist(), (positions + 1).tolist(),
                                                    counts.tolist())}
        drafts = self.drafter.propose(ProposalRows(
            seq_ids, batch.tokens[row_slots, positions], first[index] + num_out - 1, positions,
            batch.block_tables[row_slots], counts, batch.temperature[row_slots], batch.seed[row_slots],
            batch.sample_index[row_slots]))
        return dict(zip(seq_ids, drafts))

    def _run(self, inputs: StepInputs) -> tuple[SamplerOutput, tuple]:
        executable = self._executable(inputs)
        self.kv_caches, result = executable(*self._step_args(inputs))
        return result

    def _step_args(self, inputs: StepInputs, kv_caches=None) -> tuple:
        ids = (inputs.input_ids, self._previous_tokens, inputs.prev_index)
        drafted = ()
        if inputs.sampled_drafts is not None:          # the drafter's distributions (shapes, for a compile)
            probs = self.drafter.draft_probs
            drafted = (probs if kv_caches is None else
                       jax.ShapeDtypeStruct(probs.shape, probs.dtype, sharding=probs.sharding), inputs.sampled_drafts)
        return (self.state, self.kv_caches if kv_caches is None else kv_caches, ids, inputs.attention,
                inputs.logits_indices, inputs.sampling, inputs.prompt_lp_want, inputs.prompt_lp_target, *drafted)

    def _prompt_logprobs(self, inputs: StepInputs, slots: np.ndarray, out: SchedulerOutput, prompt_lp) -> list | None:
        """Per row: [(position, {prompt token: logprob, top-k...})] for the prompt tokens this step scored."""
        want = inputs.prompt_lp_want
        if not want.any():
            return None
        lp, ids, top = (np.asarray(a) for a in prompt_lp)
        rows: list = [None] * len(slots)
        start = 0
        for i, n in enumerate(out.num_scheduled_tokens):
            k = int(self.batch.num_prompt_logprobs[slots[i]])
            entries = []
            for t in np.flatnonzero(want[start:start + n]) + start:
                entry = dict(zip(ids[t, :k].tolist(), top[t, :k].tolist()))
                entry[int(inputs.prompt_lp_target[t])] = float(lp[t])
                entries.append((int(inputs.attention.positions[t]) + 1, entry))
            rows[i] = entries or None
            start += n
        return rows

    def _logprobs(self, slots: np.ndarray, result: SamplerOutput, first, samples, sampled) -> list | None:
        """Per row, for requests that asked for logprobs: per sample (logprob, {token: logprob} top-k);
        a row with a draft: per token it outputs."""
        ks = self.batch.num_logprobs[slots]
        if not (ks >= 0).any():
            return None
        lp, ids, top = (np.asarray(a) for a in (result.logprobs, result.top_token_ids, result.top_logprobs))
        rows: list = [None] * len(slots)
        for i in np.flatnonzero(ks >= 0):
            k = int(ks[i])
            rows[i] = [(float(lp[r]), dict(zip(ids[r, :k].tolist(), top[r, :k].tolist())))
                       for r in range(first[i], first[i] + min(samples[i], len(sampled[i])))]
        return rows
