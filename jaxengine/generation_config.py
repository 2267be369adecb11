"""Request defaults from the checkpoint: the sampling fields of its ``generation_config.json``,
used where a request leaves them unset (vLLM's ``--generation-config auto``, the default)."""
from __future__ import annotations

from pathlib import Path

from jaxengine.paths import read_json_object
from jaxengine.sampling_params import SamplingParams

# generation_config.json's name -> SamplingParams' field
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
INTEGER_FIELDS = ("top_k", "max_tokens")


def _whole(value):
    """Some files write integers as floats (``"top_k": 50.0``): a whole float is read as its integer."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def generation_defaults(setting: str, model_path: str | Path) -> dict:
    """``setting``: "vllm" (none: the engine's own defaults), "auto" (the model folder's
    generation_config.json, if it has one) or a folder holding one. -> {SamplingParams field:
    value} for the fields the file sets; a value SamplingParams refuses is an error naming
    the field and the file, a file that is not a JSON object a CheckpointFileError naming it."""
    if setting == "vllm":
        return {}
    folder = Path(model_path) if setting == "auto" else Path(setting)
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting == "auto":
            return {}                       # a GGUF file, a model module, a folder without one
        raise ValueError(f"generation_config: {folder} has no generation_config.json (give auto, vllm or a "
                         f"folder that has one)")
    raw = read_json_object(path)
    defaults = {ours: _whole(raw[theirs]) if ours in INTEGER_FIELDS else raw[theirs]
                for theirs, ours in GENERATION_FIELDS.items() if raw.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as error:
        raise ValueError(f"generation_config: {path}: {error}") from None
    return defaults
