"""The model's shape, read from a Hugging Face config (or GGUF metadata through transformers)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

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
class GatedDeltaNetShape:
    """A Gated DeltaNet layer's sizes (Qwen3.5's linear attention), in the names of transformers'
    Qwen3.5 config."""

    hidden_size: int
    num_key_heads: int          # linear_num_key_heads
    num_value_heads: int        # linear_num_value_heads (a multiple of the key heads)
    key_head_dim: int           # linear_key_head_dim
    value_head_dim: int         # linear_value_head_dim
    conv_kernel: int = 4        # linear_conv_kernel_dim
    rms_norm_eps: float = 1e-6

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One sequence's (convolution window, matrix state) shapes."""
        return (self.conv_kernel - 1, self.conv_dim), (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    @property
    def num_params(self) -> int:
        """One layer's parameters."""
        d, h = self.hidden_size, self.num_value_heads
        return (d * (self.conv_dim + self.value_dim + 2 * h) + self.conv_kernel * self.conv_dim + 2 * h
                + self.value_head_dim + self.value_dim * d)


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba-2 layer's sizes (Nemotron-H's), in the names of transformers' Nemotron-H config."""

    hidden_size: int
    num_heads: int              # mamba_num_heads
    head_dim: int               # mamba_head_dim
    state_size: int             # ssm_state_size
    num_groups: int             # n_groups: B and C are shared by num_heads / num_groups heads each
    conv_kernel: int = 4
    conv_bias: bool = True      # use_conv_bias
    proj_bias: bool = False     # use_bias: on in_proj and out_proj
    dt_min: float = 0.0         # time_step_limit: softplus(dt + dt_bias) clamped to it
    dt_max: float = float("inf")
    rms_norm_eps: float = 1e-5

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C side by side."""
        return self.inner_dim + 2 * self.num_groups * self.state_size

    @property
    def projection_dim(self) -> int:
        """in_proj's outputs: the gate z, the convolution's input and dt."""
        return self.inner_dim + self.conv_dim + self.num_heads

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One sequence's (convolution window, SSM state) shapes."""
        return (self.conv_kernel - 1, self.conv_dim), (self.num_heads, self.head_dim, self.state_size)

    @property
    def num_params(self) -> int:
        """One layer's parameters."""
        d, i = self.hidden_size, self.inner_dim
        return (d * self.projection_dim + self.conv_kernel * self.conv_dim + 3 * self.num_heads + i + i * d
                + (self.conv_dim if self.conv_bias else 0) + (self.projection_dim + d if self.proj_bias else 0))


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
    # Multi-head latent attention (DeepSeek-V2/V3), on when kv_lora_rank > 0: keys and values come
    # from a latent of kv_lora_rank per token plus one rotary key of qk_rope_head_dim (= head_dim)
    # shared by the heads; queries through a q_lora_rank bottleneck (None: straight from D).
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    mscale_all_dim: float = 0.0          # YaRN's factor on the softmax scale (squared), DeepSeek's way
    rope_interleave: bool = False        # the checkpoint's rotary dimensions in pairs (x0, x1), (x2, x3)...
    num_mtp_layers: int = 0              # multi-token prediction layers after the decoder's (layers L...)
    # DeepSeek-V3's router: sigmoid scores, a per-expert bias added for the choice only, the top
    # topk_group of n_group expert groups (each scored by its two best), weights times
    # routed_scaling_factor; its shared experts run ungated.
    scoring: str = "softmax"             # or "sigmoid"
    score_correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True     # Qwen2-MoE's sigmoid gate on its shared expert
    # Hybrid models (Qwen3.5, Nemotron-H): the layers whose memory is a recurrent state (sized
    # by ``linear_attention``) instead of a KV cache; the others attend.
    linear_attention_layers: tuple[int, ...] = ()
    linear_attention: GatedDeltaNetShape | Mamba2Shape | None = None
    # Nemotron-H's blocks are one part each: a token mixer alone (its Mamba-2 and attention
    # layers) or an MLP alone (its MLP and mixture-of-experts layers), one norm before it.
    mixer_only_layers: tuple[int, ...] = ()
    mlp_only_layers: tuple[int, ...] = ()
    mlp_activation: str = "silu"         # "silu": SwiGLU (gate and up); "relu2": relu(up)^2, no gate
    moe_latent_size: int | None = None   # Nemotron-H: the experts run on a projection of this width
    partial_rotary_factor: float = 1.0   # Qwen3.5: RoPE turns the first quarter of each head only
    attention_output_gate: bool = False  # Qwen3.5: q_proj gives a gate per head; output x sigmoid(gate)
    norm_offset: float = 0.0             # Qwen3.5's zero-centred norms: x * (1 + w)
    # The language model of a vision-language checkpoint (Qwen3.5's published ones): its tensors
    # under ``model.language_model.``, the vision tower's left unread (text in, text out).
    language_model_of: str | None = None      # the checkpoint's own architecture

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                             f"num_experts ({self.num_experts})")
        if self.scoring == "sigmoid":
            self._check_groups()
        if self.linear_attention_layers and self.linear_attention is None:
            raise ValueError("linear_attention_layers need the linear_attention shape")

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a recurrent state instead of a KV cache."""
        return bool(self.linear_attention_layers)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep KV (all but the recurrent ones and those that are an MLP alone)."""
        return tuple(i for i in range(self.num_layers)
                     if i not in self.linear_attention_layers and i not in self.mlp_only_layers)

    @property
    def num_kv_layers(self) -> int:
        return len(self.kv_layers)

    @property
    def mlp_layers(self) -> tuple[int, ...]:
        """The layers with an MLP or a mixture of experts (all but Nemotron-H's token mixers)."""
        return tuple(i for i in range(self.num_layers) if i not in self.mixer_only_layers)

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head that RoPE turns (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def state_slot_sizes(self) -> tuple[int, ...]:
        """Numbers one sequence's recurrent state holds in each of its arrays, per recurrent layer:
        (the convolution window, the matrix state) flattened; () without recurrent layers."""
        if not self.is_hybrid:
            return ()
        return tuple(int(np.prod(shape)) for shape in self.linear_attention.state_shapes())

    @property
    def state_bytes_per_slot(self) -> int:
        """A recurrent state slot's bytes, all recurrent layers (kept in float32)."""
        return 4 * len(self.linear_attention_layers) * sum(self.state_slot_sizes())

    def _check_groups(self) -> None:
        """DeepSeek-V3's expert groups, in its config's names."""
        groups, kept = self.n_group, self.topk_group
        if groups < 1 or self.num_experts % groups:
            raise ValueError(f"n_group ({groups}) must divide n_routed_experts ({self.num_experts})")
        size = self.num_experts // groups
        if not 1 <= kept <= groups:
            raise ValueError(f"topk_group ({kept}) must be between 1 and n_group ({groups})")
        if groups > 1 and size < 2:
            raise ValueError(f"n_group ({groups}): each group needs 2 experts or more (its score is its best two)")
        if self.num_experts_per_tok > kept * size:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of the "
                             f"topk_group ({kept}) groups kept ({kept * size})")

    def context_length(self) -> tuple[int, str]:
        """(the longest context the model's positions were made for, where that number comes
        from), as vLLM derives it: ``max_position_embeddings``, or with YaRN
        ``original_max_position_embeddings`` x ``factor`` where that is longer (Llama 3's
        max_position_embeddings already counts its scaling)."""
        sc = self.rope_scaling
        if isinstance(sc, YarnScaling) and (scaled := int(sc.original_max_position_embeddings * sc.factor)) > \
                self.max_position_embeddings:
            return scaled, (f"original_max_position_embeddings {sc.original_max_position_embeddings} x YaRN factor "
                            f"{sc.factor:g}")
        return self.max_position_embeddings, f"max_position_embeddings {self.max_position_embeddings}"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention: the KV cache holds one latent and rotary key per token."""
        return self.kv_lora_rank > 0

    @property
    def kv_cache_parts(self) -> tuple[tuple[int, int], ...]:
        """(heads, head size) of each array of the KV cache: K and V, or MLA's one array of
        latent and rotary key side by side (one "head" per token, whatever the query heads)."""
        if self.is_mla:
            return ((1, self.kv_lora_rank + self.head_dim),)
        return ((self.num_kv_heads, self.head_dim),) * 2

    def kv_block_shapes(self, block_size: int) -> list[tuple[int, int]]:
        """One block's shape [S, K*H] in each array of the KV cache (heads one after another)."""
        return [(block_size, heads * size) for heads, size in self.kv_cache_parts]

    @property
    def kv_elements_per_token(self) -> int:
        """Numbers the KV cache holds per token, all layers."""
        return self.num_kv_layers * sum(heads * size for heads, size in self.kv_cache_parts)

    @property
    def qk_head_dim(self) -> int:
        """An MLA query head's size: its part without position and its rotary part."""
        return self.qk_nope_head_dim + self.head_dim

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
        attention = d * (self.num_heads * (2 if self.attention_output_gate else 1) + 2 * self.num_kv_heads) * h \
            + self.num_heads * h * d
        if self.is_mla:
            attention = self.latent_attention_params
        attention += (self.num_heads + 2 * self.num_kv_heads) * h if self.attention_bias else 0
        attention += d if self.output_bias else 0
        attention += 2 * h if self.qk_norm else 0
        attention += self.num_heads if self.attention_sinks else 0
        mats = 3 if self.mlp_activation == "silu" else 2          # gate, up, down; or up, down
        dense_mlp = mats * d * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        width = self.moe_latent_size or d
        expert = mats * width * self.moe_intermediate_size + (
            2 * self.moe_intermediate_size + d if self.expert_bias else 0)
        moe = d * self.num_experts + (self.num_experts if self.router_bias else 0) + experts * expert
        moe += 2 * d * self.moe_latent_size if self.moe_latent_size else 0
        if self.shared_expert_intermediate_size:
            moe += mats * d * self.shared_expert_intermediate_size + (d if self.shared_expert_gated else 0)
        moe += self.num_experts if self.score_correction_bias else 0
        sparse = len(self.sparse_layers)
        norms = (1 if self.mixer_only_layers or self.mlp_only_layers else 2) * d
        layers = self.num_kv_layers * attention + self.num_layers * norms + sparse * moe \
            + (len(self.mlp_layers) - sparse) * dense_mlp
        if self.is_hybrid:
            layers += len(self.linear_attention_layers) * self.linear_attention.num_params
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return layers + self.vocab_size * d + head + d

    @property
    def latent_attention_params(self) -> int:
        """Latent attention's projection parameters in one layer (norms included)."""
        d, n, r = self.hidden_size, self.num_heads, self.kv_lora_rank
        q = d * n * self.qk_head_dim if self.q_lora_rank is None else (
            d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * self.qk_head_dim)
        return q + d * (r + self.head_dim) + r + r * n * (self.qk_nope_head_dim + self.v_head_dim) + n * self.v_head_dim * d

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to the whole context)."""
        return None if layer in self.full_attention_layers else self.sliding_window

    @property
    def kv_groups(self) -> tuple[tuple[int | None, tuple[int, ...]], ...]:
        """The layers grouped by the KV memory they keep, each (window, layers): a group's layers
        attend under one window (None: to the whole context) and share a block table; every group
        spans ``kv_group_size`` layers of the cache (the last of a kind fewer, its other places
        unused), so one block of the pool holds a block of tokens for any group. Full attention
        first. The size is the one that leaves the fewest places unused (gpt-oss's 12 sliding and 12
        full layers: two groups of 12), the larger on a tie."""
        kinds: dict[int | None, list[int]] = {}
        for layer in self.kv_layers:
            kinds.setdefault(self.layer_window(layer), []).append(layer)
        if len(kinds) == 1:
            (window, layers), = kinds.items()
            return ((window, tuple(layers)),)
        counts = [len(layers) for layers in kinds.values()]
        size = min(range(min(counts), 0, -1), key=lambda k: sum(-(-n // k) * k for n in counts))
        return tuple((window, tuple(layers[i:i + size]))
                     for window, layers in sorted(kinds.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))
                     for i in range(0, len(layers), size))

    @property
    def kv_group_size(self) -> int:
        """Layers of the KV cache's leading axis: a block of the pool holds a group's layers."""
        return max(len(layers) for _, layers in self.kv_groups)

    @property
    def kv_layer_places(self) -> tuple[tuple[int, int], ...]:
        """Each layer's (group, place in the group): where its KV lives in the cache ((0, 0) for a
        recurrent layer, which keeps none)."""
        places = {layer: (g, i) for g, (_, layers) in enumerate(self.kv_groups) for i, layer in enumerate(layers)}
        return tuple(places.get(layer, (0, 0)) for layer in range(self.num_layers))

    @property
    def mixes_windows(self) -> bool:
        """Whether some layers slide and others attend to everything (chosen per layer in the scan)."""
        return self.sliding_window is not None and 0 < len(self.full_attention_layers) < self.num_layers

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is the mixture of experts."""
        return tuple(i for i in self.mlp_layers if self.is_moe and i not in self.dense_layers)

    def quant_spec(self, kind: str) -> tuple[str, int, bool] | None:
        """(format, group, offset) of weights of ``kind`` when they are kept quantized, else None."""
        return next(((b, g, o) for k, b, g, o in self.quantization if k == kind), None)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """From a ``transformers`` config object (transformers 5 keeps RoPE in ``rope_parameters``).
        A ``quantization_config`` is read with the tensors (``models.stored_quantization``). A
        vision-language checkpoint of a family served (``_LANGUAGE_MODELS``) is read as its
        language model."""
        if hf.model_type in _LANGUAGE_MODELS:
            outer = (getattr(hf, "architectures", None) or [hf.model_type])[0]
            text = hf.text_config
            text.architectures = [_LANGUAGE_MODELS[hf.model_type]]
            text.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
            return dataclasses.replace(cls.from_hf(text), language_model_of=outer)
        if hf.model_type == "nemotron_h":
            return _nemotron_h(cls, hf)
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
            # (a mixture of experts whose every layer is sparse may name no dense width)
            intermediate_size=getattr(hf, "intermediate_size", None) or hf.moe_intermediate_size,
            num_layers=hf.num_hidden_layers, num_heads=heads,
            # (latent attention has no KV heads of its own: its one cache serves every head)
            num_kv_heads=heads if hf.model_type == "deepseek_v3" else getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)),
            rope_scaling=scaling, max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=(hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))
                            or bool(getattr(hf, "qkv_bias", False) and hf.model_type == "qwen2_moe")),
            output_bias=hf.model_type in _OUTPUT_BIAS and bool(getattr(hf, "attention_bias", False)),
            qk_norm=hf.model_type in ("qwen3", "qwen3_moe", *_HYBRID), attention_sinks=hf.model_type == "gpt_oss",
            **_attention_windows(hf), **_experts(hf), **_latent_attention(hf, scaling), **_hybrid(hf, rope),
            bos_token_id=getattr(hf, "bos_token_id", None), eos_token_id=getattr(hf, "eos_token_id", None))


# The model types whose o_proj has a bias when ``attention_bias`` is set (Qwen2's never has).
_OUTPUT_BIAS = ("llama", "qwen3", "qwen3_moe", "gpt_oss")
# The model types whose attention uses ``sliding_window`` in every layer whenever it is set; the
# others as their ``layer_types`` say (older configs: ``use_sliding_window``).
_ALWAYS_SLIDING = ("mistral", "mixtral", "qwen3_moe")
_LAYER_KINDS = ("sliding_attention", "full_attention")


_HYBRID = ("qwen3_5_text", "qwen3_5_moe_text")
# Vision-language model types whose language model is served (text only): its architecture.
_LANGUAGE_MODELS = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
_HYBRID_KINDS = ("linear_attention", "full_attention")


def _hybrid(hf, rope: dict) -> dict:
    """Qwen3.5's layers: Gated DeltaNet (linear attention) among gated full-attention layers."""
    if hf.model_type not in _HYBRID:
        return {}
    kinds = list(hf.layer_types)
    if unknown := sorted(set(kinds) - set(_HYBRID_KINDS)):
        raise ValueError(f"layer_types: {unknown} not supported (supported: {list(_HYBRID_KINDS)})")
    if len(kinds) != hf.num_hidden_layers:
        raise ValueError(f"layer_types: {len(kinds)} kinds for {hf.num_hidden_layers} layers")
    shape = GatedDeltaNetShape(hf.hidden_size, hf.linear_num_key_heads, hf.linear_num_value_heads,
                               hf.linear_key_head_dim, hf.linear_value_head_dim, hf.linear_conv_kernel_dim,
                               hf.rms_norm_eps)
    if shape.num_value_heads % shape.num_key_heads:
        raise ValueError(f"linear_num_value_heads ({shape.num_value_heads}) must be a multiple of "
                         f"linear_num_key_heads ({shape.num_key_heads})")
    return dict(linear_attention_layers=tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
                linear_attention=shape, partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
                attention_output_gate=True, norm_offset=1.0)


# Nemotron-H's kinds of block (``layers_block_type``; older configs' ``hybrid_override_pattern``
# M, *, - and E), each one part: Mamba-2, attention, an MLP, a mixture of experts.
_NEMOTRON_KINDS = ("linear_attention", "full_attention", "mlp", "moe")


def _nemotron_h(cls, hf) -> "ModelConfig":
    """Nemotron-H: Mamba-2, attention (no positions of its own: no RoPE), squared-ReLU MLP and
    mixture-of-experts blocks in the order ``layers_block_type`` gives, one norm before each."""
    kinds = list(hf.layers_block_type)
    if unknown := sorted(set(kinds) - set(_NEMOTRON_KINDS)):
        raise ValueError(f"layers_block_type: {unknown} not supported (supported: {list(_NEMOTRON_KINDS)})")
    for name, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if getattr(hf, name) != want:
            raise ValueError(f"{name}: {getattr(hf, name)!r} is not supported (supported: {want!r})")
    for name in ("mlp_bias", "sliding_window"):
        if getattr(hf, name, None):
            raise ValueError(f"{name}: {getattr(hf, name)!r} is not supported for nemotron_h")
    of = {kind: tuple(i for i, k in enumerate(kinds) if k == kind) for kind in _NEMOTRON_KINDS}
    limit = tuple(getattr(hf, "time_step_limit", None) or (0.0, float("inf")))
    shape = Mamba2Shape(hf.hidden_size, hf.mamba_num_heads, hf.mamba_head_dim, hf.ssm_state_size, hf.n_groups,
                        hf.conv_kernel, bool(hf.use_conv_bias), bool(hf.use_bias), float(limit[0]),
                        float(limit[1]), hf.layer_norm_epsilon)
    if shape.num_heads % shape.num_groups:
        raise ValueError(f"mamba_num_heads ({shape.num_heads}) must be a multiple of n_groups ({shape.num_groups})")
    experts = {}
    if of["moe"]:
        experts = dict(num_experts=hf.n_routed_experts, num_experts_per_tok=hf.num_experts_per_tok,
                       moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                       shared_expert_intermediate_size=hf.moe_shared_expert_intermediate_size,
                       shared_expert_gated=False, scoring="sigmoid", score_correction_bias=True,
                       n_group=hf.n_group or 1, topk_group=hf.topk_group or 1,
                       routed_scaling_factor=float(hf.routed_scaling_factor),
                       moe_latent_size=getattr(hf, "moe_latent_size", None) or None)
    heads = hf.num_attention_heads
    return cls(
        architecture=(getattr(hf, "architectures", None) or ["NemotronHForCausalLM"])[0], vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size, num_layers=len(kinds), num_heads=heads,
        num_kv_heads=hf.num_key_value_heads or heads, head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        rms_norm_eps=hf.layer_norm_epsilon, max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)), partial_rotary_factor=0.0,
        linear_attention_layers=of["linear_attention"], linear_attention=shape,
        mixer_only_layers=tuple(sorted(of["linear_attention"] + of["full_attention"])),
        mlp_only_layers=tuple(sorted(of["mlp"] + of["moe"])),
        dense_layers=of["mlp"], mlp_activation="relu2", **experts,
        bos_token_id=getattr(hf, "bos_token_id", None), eos_token_id=getattr(hf, "eos_token_id", None))


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
    if hf.model_type == "deepseek_v3":
        return dict(num_experts=hf.n_routed_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                    shared_expert_intermediate_size=hf.moe_intermediate_size * (hf.n_shared_experts or 0),
                    shared_expert_gated=False, scoring="sigmoid", score_correction_bias=True,
                    n_group=hf.n_group or 1, topk_group=hf.topk_group or 1,
                    routed_scaling_factor=float(hf.routed_scaling_factor),
                    dense_layers=tuple(range(min(hf.first_k_dense_replace or 0, hf.num_hidden_layers))))
    if hf.model_type == "qwen3_5_moe_text":           # every layer sparse, with a gated shared expert
        return dict(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=True,
                    shared_expert_intermediate_size=hf.shared_expert_intermediate_size)
    if hf.model_type not in ("qwen2_moe", "qwen3_moe"):
        return {}
    experts = getattr(hf, "num_experts", None) or hf.num_local_experts
    step, only = getattr(hf, "decoder_sparse_step", 1) or 1, set(getattr(hf, "mlp_only_layers", None) or [])
    dense = tuple(i for i in range(hf.num_hidden_layers) if i in only or (i + 1) % step)
    return dict(num_experts=experts, num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                shared_expert_intermediate_size=getattr(hf, "shared_expert_intermediate_size", 0) or 0,
                dense_layers=dense)


# What a DeepSeek-V3 config must say: transformers fills a missing one with DeepSeek-V3's own
# value, which would read the checkpoint's tensors as the wrong shapes or route another way.
REQUIRED_FIELDS = {"deepseek_v3": ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                   "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", "n_group",
                                   "topk_group", "first_k_dense_replace")}
# ... and what it must name even as null (null: no such step)
PRESENT_FIELDS = {"deepseek_v3": ("q_lora_rank",)}


def check_config_fields(raw: dict, where: str = "config.json") -> None:
    """ValueError naming the first field a model type needs that ``raw`` (config.json) lacks."""
    model_type = raw.get("model_type")
    for name in REQUIRED_FIELDS.get(model_type, ()):
        if raw.get(name) is None:
            raise ValueError(f"{where}: {name} is missing; a {model_type} model needs it")
    for name in PRESENT_FIELDS.get(model_type, ()):
        if name not in raw:
            raise ValueError(f"{where}: {name} is missing; a {model_type} model needs it (null where it has none)")


def _latent_attention(hf, scaling) -> dict:
    """DeepSeek-V3's multi-head latent attention (none for others). Its rotary part is head_dim."""
    if hf.model_type != "deepseek_v3":
        return {}
    mscale_all_dim = float(scaling.mscale_all_dim or 0) if isinstance(scaling, YarnScaling) else 0.0
    if getattr(hf, "attention_bias", False):
        raise ValueError("attention_bias: latent attention with biases is not supported")
    if hf.head_dim != hf.qk_rope_head_dim:
        raise ValueError(f"head_dim ({hf.head_dim}) must equal qk_rope_head_dim ({hf.qk_rope_head_dim})")
    return dict(q_lora_rank=hf.q_lora_rank or None, kv_lora_rank=int(hf.kv_lora_rank),
                qk_nope_head_dim=int(hf.qk_nope_head_dim), v_head_dim=int(hf.v_head_dim),
                mscale_all_dim=mscale_all_dim, rope_interleave=bool(getattr(hf, "rope_interleave", True)),
                num_mtp_layers=int(getattr(hf, "num_nextn_predict_layers", 0) or 0))


def _default_architecture(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
            "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
            "nemotron_h": "NemotronHForCausalLM"}.get(model_type, model_type)
