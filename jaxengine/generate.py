"""python -m jaxengine.generate --input prompts.jsonl --output results.jsonl: batch generation.

Each input line is a JSON object with an ``id`` and a ``prompt`` (text or token ids) or
``messages`` (chat), plus optional sampling fields (``max_tokens``, ``temperature``, ``stop``,
...) and a ``model`` (a LoRA adapter's name from ``--lora-modules`` runs the line with that
adapter; any other name, the model), or a line of OpenAI's batch-file format (``custom_id``,
``url``, ``body``). Each output
line carries the id, the text (a list for ``n`` > 1), token counts and the finish reason.
Resumable: ids already in the output file are skipped. A malformed line is reported with its
line number and the rest still runs (the exit status is then 1).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from tqdm.auto import tqdm

from jaxengine.engine_args import EngineArgs, HelpFormatter
from jaxengine.logs import add_log_level_arg, configure_logging
from jaxengine.sampling_params import SamplingParams
from jaxengine.tokenizer import apply_chat_template

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
BATCH_URLS = {"/v1/completions", "/v1/chat/completions"}


@dataclass
class Job:
    line_number: int
    id: str
    prompt: str | list[int] | None
    messages: list[dict] | None
    params: dict
    model: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jaxengine.generate", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--input", required=True, type=Path, help="JSONL file of prompts")
    parser.add_argument("--output", required=True, type=Path, help="JSONL file of results (appended to)")
    parser.add_argument("--chunk-size", type=int, default=256, help="lines handed to the engine at a time")
    add_log_level_arg(parser, default="warning")
    g = parser.add_argument_group("sampling (defaults for lines that don't set them)")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    EngineArgs.add_cli_args(parser)
    return parser.parse_args(argv)


def parse_line(line_number: int, line: str) -> Job:
    """One input line -> a Job; ValueError says what is wrong with it."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg})") from None
    if not isinstance(record, dict):
        raise ValueError("must be a JSON object")
    if "custom_id" in record:                              # OpenAI batch-file line
        if record.get("url") not in BATCH_URLS:
            raise ValueError(f"url: must be one of {sorted(BATCH_URLS)}")
        job_id, record = record["custom_id"], dict(record.get("body") or {})
    else:
        job_id = record.pop("id", None)
    if job_id is None:
        raise ValueError("id: missing")
    prompt, messages = record.pop("prompt", None), record.pop("messages", None)
    if (prompt is None) == (messages is None):
        raise ValueError("needs exactly one of prompt or messages")
    if "max_completion_tokens" in record:
        record["max_tokens"] = record.pop("max_completion_tokens")
    params = {k: v for k, v in record.items() if k in SAMPLING_FIELDS}
    model = record.get("model")
    return Job(line_number, str(job_id), prompt, messages, params, model if isinstance(model, str) else None)


def read_jobs(path: Path, done: set[str]) -> tuple[list[Job], list[str]]:
    """-> (jobs not yet in the output, problems as 'line N: ...')."""
    jobs, problems = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            job = parse_line(number, line)
        except ValueError as error:
            problems.append(f"line {number}: {error}")
            continue
        if job.id not in done:
            jobs.append(job)
    return jobs, problems


def done_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    ids = set()
    for line in path.read_text().splitlines():
        try:
            ids.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue                       # a line cut short by an interrupted run: redo it
    return ids


def defaults(args: argparse.Namespace) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed, n=args.n, stop=args.stop or [])


def prepare(llm, job: Job, base: dict) -> tuple[list[int], SamplingParams]:
    """Tokenise and validate one job; ValueError names what is wrong."""
    params = SamplingParams(**{**base, **job.params})
    ids = apply_chat_template(llm.tokenizer, job.messages) if job.messages is not None else llm.encode(job.prompt)
    llm.check_request(ids, params)
    return ids, params


def result_record(job: Job, output) -> dict:
    texts = [c.text for c in output.outputs]
    return {"id": job.id, "text": texts[0] if len(texts) == 1 else texts,
            "prompt_tokens": len(output.prompt_token_ids),
            "completion_tokens": sum(len(c.token_ids) for c in output.outputs),
            "finish_reason": output.outputs[0].finish_reason if len(texts) == 1 else
            [c.finish_reason for c in output.outputs]}


def run(args: argparse.Namespace, llm) -> int:
    jobs, problems = read_jobs(args.input, done_ids(args.output))
    base = defaults(args)
    with args.output.open("a") as out, tqdm(total=len(jobs), desc="generating", unit="prompt") as bar:
        for start in range(0, len(jobs), args.chunk_size):
            ready = []
            for job in jobs[start:start + args.chunk_size]:
                try:
                    ready.append((job, *prepare(llm, job, base)))
                except Exception as error:      # noqa: BLE001 - any bad line is reported, the rest runs
                    problems.append(f"line {job.line_number}: {error}")
            if ready:
                outputs = llm.generate([ids for _, ids, _ in ready], [p for _, _, p in ready], use_tqdm=False,
                                       lora_request=[getattr(llm, "loras", {}).get(job.model) for job, _, _ in ready])
                for (job, _, _), output in zip(ready, outputs):
                    out.write(json.dumps(result_record(job, output)) + "\n")
                out.flush()
            bar.update(len(jobs[start:start + args.chunk_size]))
    for problem in sorted(problems, key=lambda p: int(p.split()[1].rstrip(":"))):
        print(f"{args.input}: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    engine_args = EngineArgs.from_cli_args(args)
    from jaxengine.multihost_worker import join_job

    if (status := join_job(engine_args, "python -m jaxengine.generate")) is not None:
        return status
    if not args.input.exists():
        print(f"--input: {args.input} does not exist", file=sys.stderr)
        return 2
    from jaxengine.llm import LLM

    return run(args, LLM.from_engine_args(engine_args))


if __name__ == "__main__":
    sys.exit(main())
