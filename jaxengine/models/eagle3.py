"""An EAGLE-3 head: one decoder layer that drafts from the model's own hidden states.

The model returns, for every token, the hidden states entering three of its layers (the
residual stream before them, ``LlamaForCausalLM.forward_with_aux_hidden``), side by side
[T, 3 * D_model]; the head's ``fc`` projects them to its width D. At position p the head takes
that state and the embedding of the token at p + 1, so it predicts the token at p + 2: its
layer's q/k/v project the two side by side ([T, 2D]: the RMS-normed embedding, then the hidden
state normed by ``hidden_norm``; ``norm_before_residual`` says whether the residual is the
hidden state before or after that norm). Drafting further, the head feeds back its own
pre-norm output as the next position's hidden state. Its LM head covers a reduced vocabulary
of ``draft_vocab_size`` tokens; ``d2t`` maps a draft id d to the model's id d + d2t[d].

A checkpoint as published (``LlamaForCausalLMEagle3``): ``config.json`` of one Llama layer
(``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual``, the aux layers in
``eagle_aux_hidden_state_layer_ids`` or ``eagle_config``), and tensors ``fc.weight``,
``midlayer.*`` (the layer), ``norm.weight``, ``lm_head.weight``, ``d2t`` and optionally
``embed_tokens.weight`` (without it the head embeds with the model's embedding).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.kernels.matmul import dense
from jaxengine.kernels.paged_attention import AttentionMetadata, paged_attention_tiled
from jaxengine.models.config import ModelConfig
from jaxengine.models.layers import MLP, MODEL_AXIS, Attention, KVCache, RMSNorm, _param, _sharded, rope_inv_freq
from jaxengine.models.panels import plain
from jaxengine.models.quantization import QuantizedParam

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The head's layer (``layer``: a one-layer Llama config) and how it meets the model."""

    layer: ModelConfig
    target_hidden_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]          # the model's layers whose input hidden states the head reads
    norm_before_residual: bool = False
    own_embedding: bool = True

    @property
    def vocab_size(self) -> int:          # the model's (the ids d2t maps the draft vocabulary to)
        return self.layer.vocab_size


class Eagle3Head(nnx.Module):
    def __init__(self, cfg: Eagle3Config, dtype=jnp.float32, attention_fn: Callable = paged_attention_tiled, *,
                 rngs: nnx.Rngs) -> None:
        layer = cfg.layer
        d = layer.hidden_size
        self.config = cfg
        self.embed_tokens = _param(rngs, (layer.vocab_size, d), dtype, (MODEL_AXIS, None))
        self.fc = _param(rngs, (len(cfg.aux_layers) * cfg.target_hidden_size, d), dtype, (None, None))
        self.input_layernorm = RMSNorm(d, layer.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(d, layer.rms_norm_eps, dtype)
        self.self_attn = Attention(layer, dtype, attention_fn, input_size=2 * d, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, layer.rms_norm_eps, dtype)
        self.mlp = MLP(layer, dtype, rngs=rngs)
        self.norm = RMSNorm(d, layer.rms_norm_eps, dtype)
        self.lm_head = _param(rngs, (d, cfg.draft_vocab_size), dtype, (None, MODEL_AXIS))
        self.d2t = _sharded(jnp.zeros(cfg.draft_vocab_size, jnp.int32), (None,))
        self.dense_fn = dense

    @property
    def hidden_dtype(self):
        """The dtype of the hidden state it feeds back."""
        return self.fc[...].dtype

    def combine(self, aux: jax.Array) -> jax.Array:
        """The model's aux hidden states [T, 3 * D_model] -> the head's input hidden state [T, D]."""
        return self.dense_fn(aux, self.fc[...])

    def __call__(self, next_ids: jax.Array, hidden: jax.Array, kv_caches: KVCache,
                 md: AttentionMetadata) -> tuple[jax.Array, jax.Array, KVCache]:
        """next_ids [T] (the token after each position), hidden [T, D] -> (the normed output, the
        pre-norm output fed back when drafting on, both [T, D]; the updated cache, one layer)."""
        cfg = self.config
        embeds = self.input_layernorm(jnp.take(self.embed_tokens[...], next_ids, axis=0))
        normed = self.hidden_norm(hidden)
        residual = normed if cfg.norm_before_residual else hidden
        x = jnp.concatenate([embeds, normed], axis=-1)
        one_layer = kv_caches[0].ndim == 3                    # [P, S, K*H] (the drafter's), or [1, P, S, K*H]
        attn, (k, v) = self.self_attn(x, tuple(c if one_layer else c[0] for c in kv_caches), md,
                                      rope_inv_freq(cfg.layer))
        residual = residual + attn
        prenorm = residual + self.mlp(self.post_attention_layernorm(residual))
        return self.norm(prenorm), prenorm, (k, v) if one_layer else (k[None], v[None])

    def model_logits(self, normed: jax.Array) -> jax.Array:
        """[R, D] -> logits over the model's vocabulary [R, V] (f32; -inf outside the draft's)."""
        logits = self.dense_fn(normed, self.lm_head[...]).astype(jnp.float32)
        ids = jnp.arange(self.config.draft_vocab_size) + self.d2t[...]
        return jnp.full((normed.shape[0], self.config.vocab_size), -jnp.inf, jnp.float32).at[:, ids].set(logits)


# ---------------------------------------------------------------- loading
def eagle3_config(folder: str | Path, target: ModelConfig) -> Eagle3Config:
    """The head's config.json, checked against the model it drafts for."""
    from transformers import LlamaConfig

    folder = Path(folder)
    path = folder / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"speculative_config.model: {folder} has no config.json (an EAGLE-3 head "
                                f"checkpoint folder is expected)")
    raw = json.loads(path.read_text())
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in EAGLE3_ARCHITECTURES:
        raise ValueError(f"speculative_config.model: {path}: architectures {arch!r} is not an EAGLE-3 head "
                         f"(expected one of {list(EAGLE3_ARCHITECTURES)})")
    hf = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    layer = ModelConfig.from_hf(hf).replace(architecture=arch)
    if layer.num_layers != 1:
        raise ValueError(f"speculative_config.model: {path}: num_hidden_layers is {layer.num_layers}; an EAGLE-3 "
                         f"head has one layer")
    if layer.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: {path}: vocab_size {layer.vocab_size} is not the model's "
                         f"({target.vocab_size}); the head drafts for another model")
    eagle = raw.get("eagle_config") or {}
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids") or \
        (2, target.num_layers // 2, target.num_layers - 3)
    aux = tuple(int(i) for i in aux)
    if len(aux) != 3 or not all(0 <= i < target.num_layers for i in aux):
        raise ValueError(f"speculative_config.model: {path}: eagle_aux_hidden_state_layer_ids {list(aux)} must be "
                         f"three layers of the model's {target.num_layers}")
    if not eagle.get("use_aux_hidden_state", True):
        raise ValueError(f"speculative_config.model: {path}: eagle_config.use_aux_hidden_state false (EAGLE-1/2 "
                         f"heads) is not supported")
    return Eagle3Config(layer, int(raw.get("target_hidden_size") or target.hidden_size),
                        int(raw.get("draft_vocab_size") or layer.vocab_size), aux,
                        bool(raw.get("norm_before_residual", False)))


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the head, read whole (a head is small); bfloat16 ones too."""
    from jaxengine.models.weights import SafetensorsSource

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"speculative_config.model: {folder} has no *.safetensors files")
    with SafetensorsSource(files) as source:
        return {name: source.read(name, tuple(slice(0, n) for n in source.shape(name))) for name in source.names()}


def _head_params(t: dict[str, np.ndarray], cfg: Eagle3Config) -> dict[tuple, np.ndarray]:
    """Published names [out, in] -> our paths and layouts ([in, out]; q/k/v [2D, n, H], o [n, H, D])."""
    layer = cfg.layer
    h = layer.head_dim

    def heads_in(w):
        return w.T.reshape(w.shape[1], -1, h)

    a = "midlayer.self_attn."
    params = {
        ("fc",): t["fc.weight"].T,
        ("input_layernorm", "weight"): t["midlayer.input_layernorm.weight"],
        ("hidden_norm", "weight"): t["midlayer.hidden_norm.weight"],
        ("self_attn", "q_proj"): heads_in(t[a + "q_proj.weight"]),
        ("self_attn", "k_proj"): heads_in(t[a + "k_proj.weight"]),
        ("self_attn", "v_proj"): heads_in(t[a + "v_proj.weight"]),
        ("self_attn", "o_proj"): t[a + "o_proj.weight"].T.reshape(-1, h, layer.hidden_size),
        ("post_attention_layernorm", "weight"): t["midlayer.post_attention_layernorm.weight"],
        ("mlp", "gate_proj"): t["midlayer.mlp.gate_proj.weight"].T,
        ("mlp", "up_proj"): t["midlayer.mlp.up_proj.weight"].T,
        ("mlp", "down_proj"): t["midlayer.mlp.down_proj.weight"].T,
        ("norm", "weight"): t["norm.weight"],
        ("lm_head",): t["lm_head.weight"].T,
    }
    if "d2t" in t:
        params[("d2t",)] = t["d2t"].astype(np.int32)
    if "embed_tokens.weight" in t:
        params[("embed_tokens",)] = t["embed_tokens.weight"]
    return params


def load_eagle3(folder: str | Path, target, dtype=jnp.float32, attention_fn: Callable = paged_attention_tiled
                ) -> tuple[Eagle3Head, Eagle3Config]:
    """The head in ``folder`` for ``target`` (a loaded model: without its own ``embed_tokens``
    the head takes the model's embedding)."""
    folder = Path(folder)
    cfg = eagle3_config(folder, target.config)
    tensors = _tensors(folder)
    cfg = dataclasses.replace(cfg, own_embedding="embed_tokens.weight" in tensors)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Eagle3Head(cfg, dtype, attention_fn, rngs=nnx.Rngs(0))))
    try:
        params = _head_params(tensors, cfg)
    except KeyError as e:
        raise ValueError(f"speculative_config.model: {folder} lacks the tensor {e.args[0]!r} of an EAGLE-3 "
                         f"head") from None
    params.setdefault(("d2t",), np.zeros(cfg.draft_vocab_size, np.int32))   # a head over the whole vocabulary
    if not cfg.own_embedding:
        if isinstance(target.embed_tokens, QuantizedParam):
            raise ValueError(f"speculative_config.model: {folder} has no embed_tokens and the model's embedding is "
                             f"kept quantized; the head needs an unquantized one")
        params[("embed_tokens",)] = plain(target.embed_tokens)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        value = params[path]
        if tuple(np.shape(value)) != tuple(var.shape):
            raise ValueError(f"speculative_config.model: {folder}: {'.'.join(map(str, path))} has shape "
                             f"{tuple(np.shape(value))}, expected {tuple(var.shape)} (for a model of hidden size "
                             f"{target.config.hidden_size})")
        var.set_value(jnp.asarray(value, var.dtype if path == ("d2t",) else dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), cfg
