"""Hugging Face ``architectures`` name -> model class."""
from __future__ import annotations

from jaxengine.models.llama import LlamaForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}") from None
