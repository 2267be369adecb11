"""The model's shape, read from a Hugging Face config (or GGUF metadata through transformers)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False     # Qwen2: biases on q, k, v
    qk_norm: bool = False            # Qwen3: RMSNorm on q and k per head
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """From a ``transformers`` config object (transformers 5 keeps RoPE in ``rope_parameters``)."""
        arch = (getattr(hf, "architectures", None) or [_default_architecture(hf.model_type)])[0]
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type: {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                                  float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        window = getattr(hf, "sliding_window", None)
        if hf.model_type != "mistral" and not getattr(hf, "use_sliding_window", False):
            window = None
        return cls(
            architecture=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads, head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)),
            rope_scaling=scaling, max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            qk_norm=hf.model_type == "qwen3", sliding_window=window,
            bos_token_id=getattr(hf, "bos_token_id", None), eos_token_id=getattr(hf, "eos_token_id", None))


def _default_architecture(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}.get(model_type, model_type)
