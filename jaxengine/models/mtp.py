"""DeepSeek-V3's multi-token prediction (MTP) layer, as a speculative proposer (``method: mtp``).

A checkpoint's layer L (past the decoder's L layers, ``num_nextn_predict_layers`` of them) predicts
the token after next. At position p it takes the model's final hidden state there (normed, as the
LM head reads it) and the embedding of the token at p + 1, each RMS-normed (``hnorm``,
``enorm``), projects them side by side [embedding, hidden] through ``eh_proj`` [2D, D] and runs one
decoder layer of the model's own kind (latent attention; experts, as the layers past
``first_k_dense_replace`` have); that output normed by ``shared_head.norm`` goes through the
model's LM head. Drafting further, the layer's output before that norm stands for the next
position's hidden state. The embedding and LM head are the model's own arrays, not copies.

The head meets the drafter (``runner.eagle_drafter``) as an EAGLE-3 head does: ``combine`` turns
the model's side output (here its final hidden state, ``MTPConfig.aux_layers`` = (L,)) into the
head's input, ``__call__`` runs one position and ``model_logits`` gives the logits. Its KV cache
is one layer of the model's kind (a latent cache for latent attention) under the model's blocks.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.kernels.matmul import dense
from jaxengine.kernels.paged_attention import AttentionMetadata, paged_attention_tiled
from jaxengine.models.config import ModelConfig
from jaxengine.models.hf_tensors import Index, TensorSource
from jaxengine.models.layers import KVCache, RMSNorm, _param, is_dense_weight, rope_inv_freq
from jaxengine.models.llama import LlamaForCausalLM, decoder_layer, embed_with, logits_with, stacked

MTP_ARCHITECTURE = "DeepseekV3MTP"


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """The head's one layer (``layer``: the model's config cut to that layer) and where it reads."""

    layer: ModelConfig
    aux_layers: tuple[int, ...]          # (L,): the model's final hidden state (models.llama)

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size


def mtp_config(model: ModelConfig) -> MTPConfig:
    """The first MTP layer's config: the model's, one layer of the kind layer L is."""
    if not model.num_mtp_layers:
        raise ValueError(f"speculative_config.method: 'mtp' needs multi-token prediction layers; "
                         f"{model.architecture}'s config has num_nextn_predict_layers 0")
    # Its MLP is the kind the layers past first_k_dense_replace have: experts, or dense where all are.
    sparse = model.is_moe and bool(model.sparse_layers)
    # Read in the model's dtype whatever the model keeps quantized (models.weights.load_mtp).
    layer = model.replace(architecture=MTP_ARCHITECTURE, num_layers=1, num_mtp_layers=0, dense_layers=(),
                          quantization=(), kv_scales=False,
                          **({} if sparse else {"num_experts": 0, "num_experts_per_tok": 0}))
    return MTPConfig(layer=layer, aux_layers=(model.num_layers,))


class MTPHead(nnx.Module):
    """The layer's own weights; ``share_embeddings`` gives it the model's embedding and LM head."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, attention_fn: Callable = paged_attention_tiled, *,
                 latent_attention_form: str = "absorbed", expert_parallel: bool = False, rngs: nnx.Rngs) -> None:
        d = cfg.hidden_size
        self.config = cfg
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.eh_proj = _param(rngs, (2 * d, d), dtype, (None, None))
        # One decoder layer, stacked [1, ...] as the model's are (the same loading rules serve it).
        self.layers = stacked(decoder_layer(cfg, dtype, attention_fn, expert_parallel=expert_parallel,
                                            latent_attention_form=latent_attention_form), 1, rngs)
        self.shared_head_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.dense_fn = dense

    def share_embeddings(self, model: LlamaForCausalLM) -> None:
        """Read the model's embedding and LM head (the same arrays)."""
        self.embed_tokens = model.embed_tokens
        if not model.config.tie_word_embeddings:
            self.lm_head = model.lm_head

    @property
    def hidden_dtype(self):
        return self.eh_proj[...].dtype

    def combine(self, aux: jax.Array) -> jax.Array:
        """The model's final hidden state [T, D], as it is."""
        return aux

    def __call__(self, next_ids: jax.Array, hidden: jax.Array, kv_caches: KVCache,
                 md: AttentionMetadata) -> tuple[jax.Array, jax.Array, KVCache]:
        """next_ids [T] (the token after each position), hidden [T, D] -> (the normed output, the
        output fed back when drafting on, both [T, D]; the updated cache, one layer)."""
        embeds = self.enorm(embed_with(self.embed_tokens, next_ids))
        x = self.dense_fn(jnp.concatenate([embeds, self.hnorm(hidden)], axis=-1), self.eh_proj[...])
        graphdef, weights, rest = nnx.split(self.layers, is_dense_weight, ...)
        layer = nnx.merge(graphdef, weights, jax.tree.map(lambda a: a[0], rest))
        one_layer = kv_caches[0].ndim == 3                    # [P, S, K*H] (the drafter's), or [1, P, S, K*H]
        out, caches, _ = layer(x, tuple(c if one_layer else c[0] for c in kv_caches), md, rope_inv_freq(self.config),
                               jnp.int32(0))
        return self.shared_head_norm(out), out, caches if one_layer else tuple(c[None] for c in caches)

    def model_logits(self, normed: jax.Array) -> jax.Array:
        """[R, D] -> the model's logits [R, V] (f32), through its LM head."""
        return logits_with(self, normed)


# ---------------------------------------------------------------- loading
_MTP_EXTRA = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
_SHARED = re.compile(r"(embed_tokens|shared_head\.head)\.weight")       # the model's own, not loaded again


class MTPTensors:
    """The checkpoint's MTP layer ``index`` (its tensors ``model.layers.{index}.*``) shown as the
    layer 0 of a one-layer model, its extras (enorm, hnorm, eh_proj, shared_head.norm) under
    ``model.layers.0.``; the embedding and LM head it repeats are left out."""

    def __init__(self, source: TensorSource, index: int) -> None:
        self.source = source
        prefix = f"model.layers.{index}."
        self._names = {f"model.layers.0.{name[len(prefix):]}": name for name in source.names()
                       if name.startswith(prefix) and not _SHARED.fullmatch(name[len(prefix):])}

    def names(self) -> Iterable[str]:
        return self._names.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(self._names[name])

    def read(self, name: str, index: Index) -> jax.Array:
        return self.source.read(self._names[name], index)
