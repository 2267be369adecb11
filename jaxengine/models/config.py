"""The model's shape, read from a Hugging Face config (or GGUF metadata through transformers)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnScaling:
    """YaRN: frequencies interpolated by ``factor`` below a band of rotations, kept above it, a
    linear ramp between; cos and sin scaled by the attention factor."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None      # None: from factor (and mscale, mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


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
    rope_scaling: RopeScaling | YarnScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False     # Qwen2: biases on q, k, v
    output_bias: bool = False        # Llama/Qwen3/gpt-oss with attention_bias: a bias on o_proj too
    qk_norm: bool = False            # Qwen3: RMSNorm on q and k per head
    attention_sinks: bool = False    # gpt-oss: a learned sink logit per query head
    sliding_window: int | None = None
    full_attention_layers: tuple[int, ...] = ()   # layers that ignore sliding_window (gpt-oss: every other)
    # Mixture of experts (0 experts: a dense MLP in every layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True          # renormalise the chosen experts' weights to sum to 1
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE: a sigmoid-gated expert every token runs
    dense_layers: tuple[int, ...] = ()   # layers of an MoE model with a dense MLP instead
    router_bias: bool = False            # gpt-oss: the router's linear layer has a bias
    expert_bias: bool = False            # gpt-oss: biases on every expert's gate/up and down
    swiglu_limit: float | None = None    # gpt-oss's clamped SwiGLU (None: the plain one)
    swiglu_alpha: float = 1.702          # its sigmoid's gain
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Weights kept quantized: (kind, format, group, offset) per kind of weight (q_proj, ...,
    # down_proj, embed_tokens, lm_head) that is, the format one of ``kernels.matmul.quantized``'s
    # FORMATS (int8, int4, fp8); ``models.quantization`` says how (empty: none is).
    quantization: tuple[tuple[str, str, int, bool], ...] = ()
    # The checkpoint holds a K and a V scale per layer (self_attn.k_scale / v_scale) for an FP8 KV
    # cache; without them an FP8 cache's scales are 1.0.
    kv_scales: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                             f"num_experts ({self.num_experts})")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_params(self) -> int:
        """Parameters the model holds (embedding and LM head included)."""
        return self._params(active=False)

    @property
    def num_active_params(self) -> int:
        """Parameters one token runs through: of a mixture of experts' routed experts only the
        ``num_experts_per_tok`` it chose (what a step's FLOPs follow)."""
        return self._params(active=True)

    @property
    def routed_pairs_per_token(self) -> int:
        """Token-expert pairs one token makes (top-k times the sparse layers; 0 for a dense model)."""
        return self.num_experts_per_tok * len(self.sparse_layers)

    def _params(self, active: bool) -> int:
        d, h = self.hidden_size, self.head_dim
        attention = d * (self.num_heads + 2 * self.num_kv_heads) * h + self.num_heads * h * d
        attention += (self.num_heads + 2 * self.num_kv_heads) * h if self.attention_bias else 0
        attention += d if self.output_bias else 0
        attention += 2 * h if self.qk_norm else 0
        attention += self.num_heads if self.attention_sinks else 0
        dense_mlp = 3 * d * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        expert = 3 * d * self.moe_intermediate_size + (2 * self.moe_intermediate_size + d if self.expert_bias else 0)
        moe = d * self.num_experts + (self.num_experts if self.router_bias else 0) + experts * expert
        if self.shared_expert_intermediate_size:
            moe += 3 * d * self.shared_expert_intermediate_size + d
        sparse = len(self.sparse_layers)
        layers = self.num_layers * (attention + 2 * d) + sparse * moe + (self.num_layers - sparse) * dense_mlp
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return layers + self.vocab_size * d + head + d

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to the whole context)."""
        return None if layer in self.full_attention_layers else self.sliding_window

    @property
    def mixes_windows(self) -> bool:
        """Whether some layers slide and others attend to everything (chosen per layer in the scan)."""
        return self.sliding_window is not None and 0 < len(self.full_attention_layers) < self.num_layers

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is the mixture of experts."""
        return tuple(i for i in range(self.num_layers) if self.is_moe and i not in self.dense_layers)

    def quant_spec(self, kind: str) -> tuple[str, int, bool] | None:
        """(format, group, offset) of weights of ``kind`` when they are kept quantized, else None."""
        return next(((b, g, o) for k, b, g, o in self.quantization if k == kind), None)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """From a ``transformers`` config object (transformers 5 keeps RoPE in ``rope_parameters``).
        A ``quantization_config`` is read with the tensors (``models.stored_quantization``)."""
        arch = (getattr(hf, "architectures", None) or [_default_architecture(hf.model_type)])[0]
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type: {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                                  float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        elif rope_type == "yarn":
            original = int(rope["original_max_position_embeddings"])
            factor = rope.get("factor") or hf.max_position_embeddings / original
            scaling = YarnScaling(float(factor), original, float(rope.get("beta_fast") or 32),
                                  float(rope.get("beta_slow") or 1), rope.get("attention_factor"), rope.get("mscale"),
                                  rope.get("mscale_all_dim"), bool(rope.get("truncate", True)))
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        return cls(
            architecture=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads, head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)),
            rope_scaling=scaling, max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=(hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))
                            or bool(getattr(hf, "qkv_bias", False) and hf.model_type == "qwen2_moe")),
            output_bias=hf.model_type in _OUTPUT_BIAS and bool(getattr(hf, "attention_bias", False)),
            qk_norm=hf.model_type in ("qwen3", "qwen3_moe"), attention_sinks=hf.model_type == "gpt_oss",
            **_attention_windows(hf), **_experts(hf),
            bos_token_id=getattr(hf, "bos_token_id", None), eos_token_id=getattr(hf, "eos_token_id", None))


# The model types whose o_proj has a bias when ``attention_bias`` is set (Qwen2's never has).
_OUTPUT_BIAS = ("llama", "qwen3", "qwen3_moe", "gpt_oss")
# The model types whose attention uses ``sliding_window`` in every layer whenever it is set; the
# others as their ``layer_types`` say (older configs: ``use_sliding_window``).
_ALWAYS_SLIDING = ("mistral", "mixtral", "qwen3_moe")
_LAYER_KINDS = ("sliding_attention", "full_attention")


def _attention_windows(hf) -> dict:
    """``sliding_window`` and the ``full_attention_layers`` that ignore it."""
    window = getattr(hf, "sliding_window", None) or None
    if window is None:
        return {}
    if hf.model_type in _ALWAYS_SLIDING:
        return dict(sliding_window=window)
    kinds = list(getattr(hf, "layer_types", None) or [])
    if not kinds:
        return dict(sliding_window=window) if getattr(hf, "use_sliding_window", False) else {}
    if unknown := sorted(set(kinds) - set(_LAYER_KINDS)):
        raise ValueError(f"layer_types: {unknown} not supported (supported: {list(_LAYER_KINDS)})")
    full = tuple(i for i, kind in enumerate(kinds) if kind == "full_attention")
    if len(full) == len(kinds):
        return {}
    return dict(sliding_window=window, full_attention_layers=full)


def _experts(hf) -> dict:
    """The mixture-of-experts fields of the Mixtral / Qwen2-MoE / Qwen3-MoE / gpt-oss configs (none
    for others)."""
    if hf.model_type == "gpt_oss":
        # Its router takes the softmax of the top-k logits: the renormalised top-k of the softmax.
        return dict(num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.intermediate_size, norm_topk_prob=True, router_bias=True,
                    expert_bias=True, swiglu_limit=float(hf.swiglu_limit),
                    swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)))
    if hf.model_type == "mixtral":
        return dict(num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.intermediate_size, norm_topk_prob=True)
    if hf.model_type not in ("qwen2_moe", "qwen3_moe"):
        return {}
    experts = getattr(hf, "num_experts", None) or hf.num_local_experts
    step, only = getattr(hf, "decoder_sparse_step", 1) or 1, set(getattr(hf, "mlp_only_layers", None) or [])
    dense = tuple(i for i in range(hf.num_hidden_layers) if i in only or (i + 1) % step)
    return dict(num_experts=experts, num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                shared_expert_intermediate_size=getattr(hf, "shared_expert_intermediate_size", 0) or 0,
                dense_layers=dense)


def _default_architecture(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}.get(model_type, model_type)
