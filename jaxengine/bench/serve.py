"""Serving benchmark: a load generator against a running OpenAI-compatible server (this engine's
``python -m jaxengine.serve`` or any other), streaming every request.

Requests arrive as a Poisson process at ``--request-rate`` (gamma-distributed gaps with
``--burstiness`` k; k = 1 is Poisson, below 1 burstier), all at once when the rate is inf, and
``--max-concurrency`` caps how many are in flight. Per request: TTFT (sent -> first chunk
carrying tokens), ITL (gaps between such chunks), TPOT ((e2e - TTFT) / (output tokens - 1)), e2e
latency, output tokens (the server's ``usage`` when it sends one, else the chunks counted).
The result also holds goodput under SLOs and the output tokens streamed in each second.

``--launch`` starts this engine's server for the run with the engine options given here (see
``launch``), so ``sweep`` can compare engine options under the same load::

    python -m jaxengine.bench sweep --grid request_rate=0.5,1,2 --grid enable_chunked_prefill=false,true \
        serve --launch --num-prompts 32 --input-len 256 --output-len 64 --ignore-eos
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field, replace
from urllib.parse import urlparse

import numpy as np

from jaxengine.bench.launch import launched_server
from jaxengine.engine_args import EngineArgs

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
REQUEST_TIMEOUT_S = 600        # the longest wait for any read: a stalled server fails its requests, not the run
SLO_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
ENDPOINT_PATHS = {"completions": "/completions", "chat": "/chat/completions"}
# Plain words for prompts that any tokenizer splits into a few tokens each.
WORDS = ("the of and to in is was for on that with as by at from his her an are which this be had not "
         "but have one they were all their there been has when who will more no if out so said what up "
         "its about into than them can only other new some could time these two may then do first any "
         "my now such like our over man me even most made after also did many before must through back "
         "years where much your way well down should because each just those people how too little state "
         "good very make world still own see men work long get here between both life being under never "
         "day same another know while last might us great old year off come since against go came right "
         "used take three").split()

Prompt = str | list[int]


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds, ``start_s`` from the benchmark's start."""

    prompt_tokens: int | None = None
    output_tokens: int = 0
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)     # token-carrying chunks, from the start
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times_s, self.chunk_times_s[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


# ---- where the load goes ----
def check_loopback(base_url: str, allow_remote: bool = False) -> None:
    """Raise ValueError for a server not on this machine unless ``allow_remote``: the load is
    heavy enough to be unwelcome on a server that did not ask for it."""
    host = urlparse(base_url).hostname or ""
    if allow_remote or host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass            # a host name other than localhost: treated as remote, not resolved
    raise ValueError(f"{base_url} is not a loopback address; pass --allow-remote to load it")


def discover_model(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at /models."""
    import httpx

    r = httpx.get(f"{base_url}/models", headers=auth_headers(api_key), timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---- prompts ----
def random_word_prompts(num: int, input_len: int, output_len: int, seed: int = 0) -> list[tuple[str, int]]:
    """``num`` prompts of ``input_len`` random words, each asking for ``output_len`` tokens."""
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(input_len)), output_len) for _ in range(num)]


def random_token_prompts(num: int, input_len: int, output_len: int, low: int, high: int,
                         seed: int = 0) -> list[tuple[list[int], int]]:
    """``num`` prompts of ``input_len`` token ids drawn from [low, high) (completions only)."""
    rng = random.Random(seed)
    return [([rng.randrange(low, high) for _ in range(input_len)], output_len) for _ in range(num)]


# ---- arrivals ----
def arrival_gaps(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds to wait after each request before the next: gamma with shape ``burstiness`` and
    mean 1 / rate (exponential, so Poisson arrivals, at burstiness 1); zeros at an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return rng.gamma(burstiness, 1.0 / (request_rate * burstiness), num).tolist()


# ---- one request ----
def request_body(endpoint: str, model: str, prompt: Prompt, max_tokens: int, extra: dict) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return {**body, **extra}


def carries_tokens(choice: dict) -> bool:
    """A streamed choice with generated tokens: neither a role announcement (chat's first chunk
    on some servers) nor a finish-only chunk. Text may be empty while a token is held back
    mid-character, so emptiness alone does not decide."""
    delta = choice.get("delta")
    text = choice.get("text") if delta is None else delta.get("content")
    if text:
        return True
    if delta is not None and delta.get("role"):
        return False
    return choice.get("finish_reason") is None


async def stream_request(client, url: str, body: dict, begin: float) -> RequestResult:
    """Send one streamed request; ``begin`` is the benchmark's start (perf_counter)."""
    import httpx

    result, sent = RequestResult(), time.perf_counter()
    result.start_s = sent - begin
    usage = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                    return result
                if any(carries_tokens(c) for c in chunk.get("choices") or ()):
                    result.chunk_times_s.append(time.perf_counter() - begin)
                usage = chunk.get("usage") or usage
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    finish_request(result, usage, body, time.perf_counter() - begin)
    return result


def finish_request(result: RequestResult, usage: dict | None, body: dict, end_s: float) -> None:
    if not result.chunk_times_s:
        result.error = "no tokens streamed"
        return
    result.e2e_s = end_s - result.start_s
    result.ttft_s = result.chunk_times_s[0] - result.start_s
    result.output_tokens = usage["completion_tokens"] if usage else len(result.chunk_times_s)
    if usage:
        result.prompt_tokens = usage["prompt_tokens"]
    elif isinstance(body.get("prompt"), list):
        result.prompt_tokens = len(body["prompt"])


# ---- the load ----
async def run_load(base_url: str, prompts: list[tuple[Prompt, int]], *, model: str, endpoint: str = "completions",
                   request_rate: float = math.inf, burstiness: float = 1.0, max_concurrency: int | None = None,
                   max_duration: float | None = None, extra_body: dict | None = None, api_key: str | None = None,
                   seed: int = 0, progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send ``prompts`` (prompt, max_tokens) as the arrival process says; -> (results of the
    requests sent, seconds from the first send to the last answer). No request is sent after
    ``max_duration`` seconds; those in flight then run to their end."""
    import httpx
    from tqdm.auto import tqdm

    url = base_url.rstrip("/") + ENDPOINT_PATHS[endpoint]
    gaps = arrival_gaps(len(prompts), request_rate, burstiness, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(prompts), desc="requests", disable=not progress)
    # Keep-alive shorter than servers' usual 5 s, so no request reuses a connection being closed.
    limits = httpx.Limits(max_connections=max_concurrency or 10_000, max_keepalive_connections=max_concurrency,
                          keepalive_expiry=1.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30), limits=limits,
                                 headers=auth_headers(api_key)) as client:
        begin = time.perf_counter()
        deadline = begin + max_duration if max_duration else math.inf

        async def one(prompt: Prompt, max_tokens: int) -> RequestResult | None:
            async with gate or contextlib.nullcontext():
                if time.perf_counter() >= deadline:
                    return None
                body = request_body(endpoint, model, prompt, max_tokens, extra_body or {})
                result = await stream_request(client, url, body, begin)
            bar.update()
            return result

        tasks = await arrive(prompts, gaps, deadline, one)
        results = [r for r in await asyncio.gather(*tasks) if r is not None]
        duration = time.perf_counter() - begin
    bar.close()
    return results, duration


async def arrive(prompts: list[tuple[Prompt, int]], gaps: list[float], deadline: float, send) -> list[asyncio.Task]:
    """Start ``send(prompt, max_tokens)`` for each prompt, ``gaps`` apart, until the deadline;
    no wait after the last one, which would only lengthen the measured run."""
    tasks = []
    for i, ((prompt, max_tokens), gap) in enumerate(zip(prompts, gaps)):
        tasks.append(asyncio.create_task(send(prompt, max_tokens)))
        if i + 1 == len(prompts) or time.perf_counter() + gap >= deadline:
            break
        await asyncio.sleep(gap)
    return tasks


# ---- the report ----
def percentiles(values_ms: list[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 and max in ms (None for no values: nothing made up, valid JSON)."""
    if not values_ms:
        return dict.fromkeys(("mean", "median", "p90", "p99", "max"))
    v = np.asarray(values_ms, dtype=float)
    return {"mean": float(v.mean()), "median": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99)), "max": float(v.max())}


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """Every SLO holds for ``r``; ``itl_ms`` is held by the 99th percentile of its own gaps."""
    gaps = r.itl_s
    values_ms = {"ttft_ms": r.ttft_s * 1e3, "e2e_ms": r.e2e_s * 1e3,
                 "tpot_ms": None if r.tpot_s is None else r.tpot_s * 1e3,
                 "itl_ms": float(np.percentile(gaps, 99)) * 1e3 if gaps else None}
    return all(values_ms[k] is None or values_ms[k] <= limit for k, limit in slos.items())


def tokens_per_second(results: list[RequestResult], duration: float) -> list[int]:
    """Output tokens streamed in each whole second of the run: a request's tokens spread over its
    chunks (evenly; the last chunks take the remainder), so the series sums to the total."""
    counts = [0] * max(1, math.ceil(duration))
    for r in results:
        share, extra = divmod(r.output_tokens, len(r.chunk_times_s))
        for i, t in enumerate(r.chunk_times_s):
            second = min(int(t), len(counts) - 1)
            counts[second] += share + (i >= len(r.chunk_times_s) - extra)
    return counts


def summarise(results: list[RequestResult], duration: float, slos: dict[str, float] | None = None) -> dict:
    """The report: counts, throughputs, latency percentiles (ms), goodput, the per-second series
    and every request."""
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    report = {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "total_input_tokens": prompt, "total_output_tokens": output,
        "request_throughput": len(ok) / duration, "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        "ttft_ms": percentiles([r.ttft_s * 1e3 for r in ok]),
        "tpot_ms": percentiles([r.tpot_s * 1e3 for r in ok if r.tpot_s is not None]),
        "itl_ms": percentiles([gap * 1e3 for r in ok for gap in r.itl_s]),
        "e2e_ms": percentiles([r.e2e_s * 1e3 for r in ok]),
    }
    if slos:
        report["goodput"] = sum(meets_slos(r, slos) for r in ok) / duration
    report["throughput_over_time"] = {"t_s": list(range(max(1, math.ceil(duration)))),
                                      "output_tokens": tokens_per_second(ok, duration)}
    report["errors"] = sorted({r.error for r in results if not r.ok})
    report["requests"] = [request_record(r) for r in results]
    return report


def request_record(r: RequestResult) -> dict:
    record = asdict(r)
    record.pop("chunk_times_s")
    record.update(ok=r.ok, ttft_ms=_ms(r.ttft_s), e2e_ms=_ms(r.e2e_s), tpot_ms=_ms(r.tpot_s),
                  itl_ms=[gap * 1e3 for gap in r.itl_s])
    for key in ("ttft_s", "e2e_s"):
        record.pop(key)
    return record


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def benchmark(base_url: str, prompts: list[tuple[Prompt, int]], *, model: str | None = None,
              endpoint: str = "completions", request_rate: float = math.inf, burstiness: float = 1.0,
              max_concurrency: int | None = None, max_duration: float | None = None,
              extra_body: dict | None = None, api_key: str | None = None, slos: dict[str, float] | None = None,
              seed: int = 0, progress: bool = True) -> dict:
    """Run the load and report it (the ``serve`` mode's result, less its configuration)."""
    model = model or discover_model(base_url, api_key)
    results, duration = asyncio.run(run_load(
        base_url, prompts, model=model, endpoint=endpoint, request_rate=request_rate, burstiness=burstiness,
        max_concurrency=max_concurrency, max_duration=max_duration, extra_body=extra_body, api_key=api_key,
        seed=seed, progress=progress))
    return {"mode": "serve", "model": model, **summarise(results, duration, slos)}


# ---- command line ----
def parse_slo(text: str) -> tuple[str, float]:
    key, _, value = text.partition("=")
    if key not in SLO_KEYS or not value:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(SLO_KEYS)} as KEY=MILLISECONDS, got {text!r}")
    return key, float(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL, help="the server's OpenAI API root")
    parser.add_argument("--allow-remote", action="store_true", help="allow a base URL not on loopback")
    parser.add_argument("--model", default=None,
                        help="model name to request (default: the server's first); with --launch, the "
                             "checkpoint the launched server loads (default: the embedded default model)")
    parser.add_argument("--launch", action="store_true",
                        help="start this engine's server for the run (on a free loopback port, with the "
                             "engine options below; --base-url is then ignored), so that sweep can vary them")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--max-duration", type=float, default=None, help="send no request after this many s")
    parser.add_argument("--slo", type=parse_slo, action="append", default=[], metavar="KEY=MS",
                        help=f"goodput SLO, repeatable; keys {', '.join(SLO_KEYS)} (itl_ms: the 99th "
                             "percentile of each request's own gaps)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="exactly max_tokens per request (a vLLM extra)")
    parser.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    _add_prompt_arguments(parser)
    EngineArgs.add_cli_args(parser, skip=("model",))


def _add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=128, help="prompt length in words (or token ids)")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--token-ids", type=int, nargs=2, metavar=("LOW", "HIGH"), default=None,
                        help="prompts of random token ids in [LOW, HIGH) instead of words (completions only)")


def prompts_from_args(args: argparse.Namespace) -> list[tuple[Prompt, int]]:
    if args.token_ids:
        return random_token_prompts(args.num_prompts, args.input_len, args.output_len, *args.token_ids, seed=args.seed)
    return random_word_prompts(args.num_prompts, args.input_len, args.output_len, seed=args.seed)


def run(args: argparse.Namespace) -> dict:
    engine_args = EngineArgs.from_cli_args(args)
    if not args.launch:
        if replace(engine_args, model=None).to_cli_args():
            raise ValueError("engine options configure a launched server: add --launch, or set them on the server")
        return run_against(args, args.base_url)
    # The launched server compiles every bucket before it serves: the run measures steady serving.
    engine_args = replace(engine_args, compile_mode="eager")
    with launched_server(engine_args) as server:
        result = run_against(argparse.Namespace(**{**vars(args), "model": None}), server.api_url)
        return {**result, "engine_args": asdict(engine_args), "server_settings": server_settings(server.api_url)}


def server_settings(base_url: str) -> dict:
    """What a server of this engine runs with (the dashboard's settings: the engine options as
    given and as resolved, e.g. the KV pool's size)."""
    import httpx

    root = base_url.removesuffix("/").removesuffix("/v1")
    return httpx.get(f"{root}/dashboard/state", timeout=30).json()["settings"]


def run_against(args: argparse.Namespace, base_url: str) -> dict:
    """The load of ``args`` against the server at ``base_url``."""
    check_loopback(base_url, args.allow_remote)
    extra = {"temperature": args.temperature, **({"ignore_eos": True} if args.ignore_eos else {}), **args.extra_body}
    slos = dict(args.slo)
    result = benchmark(base_url, prompts_from_args(args), model=args.model, endpoint=args.endpoint,
                       request_rate=args.request_rate, burstiness=args.burstiness,
                       max_concurrency=args.max_concurrency, max_duration=args.max_duration, extra_body=extra,
                       api_key=args.api_key, slos=slos, seed=args.seed, progress=args.progress)
    config = {"base_url": base_url, "endpoint": args.endpoint,
              "request_rate": None if math.isinf(args.request_rate) else args.request_rate,      # None: all at once
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
              "num_prompts": args.num_prompts, "max_duration": args.max_duration, "slo": slos}
    return {"mode": "serve", "config": config, **result}
