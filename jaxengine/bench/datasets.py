"""Request sources for the benchmarks: each gives a list of ``BenchRequest`` (prompt token ids and
the number of tokens to generate, always generated in full: the runs use ``ignore_eos``).
Every source is seeded and deterministic: the same arguments give the same requests.

- ``random``: token ids uniform in the vocabulary; prompt and output lengths from a ``LengthSpec``
  (fixed, uniform in a range, or lognormal around a mean);
- ``shared-prefix``: one common prefix of P random tokens, then a unique random suffix each;
- ``sharegpt``: a JSON list or JSONL file of ShareGPT conversations: the first human turn is the
  prompt, the gpt turn after it gives the output length (both tokenized with the model's tokenizer);
- ``prompts``: a JSONL file of ``{"prompt": text or token ids, "max_tokens": n}``.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "shared-prefix", "sharegpt", "prompts")

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class LengthSpec:
    """A length distribution, written ``128`` (fixed), ``32:512`` (uniform, both ends included)
    or ``lognormal:128`` / ``lognormal:128:0.5`` (lognormal with mean 128, sigma of the log 0.5 by
    default; samples are rounded and cut to [1, ``cap``])."""

    kind: str
    low: int
    high: int = 0
    sigma: float = 0.5

    @classmethod
    def parse(cls, text: str) -> "LengthSpec":
        parts = str(text).split(":")
        try:
            if parts[0] == "lognormal" and len(parts) in (2, 3):
                spec = cls("lognormal", int(parts[1]), sigma=float(parts[2]) if len(parts) == 3 else 0.5)
            elif len(parts) == 1:
                spec = cls("fixed", int(parts[0]))
            elif len(parts) == 2:
                spec = cls("uniform", int(parts[0]), int(parts[1]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"length: expected N, LOW:HIGH or lognormal:MEAN[:SIGMA], got {text!r}") from None
        spec.check()
        return spec

    def check(self) -> None:
        if self.low < 1 or (self.kind == "uniform" and self.high < self.low) or self.sigma <= 0:
            raise ValueError(f"length: {self} is empty or not positive")

    def sample(self, rng: random.Random, cap: int) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        mu = math.log(self.low) - self.sigma ** 2 / 2        # so that the mean is ``low``
        return min(max(round(rng.lognormvariate(mu, self.sigma)), 1), cap)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(self.low)
        if self.kind == "uniform":
            return f"{self.low}:{self.high}"
        return f"lognormal:{self.low}:{self.sigma}"


def random_requests(num: int, vocab_size: int, input_len: LengthSpec, output_len: LengthSpec, *,
                    seed: int = 0, max_model_len: int = 1 << 30) -> list[BenchRequest]:
    """``num`` prompts of random token ids; lognormal tails are cut so each request fits
    ``max_model_len`` (a fixed or uniform length is taken as given)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        n_in = input_len.sample(rng, max_model_len - 1)
        n_out = output_len.sample(rng, max(max_model_len - n_in, 1))
        requests.append(BenchRequest(random_token_ids(rng, n_in, vocab_size), n_out))
    return requests


def shared_prefix_requests(num: int, vocab_size: int, prefix_len: int, suffix_len: LengthSpec,
                           output_len: LengthSpec, *, seed: int = 0,
                           max_model_len: int = 1 << 30) -> list[BenchRequest]:
    """``num`` prompts: the same ``prefix_len`` random tokens, then a random suffix each."""
    rng = random.Random(seed)
    prefix = random_token_ids(rng, prefix_len, vocab_size)
    requests = []
    for _ in range(num):
        n_suffix = suffix_len.sample(rng, max(max_model_len - 1 - prefix_len, 1))
        n_out = output_len.sample(rng, max(max_model_len - prefix_len - n_suffix, 1))
        requests.append(BenchRequest(prefix + random_token_ids(rng, n_suffix, vocab_size), n_out))
    return requests


def sharegpt_requests(path: str | Path, encode: Encode, num: int | None = None, *, seed: int = 0,
                      max_model_len: int = 1 << 30) -> list[BenchRequest]:
    """Conversations of a ShareGPT file (a JSON list, or JSONL), shuffled with ``seed``; the
    first ``num`` usable ones (all by default). A conversation is usable when it has a human turn
    followed by a gpt turn, both non-empty once tokenized, and they fit ``max_model_len``."""
    records = _read_records(path)
    random.Random(seed).shuffle(records)
    requests = []
    for record in records:
        if num is not None and len(requests) == num:
            break
        pair = _first_exchange(record.get("conversations") or record.get("conversation") or [])
        if pair is None:
            continue
        prompt, answer = encode(pair[0]), encode(pair[1])
        if prompt and answer and len(prompt) + len(answer) <= max_model_len:
            requests.append(BenchRequest(prompt, len(answer)))
    return _enough(requests, num, path, "usable conversations")


def prompt_file_requests(path: str | Path, encode: Encode, num: int | None = None, *,
                         default_max_tokens: int = 128) -> list[BenchRequest]:
    """The first ``num`` lines (all by default) of a JSONL file of ``{"prompt": ..., "max_tokens": n}``;
    a prompt is text (tokenized with ``encode``) or a list of token ids."""
    requests = []
    for i, record in enumerate(_read_records(path)):
        if num is not None and len(requests) == num:
            break
        prompt = record.get("prompt")
        if isinstance(prompt, str):
            ids = encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            raise ValueError(f"{path}: record {i}: 'prompt' must be text or a list of token ids")
        requests.append(BenchRequest(ids, int(record.get("max_tokens", default_max_tokens))))
    return _enough(requests, num, path, "prompts")


def random_token_ids(rng: random.Random, n: int, vocab_size: int, low: int = 0) -> list[int]:
    """``n`` token ids drawn uniformly from [low, vocab_size)."""
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def _read_records(path: str | Path) -> list[dict]:
    """A JSON list of objects, or one object per line (JSONL)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


HUMAN_ROLES = ("human", "user")
GPT_ROLES = ("gpt", "assistant", "chatgpt", "bard", "bing")


def _first_exchange(turns: Iterable[dict]) -> tuple[str, str] | None:
    """(first human turn, the gpt turn right after it), as text; None without such a pair.
    Turns are ``{"from": ..., "value": ...}`` (ShareGPT) or ``{"role": ..., "content": ...}``."""
    turns = [(t.get("from", t.get("role")), t.get("value", t.get("content"))) for t in turns]
    for (role, text), (next_role, answer) in zip(turns, turns[1:]):
        if role in HUMAN_ROLES:
            return (text, answer) if next_role in GPT_ROLES and text and answer else None
    return None


def _enough(requests: list[BenchRequest], num: int | None, path, what: str) -> list[BenchRequest]:
    if not requests or (num is not None and len(requests) < num):
        raise ValueError(f"{path}: {len(requests)} {what}, {num or 'at least 1'} needed")
    return requests


# ---------------------------------------------------------------- command line
DEFAULT_NUM_PROMPTS = 64


def add_dataset_arguments(parser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", choices=DATASETS, default="random",
                       help="request source: random token ids, a shared prefix + unique suffixes, a ShareGPT "
                            "file, or a JSONL file of prompts")
    group.add_argument("--dataset-path", help="the sharegpt or prompts file")
    group.add_argument("--num-prompts", type=int, default=None,
                       help=f"requests (default: {DEFAULT_NUM_PROMPTS}; for a file, all of it)")
    group.add_argument("--input-len", type=LengthSpec.parse, default=LengthSpec("fixed", 128),
                       help="prompt length (random) or unique suffix length (shared-prefix): N, LOW:HIGH "
                            "(uniform) or lognormal:MEAN[:SIGMA]")
    group.add_argument("--output-len", type=LengthSpec.parse, default=LengthSpec("fixed", 128),
                       help="tokens to generate per request, as --input-len (a prompts file's lines without "
                            "max_tokens take its first value)")
    group.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens of the common prefix")
    group.add_argument("--seed", type=int, default=0, help="seed of the sampled lengths, token ids and shuffles")


def load_requests(args, vocab_size: int, encode: Encode | None, max_model_len: int) -> list[BenchRequest]:
    """The requests the workload options describe, for a model of ``vocab_size`` tokens."""
    if args.dataset in ("sharegpt", "prompts"):
        if not args.dataset_path:
            raise ValueError(f"--dataset-path: required by --dataset {args.dataset}")
        if encode is None:
            raise ValueError(f"--dataset {args.dataset}: its text needs the model's tokenizer")
        if args.dataset == "sharegpt":
            return sharegpt_requests(args.dataset_path, encode, args.num_prompts, seed=args.seed,
                                     max_model_len=max_model_len)
        return prompt_file_requests(args.dataset_path, encode, args.num_prompts,
                                    default_max_tokens=args.output_len.low)
    num = args.num_prompts or DEFAULT_NUM_PROMPTS
    if args.dataset == "shared-prefix":
        return shared_prefix_requests(num, vocab_size, args.prefix_len, args.input_len, args.output_len,
                                      seed=args.seed, max_model_len=max_model_len)
    return random_requests(num, vocab_size, args.input_len, args.output_len, seed=args.seed,
                           max_model_len=max_model_len)


def describe(args) -> dict:
    """The workload options, for the result file."""
    return {"dataset": args.dataset, "dataset_path": args.dataset_path, "num_prompts": args.num_prompts,
            "input_len": str(args.input_len), "output_len": str(args.output_len),
            "prefix_len": args.prefix_len if args.dataset == "shared-prefix" else None, "seed": args.seed}
