"""The offline API: ``LLM(model).generate(prompts, sampling_params)`` and ``LLM.chat(messages)``, a
front over ``host.EngineHost``, which builds the engine."""
from __future__ import annotations

import dataclasses
import itertools
import numbers
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NoReturn

from tqdm.auto import tqdm

from jaxengine.engine_args import EngineArgs
from jaxengine.host import EngineHost
from jaxengine.lora_request import LoRARequest
from jaxengine.models.config import ModelConfig
from jaxengine.output_processor import OutputProcessor
from jaxengine.outputs import BeamSearchOutput, RequestOutput, make_beam_search_output, make_request_output
from jaxengine.request import Request
from jaxengine.sampling_params import BeamSearchParams, SamplingParams
from jaxengine.tokenizer import apply_chat_template



class LLM(EngineHost):
    """An engine on one model. ``model=None`` uses the embedded default (SmolLM2-135M-Instruct).

    The engine options are the fields of ``EngineArgs`` (``max_num_seqs=...``, ``dtype=...``; see
    ``python -m jaxengine.serve --help``); an unknown one is a TypeError naming it. The offline
    front over ``EngineHost``: it adds the blocking ``generate``, ``chat`` and ``beam_search``."""

    def __init__(self, model: str | Path | None = None, *, model_config: ModelConfig | None = None,
                 progress: bool = True, **engine_options) -> None:
        """``model``: a checkpoint folder or .gguf file, None for the default, or an already built
        model module with its ``model_config`` (benchmarks on random weights; no tokenizer).
        ``progress``: show loading and compilation progress."""
        module = model if model is not None and not isinstance(model, (str, Path)) else None
        path = None if module is not None or model is None else str(model)
        super().__init__(EngineArgs.from_kwargs(model=path, **engine_options), module=module, model_config=model_config,
                         progress=progress)
        self._ids = itertools.count()          # the offline requests' ids

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, progress: bool = True) -> "LLM":
        options = dataclasses.asdict(engine_args)
        return cls(options.pop("model"), progress=progress, **options)

    # ---- the offline API ----
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Prompts -> outputs in input order. A prompt is a string, a list of token ids, or one of
        vLLM's prompt dicts (``{"prompt": text}``, ``{"prompt_token_ids": ids}``, either with an
        optional ``cache_salt``); give one prompt or a list of them. ``lora_request``: the LoRA
        adapter to run with (``enable_lora``), one for all prompts or one per prompt (None: the base)."""
        parsed = [self._parse_prompt(p) for p in _prompt_list(prompts)]
        params = self._params_for(parsed, sampling_params)
        loras = self._loras_for(parsed, lora_request)
        priorities = _priorities(priority, len(parsed))
        for prompt, p in zip(parsed, params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params: expected SamplingParams, got {type(p).__name__}"
                                + (" (beam search is LLM.beam_search)" if isinstance(p, BeamSearchParams) else ""))
            self.check_request(prompt.token_ids, p)
            self.check_constraint(p)
        for lora in dict.fromkeys(r for r in loras if r is not None):   # each read once, before any is queued
            self.engine.read_adapter(lora)
        requests = self._queue_all(
            partial(self.add_request, f"offline-{next(self._ids)}", prompt.token_ids, p, priority=rank,
                    cache_salt=prompt.cache_salt, lora_request=lora)
            for prompt, p, lora, rank in zip(parsed, params, loras, priorities))
        texts = self._run(requests, use_tqdm)
        return [make_request_output(r, prompt.text, t) for r, prompt, t in zip(requests, parsed, texts)]

    def beam_search(self, prompts, params: BeamSearchParams | list[BeamSearchParams], *,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search (vLLM's call): per prompt, its ``params.beam_width`` best finished
        hypotheses, best first. The prompts take the forms ``generate`` accepts; ``params`` is
        one for all or one per prompt. They run together, each a group of beams sharing KV
        blocks, alongside any other requests."""
        parsed = [self._parse_prompt(p) for p in _prompt_list(prompts)]
        params_list = self._params_for(parsed, params)
        for prompt, p in zip(parsed, params_list):
            if not isinstance(p, BeamSearchParams):
                raise TypeError(f"params: expected BeamSearchParams, got {type(p).__name__}")
            self.check_request(prompt.token_ids, p)
            self.check_constraint(p)
        requests = self._queue_all(partial(self.add_request, f"beam-{next(self._ids)}", prompt.token_ids, p,
                                           cache_salt=prompt.cache_salt) for prompt, p in zip(parsed, params_list))
        texts = self._run(requests, use_tqdm)
        return [make_beam_search_output(r, t) for r, t in zip(requests, texts)]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, *,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([apply_chat_template(self.tokenizer, c) for c in conversations], sampling_params,
                             use_tqdm=use_tqdm)

    def _loras_for(self, prompts: list, lora_request) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"lora_request: {len(lora_request)} given for {len(prompts)} prompts")
        return list(lora_request)

    def _params_for(self, prompts: list, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * len(prompts)
        if isinstance(sampling_params, (SamplingParams, BeamSearchParams)):
            return [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError(f"sampling_params: expected one for all prompts or a list, one per prompt, got "
                            f"{type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        return list(sampling_params)

    def _parse_prompt(self, prompt) -> _Prompt:
        """One prompt in any accepted form -> its token ids; ValueError naming ``prompts``."""
        if isinstance(prompt, str):
            return _Prompt(self.encode(prompt), prompt)
        if isinstance(prompt, list):
            return _Prompt(_token_ids(prompt, "a token-id prompt"))
        if not isinstance(prompt, dict):
            raise ValueError(f"prompts: each prompt must be a string, a list of token ids or a dict with "
                             f"'prompt' or 'prompt_token_ids', got {type(prompt).__name__}")
        if unknown := sorted(set(prompt) - PROMPT_KEYS):
            raise ValueError(f"prompts: unsupported prompt keys {unknown} (accepted: {sorted(PROMPT_KEYS)})")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("prompts: a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
        salt = prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"prompts: cache_salt must be a string, got {type(salt).__name__}")
        if "prompt_token_ids" in prompt:
            return _Prompt(_token_ids(prompt["prompt_token_ids"], "prompt_token_ids"), cache_salt=salt)
        if not isinstance(text := prompt["prompt"], str):
            raise ValueError(f"prompts: 'prompt' must be a string, got {type(text).__name__}")
        return _Prompt(self.encode(text), text, salt)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[list[str]]:
        """Step until ``requests`` finish; their texts come from the output processor the server
        uses, fed each step while the device computes the next (the running requests' new
        tokens: that is where a stop string can appear) and once more at the end."""
        engine = self.engine
        processors = {r.request_id: OutputProcessor(r, self.tokenizer, engine.finish_sequence) for r in requests}

        def process_running() -> None:
            for request in engine.running_requests():
                if (proc := processors.get(request.request_id)) is not None:
                    proc.process()

        step_work = process_running if self.tokenizer is not None else None
        try:
            with tqdm(total=len(requests), desc="generating", unit="req", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    bar.update(len(engine.step(step_work)))
                bar.update(len(requests) - bar.n)     # finished by a stop string
        except BaseException as error:                # Ctrl-C too: the engine must stay usable
            self._end_after_failed_step(requests, error)
        engine.flush()   # the runner forgets the last finished sequences
        return [processors[r.request_id].final_texts() for r in requests]

    def _queue_all(self, adds) -> list[Request]:
        """Queue every request (``adds``: one call each) or none: one that fails unqueues the
        ones before it."""
        requests: list[Request] = []
        try:
            for add in adds:
                requests.append(add())
        except BaseException:
            for request in requests:
                self.engine.abort(request.request_id)
            raise
        return requests

    def _end_after_failed_step(self, requests: list[Request], error: BaseException) -> NoReturn:
        """After a step raised, as the server does: the requests the failed steps touched end and
        their blocks are freed; the engine goes on. This call's other requests end too (their
        outputs have no one to go to); then ``error`` itself reaches the caller, its type kept (a
        CompilationError stays one), with a note naming the requests that failed."""
        try:
            touched = self.engine.abandon_failed_step()
        except Exception as lost:                      # noqa: BLE001 - reported with the failure
            raise RuntimeError(f"the engine step failed ({type(error).__name__}: {error}) and the engine cannot "
                               f"go on ({lost}); create a new LLM") from error
        ours = [r.request_id for r in requests]
        for request_id in dict.fromkeys([*touched, *ours]):
            self.engine.abort(request_id)
        if isinstance(error, Exception):
            failed = [rid for rid in ours if rid in touched] or ours
            error.add_note(f"requests {failed}: the engine step failed; this call's requests were ended and the "
                           f"engine goes on")
        raise error


@dataclass(frozen=True)
class _Prompt:
    token_ids: list[int]
    text: str | None = None
    cache_salt: str | None = None


PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


def _prompt_list(prompts) -> list:
    """One prompt or a list of them -> a non-empty list of prompts."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts: must be a prompt or a list of prompts, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts: no prompt given (an empty list)")
    return list(prompts)


def _priorities(priority, num_prompts: int) -> list[int]:
    """``generate``'s ``priority``: None (all 0) or one integer per prompt."""
    if priority is None:
        return [0] * num_prompts
    if not isinstance(priority, (list, tuple)):
        raise ValueError(f"priority: must be a list of integers, one per prompt, got {type(priority).__name__}")
    if len(priority) != num_prompts:
        raise ValueError(f"priority: {len(priority)} given for {num_prompts} prompts")
    if bad := [p for p in priority if not isinstance(p, numbers.Integral) or isinstance(p, bool)]:
        raise ValueError(f"priority: must be integers, got {bad[:5]!r:.80}")
    return [int(p) for p in priority]


def _token_ids(ids, what: str) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"prompts: {what} must be a non-empty list of token ids, got {ids!r:.60}")
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"prompts: {what} must hold non-negative integers, got {list(ids)[:8]!r:.60}")
    return [int(t) for t in ids]


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and isinstance(x[0], numbers.Integral)


