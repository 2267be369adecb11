"""Constrained decoding with llguidance: a grammar per distinct constraint, compiled once (cached)
on a worker thread, and a matcher per sequence that fills its row of the step's token bitmask
and advances with each accepted token. ``StructuredOutputManager`` is the one owner of all of
it inside an engine: the requests whose grammar compiles, the matchers, the bitmask.

llguidance was chosen over xgrammar and outlines-core: it needs no torch (xgrammar imports
it), covers JSON schema, regex, choice, Lark and GBNF grammars (outlines-core has no grammars
and compiles "any JSON" in seconds), compiles a medium schema in about a millisecond, and
fills a 49,152-token mask in about 10 µs, which at batch 64 is well under the step.

The bitmask is int32 ``[rows, ceil(vocab / 32)]``: token t is allowed when bit ``t & 31`` of
word ``t >> 5`` is set (what the sampler unpacks on the device).
"""
from __future__ import annotations

import json
import threading
from concurrent import futures
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from jaxengine.request import RequestStatus
from jaxengine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import numpy as np

    from jaxengine.core.scheduler_output import SchedulerOutput
    from jaxengine.request import Request, Sequence

GRAMMAR_WAIT_S = 0.05       # an idle engine waits this long at most for a grammar to compile

ALL_ALLOWED = -1            # a bitmask word with every bit set
TOO_COMPLEX = ("LexerTooComplex", "ParserTooComplex")      # llguidance's stop reasons at its limits
# JSON as json.dumps writes it: fixed separators and no free whitespace, so a model cannot wander
# into whitespace until max_tokens (a schema's "x-guidance" options may say otherwise).
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Grammars for one tokenizer and vocabulary, compiled on a worker thread and cached by
    constraint. ``submit`` returns a future of the grammar (a ValueError naming the request's
    field when the constraint is invalid)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, max_workers: int = 2) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._cache: dict[tuple, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")

    @property
    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (built once, on first use: ~0.5 s for 49k tokens)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=self.eos_token_id)
            return self._ll_tokenizer

    def submit(self, params: StructuredOutputsParams) -> Future:
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._cache[key] = self._pool.submit(self.compile, params)
            return future

    def compile(self, params: StructuredOutputsParams) -> "Grammar":
        """The grammar for ``params`` now, in this thread (ValueError naming the field if invalid)."""
        import numpy as np
        from llguidance import LLMatcher

        text = _grammar_text(params)
        error = LLMatcher.validate_grammar(text, self.ll_tokenizer)
        if error:
            raise ValueError(f"{params.field}: invalid {_KIND_NAMES[params.kind]}: {error}")
        grammar = Grammar(text, self.ll_tokenizer)
        start = grammar.matcher()
        start.fill(np.zeros(bitmask_words(self.vocab_size), np.int32))     # settles its start state
        if start.is_done and not start.is_accepting:      # nothing may come, and nothing is not enough
            raise ValueError(f"{params.field}: unsatisfiable {_KIND_NAMES[params.kind]}: no output matches it")
        return grammar

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_KIND_NAMES = {"json": "JSON schema", "regex": "regular expression", "choice": "choice",
               "grammar": "grammar", "json_object": "JSON object constraint"}


def _grammar_text(params: StructuredOutputsParams) -> str:
    text = _constraint_text(params)
    return text if params.thinking is None else _after_thinking(text, params.thinking)


# The thinking is free text up to the first "</think>" (a lazy lexeme ends at its first match);
# the answer's own grammar follows as a side grammar, as llguidance composes grammars.
_THINK_LARK = {
    "starts": "start: think NL? @answer",
    "optional": 'start: ("<think>" think NL?)? @answer',
}
_THINK_RULES = '\nthink[lazy]: THINK_TEXT "</think>"\nTHINK_TEXT: /(.|\\n)*/\nNL: /\\n+/\n'


def _after_thinking(answer: str, mode: str) -> str:
    """A grammar text -> one that first lets the model think, then holds ``answer``."""
    if answer.lstrip().startswith("{"):                  # llguidance's JSON form: a list of grammars
        grammars = json.loads(answer)["grammars"]
    else:                                               # a Lark grammar
        grammars = [{"lark_grammar": answer}]
    grammars[0] = {**grammars[0], "name": "answer"}
    outer = {"name": "thinking", "lark_grammar": "%llguidance {}\n" + _THINK_LARK[mode] + _THINK_RULES}
    return json.dumps({"grammars": [outer, *grammars]})


def _constraint_text(params: StructuredOutputsParams) -> str:
    import llguidance
    from llguidance import LLMatcher

    kind = params.kind
    try:
        if kind == "json":
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
        return llguidance.grammar_from("grammar", params.grammar)      # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"{params.field}: invalid {_KIND_NAMES[kind]}: {e}") from None


class Grammar:
    """A compiled constraint: makes a matcher per sequence."""

    def __init__(self, text: str, ll_tokenizer) -> None:
        self.text = text
        self.ll_tokenizer = ll_tokenizer

    def matcher(self) -> "Matcher":
        from llguidance import LLMatcher

        return Matcher(LLMatcher(self.ll_tokenizer, self.text, log_level=0))


class Matcher:
    """One sequence's place in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, ll_matcher) -> None:
        self._m = ll_matcher

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row`` (int32, contiguous)."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False if the grammar does not allow it (the matcher is then dead)."""
        return self._m.consume_token(token)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the grammar allows from here (nothing is taken in)."""
        return self._m.validate_tokens(tokens)

    def fill_along(self, tokens: list[int], rows: np.ndarray) -> None:
        """Rows[j]: the allowed tokens after ``tokens[:j]`` (a draft's positions; the grammar
        allows every one of them), for j = 0 .. len(tokens); the matcher ends where it began."""
        for j, token in enumerate(tokens):
            self.fill(rows[j])
            self._m.consume_token(token)
        self.fill(rows[len(tokens)])
        if tokens:
            self._m.rollback(len(tokens))

    @property
    def is_done(self) -> bool:
        """Only the end of the output can follow (the constraint is complete)."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """What has been taken in so far is a complete output."""
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    @property
    def too_complex(self) -> bool:
        """llguidance gave up on the grammar at one of its limits (a regex too large to lex, say).
        Its stop_reason() then says only InternalError; the state in its error names the limit."""
        error = self.error
        return error is not None and any(f"Stop: {limit}" in error for limit in TOO_COMPLEX)

    def copy(self) -> "Matcher":
        return Matcher(self._m.deep_copy())


class StructuredOutputManager:
    """Structured output's one owner in an engine. A request with a constraint waits here
    (``WAITING_FOR_GRAMMAR``) while its grammar compiles on the compiler's worker thread; once
    it is ready the request leaves with its matcher (``take_ready``) for the scheduler. Each
    step, the manager fills the token bitmask of the rows that sample under a grammar
    (``fill_bitmask``); the scheduler's token intake feeds each output token to its sequence's
    matcher (``take_token``), which says whether that ends it. ``compiler`` None: refused (no
    tokenizer).

    Writers of ``Sequence.grammar``: this manager (at admission); the scheduler gives each
    sibling at a fork a copy of the leader's, and beam search a forked beam a copy of its
    parent's."""

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self.awaiting: dict[str, Request] = {}     # grammar compiling, not yet in the scheduler

    def submit(self, request: Request) -> None:
        constraint = request.sampling_params.structured_outputs
        if self.compiler is None:
            raise ValueError(f"{constraint.field}: structured output needs the model's tokenizer "
                             f"(this engine runs without one)")
        request.grammar_future = self.compiler.submit(constraint)
        self.awaiting[request.request_id] = request

    def take_ready(self, idle: bool) -> Iterator[tuple[Request, str | None]]:
        """The requests whose grammar is ready, one at a time (each leaves ``awaiting`` as it is
        taken), with its leader's matcher set, or with the compiler's error (an invalid
        constraint). ``idle``: nothing else could run, so wait a little for the first grammar
        rather than spin."""
        if idle:
            futures.wait([r.grammar_future for r in self.awaiting.values()],
                         timeout=GRAMMAR_WAIT_S, return_when=futures.FIRST_COMPLETED)
        for request_id, request in list(self.awaiting.items()):
            if not request.grammar_future.done():
                continue
            del self.awaiting[request_id]
            error = request.grammar_future.exception()
            if error is None:
                request.seqs[0].grammar = request.grammar_future.result().matcher()
            yield request, None if error is None else str(error)

    def fill_bitmask(self, out: SchedulerOutput) -> None:
        """Each sample row with a grammar gets its allowed tokens in the step's bitmask
        (``out.token_bitmask``, one row per sample row; None when no row has a grammar): a fork
        row's samples its row's, a row with a draft each of its positions' (the grammar's state
        after the draft tokens before it)."""
        import numpy as np

        bitmask = None
        first = 0
        for seq, k in zip(out.scheduled_seqs, out.num_samples):
            if k and seq.grammar is not None:
                if bitmask is None:
                    words = bitmask_words(self.compiler.vocab_size)
                    bitmask = np.full((sum(out.num_samples), words), ALL_ALLOWED, np.int32)
                draft = out.draft_token_ids.get(seq.seq_id)
                if draft:
                    seq.grammar.fill_along(draft, bitmask[first:first + k])
                else:
                    seq.grammar.fill(bitmask[first])
                    bitmask[first + 1:first + k] = bitmask[first]
            first += k
        out.token_bitmask = bitmask

    @staticmethod
    def take_token(seq: Sequence, token: int) -> tuple[RequestStatus, str | None] | None:
        """One more token of a running sequence with a grammar: how the grammar ends it (complete:
        stopped; refused, which the mask makes impossible: an error), or None."""
        if not seq.grammar.accept(token):
            if seq.grammar.too_complex:          # the request's constraint is to blame: a 400
                field = seq.request.sampling_params.structured_outputs.field
                return RequestStatus.FINISHED_IGNORED, (f"{field}: too complex to follow "
                                                        f"({seq.grammar.error.splitlines()[0]})")
            return RequestStatus.FINISHED_ERROR, f"structured output: token {token} is not allowed here"
        if seq.grammar.is_done:
            return RequestStatus.FINISHED_STOPPED, None
        return None
