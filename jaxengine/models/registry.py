"""Hugging Face ``architectures`` name -> model class, and that model built with nothing allocated."""
from __future__ import annotations

from flax import nnx

from jaxengine.models.config import ModelConfig
from jaxengine.models.llama import LlamaForCausalLM
from jaxengine.models.mtp import MTP_ARCHITECTURE, MTPHead
from jaxengine.models.nemotron_h import NemotronHForCausalLM
from jaxengine.models.qwen3_5 import Qwen3_5ForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "GptOssForCausalLM": LlamaForCausalLM,
    "DeepseekV3ForCausalLM": LlamaForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
}
# Parts of a checkpoint built as models of their own, never named by a config's architectures.
_PARTS = {MTP_ARCHITECTURE: MTPHead}    # its multi-token prediction layer (models.mtp)


def get_model_class(architecture: str) -> type:
    try:
        return ARCHITECTURES[architecture] if architecture in ARCHITECTURES else _PARTS[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}") from None


def abstract_model(cfg: ModelConfig, dtype, model_kwargs: dict) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of the model for ``cfg`` with nothing allocated."""
    model_cls = get_model_class(cfg.architecture)
    return nnx.split(nnx.eval_shape(lambda: model_cls(cfg, dtype, rngs=nnx.Rngs(0), **model_kwargs)))
