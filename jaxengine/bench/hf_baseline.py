"""The transformers baseline: ``AutoModelForCausalLM.generate`` in static batches on the CPU
(torch, float32), greedy, on the same checkpoint (a Hugging Face folder, or a GGUF file through
transformers' GGUF loading). Needs torch and transformers (the ``bench`` extra).

Each batch is left-padded to its longest prompt and generates its longest output
(``min_new_tokens=max_new_tokens``); a request's tokens are the first ``output_len`` of its row.
EOS is also switched off in the generation config: the engine runs with ``ignore_eos``, which
still lets EOS be sampled, while ``min_new_tokens`` alone would mask it and change the greedy
tokens."""
from __future__ import annotations

import time
from pathlib import Path

from tqdm.auto import tqdm

from jaxengine.bench.datasets import BenchRequest


def run_hf(model_path: str | Path, requests: list[BenchRequest], batch_size: int,
           progress: bool = True, num_beams: int = 1) -> tuple[dict, list]:
    """Time the requests through transformers; returns (figures, generated token ids per request:
    with ``num_beams`` > 1, its beam search's ``num_beams`` hypotheses, best first)."""
    import torch

    start = time.perf_counter()
    model = load_hf_model(Path(model_path))
    load_s = time.perf_counter() - start
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    tokens: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in tqdm(batches, desc="transformers baseline", unit="batch", disable=not progress):
            tokens += _generate(model, batch, num_beams)
    return {"elapsed_s": time.perf_counter() - start, "load_s": load_s, "batch_size": batch_size,
            "torch_threads": torch.get_num_threads()}, tokens


def load_hf_model(path: Path):
    """The checkpoint as a float32 transformers model: a folder with config.json, a .gguf file,
    or a folder holding one .gguf file."""
    import torch
    from transformers import AutoModelForCausalLM

    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"--baseline hf: {path} has no config.json and {len(ggufs)} .gguf files (1 needed)")
        path = ggufs[0]
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None          # generate every token asked for (see above)
    return model.eval()


def _generate(model, batch: list[BenchRequest], num_beams: int = 1) -> list:
    import torch

    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch])
    mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch])
    steps = max(r.output_len for r in batch)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, pad_token_id=0, num_beams=num_beams, num_return_sequences=num_beams)
    rows = [row[width:width + r.output_len].tolist() for row, r in zip(out, (r for r in batch for _ in range(num_beams)))]
    if num_beams == 1:
        return rows
    return [rows[i:i + num_beams] for i in range(0, len(rows), num_beams)]
