"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2 (QKV bias), Qwen3 (q/k norm), and
their mixtures of experts: Mixtral, Qwen2-MoE (with its shared expert), Qwen3-MoE, gpt-oss
(attention sinks, sliding and full layers alternating, biases everywhere, a clamped SwiGLU), and
DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing, dense first layers)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.kernels.matmul import dense
from jaxengine.kernels.paged_attention import AttentionMetadata, paged_attention_tiled
from jaxengine.kernels.paged_attention.layout import storage_dtype
from jaxengine.models.config import ModelConfig
from jaxengine.models.layers import (MLP, MODEL_AXIS, DecoderLayer, KVCache, RMSNorm, _param, is_dense_weight,
                                    rope_inv_freq, run_mlp, weight)
from jaxengine.models.latent_attention import LatentAttention
from jaxengine.models.panels import PanelParam
from jaxengine.models.quantization import QuantizedParam, gather_columns
from jaxengine.models.moe import SparseMoeBlock


class LlamaForCausalLM(nnx.Module):
    """Layer weights are stacked ([L, ...]) and the layers run under ``lax.scan``: one layer body
    to compile, whatever the depth. The KV cache is (k, v), each [L, P, S, K*H] (latent attention:
    one array, [L, P, S, R + Hr]); a layer sees its part as [P, S, K*H], as stored."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, attention_fn: Callable = paged_attention_tiled, *,
                 expert_parallel: bool = False, latent_attention_form: str = "absorbed", rngs: nnx.Rngs) -> None:
        """``expert_parallel``: a mixture of experts' experts split over the mesh whole, not by width.
        ``latent_attention_form``: how latent attention attends (``models.latent_attention``)."""
        self.config = cfg
        if cfg.quant_spec("embed_tokens"):      # kept [D, V] (models.quantization)
            self.embed_tokens = weight(cfg, "embed_tokens", rngs, (cfg.hidden_size, cfg.vocab_size), dtype,
                                       (None, MODEL_AXIS))
        else:
            self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, (MODEL_AXIS, None))

        mixed = bool(cfg.dense_layers)

        def experts(rngs: nnx.Rngs) -> SparseMoeBlock:
            return SparseMoeBlock(cfg, dtype, expert_parallel=expert_parallel, rngs=rngs)

        self.layers = stacked(decoder_layer(cfg, dtype, attention_fn, expert_parallel=expert_parallel,
                                            latent_attention_form=latent_attention_form), cfg.num_layers, rngs)
        if mixed:
            # Dense layers among sparse ones: each kind's MLPs in a stack of their own, the layer
            # scan choosing one per layer (models.hf_tensors maps them to the checkpoint's layers).
            self.sparse_mlp = stacked(experts, len(cfg.sparse_layers), rngs)
            self.dense_mlp = stacked(lambda r: MLP(cfg, dtype, rngs=r), len(cfg.dense_layers), rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = weight(cfg, "lm_head", rngs, (cfg.hidden_size, cfg.vocab_size), dtype, (None, MODEL_AXIS))
        self.dense_fn = dense

    def __call__(self, input_ids: jax.Array, kv_caches: KVCache,
                 md: AttentionMetadata) -> tuple[jax.Array, KVCache]:
        """input_ids [T] -> final hidden states [T, D] and the updated caches."""
        hidden, kv_caches, _ = self.forward_with_expert_counts(input_ids, kv_caches, md)
        return hidden, kv_caches

    def forward_with_expert_counts(self, input_ids: jax.Array, kv_caches: KVCache,
                                   md: AttentionMetadata) -> tuple[jax.Array, KVCache, jax.Array]:
        """As ``__call__``, plus the tokens routed to each expert, summed over the layers [E]
        (E = 0 for a dense model): the step's expert load."""
        hidden, kv_caches, counts, _ = self.forward_with_aux_hidden(input_ids, kv_caches, md)
        return hidden, kv_caches, counts

    def forward_with_aux_hidden(self, input_ids: jax.Array, kv_caches: KVCache, md: AttentionMetadata,
                                aux_layers: tuple[int, ...] = ()) -> tuple[jax.Array, KVCache, jax.Array, jax.Array]:
        """As ``forward_with_expert_counts``, plus the hidden states entering each layer of
        ``aux_layers`` (the residual stream before it: transformers' ``hidden_states[i]``; for L,
        the final hidden state, normed), concatenated [T, len(aux_layers) * D] ([T, 0] for none):
        what an EAGLE-3 head or a multi-token prediction layer reads."""
        inv_freq = rope_inv_freq(self.config)
        x = self.embed(input_ids)
        # The projections stay stacked and go in whole with the layer's index; the rest (norms,
        # biases) is sliced per layer by the scan.
        graphdef, dense, rest = nnx.split(self.layers, is_dense_weight, ...)
        shape = kv_caches[0].shape
        group_size, num_blocks, block_size = shape[:3]
        num_layers = self.config.num_layers
        # Layer groups (``ModelConfig.kv_groups``): a layer's KV is its group's place in the cache,
        # under its group's block table and slot mapping ([G, B, M] and [G, T] in the metadata).
        grouped = md.block_tables.ndim == 3
        if group_size != (self.config.kv_group_size if grouped else num_layers):
            raise ValueError(f"a KV cache of {group_size} layer places for {'grouped' if grouped else 'one'} block "
                             f"table(s) of a {num_layers}-layer model (init_kv_caches's grouped= and the metadata disagree)")
        places = np.asarray(self.config.kv_layer_places, np.int32)
        group_of, place_of = jnp.asarray(places[:, 0]), jnp.asarray(places[:, 1])
        # The caches ride in the scan carry, flattened to [L*P, S, K*H]: layer l's block b is
        # l*P + b. Writes and reads then hit the one donated buffer in place (slicing a layer out
        # as scan input/output would copy the whole cache every step). Inside the body the caches
        # keep that one shape, through the KV write to the attention kernels (``layout``): a
        # reshape there has XLA's CPU compiler duplicate the write and copy the whole pool.
        flat = tuple(c.reshape(group_size * num_blocks, block_size, -1) for c in kv_caches)
        wanted = jnp.asarray(aux_layers, jnp.int32)
        # Carried, not a scan output: [len(aux_layers), T, D], where every layer's would be [L, T, D].
        aux = jnp.zeros((len(aux_layers), *x.shape), x.dtype)

        mlp = self._mlp_of_layer(md)

        def layer_step(carry, per_layer):
            x, caches, aux = carry
            rest_of_layer, layer = per_layer
            if aux_layers:
                aux = jnp.where((wanted == layer)[:, None, None], x[None], aux)
            if grouped:
                offset = place_of[layer] * num_blocks
                tables, slots = md.block_tables[group_of[layer]], md.slot_mapping[group_of[layer]]
            else:
                offset, tables, slots = layer * num_blocks, md.block_tables, md.slot_mapping
            md_layer = dataclasses.replace(md, block_tables=tables + offset, slot_mapping=slots + offset * block_size)
            decoder = nnx.merge(graphdef, dense, rest_of_layer)
            if mlp is None:
                x, caches, counts = decoder(x, caches, md_layer, inv_freq, layer)
            else:
                x, h, caches = decoder.attend(x, caches, md_layer, inv_freq, layer)
                out, counts = mlp(h, layer)
                x = x + out
            return (x, caches, aux), counts

        (x, flat, aux), counts = jax.lax.scan(layer_step, (x, flat, aux), (rest, jnp.arange(num_layers)))
        x = self.norm(x)
        if num_layers in aux_layers:        # past the last layer: the final hidden state (models.mtp reads it)
            aux = jnp.where((wanted == num_layers)[:, None, None], x[None], aux)
        aux = aux.transpose(1, 0, 2).reshape(x.shape[0], -1)
        kv_caches = tuple(c.reshape(original.shape) for c, original in zip(flat, kv_caches))
        return x, kv_caches, counts.sum(axis=0), aux

    def _mlp_of_layer(self, md: AttentionMetadata) -> Callable | None:
        """With dense layers among sparse ones: ``mlp(h, layer)`` running layer ``layer``'s MLP from
        its kind's stack (weights read in place by index, as the layer's own projections)."""
        cfg = self.config
        if not cfg.dense_layers:
            return None
        sparse_def, sparse_state = nnx.split(self.sparse_mlp)
        dense_def, dense_state = nnx.split(self.dense_mlp)
        is_sparse = jnp.asarray([i in cfg.sparse_layers for i in range(cfg.num_layers)])
        index = jnp.asarray([(cfg.sparse_layers if i in cfg.sparse_layers else cfg.dense_layers).index(i)
                             for i in range(cfg.num_layers)], jnp.int32)       # within its kind's stack

        def mlp(h: jax.Array, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
            def kind(graphdef, state):
                return lambda h: run_mlp(nnx.merge(graphdef, state), h, index[layer], md, cfg.num_experts)
            return jax.lax.cond(is_sparse[layer], kind(sparse_def, sparse_state), kind(dense_def, dense_state), h)
        return mlp

    def embed(self, input_ids: jax.Array) -> jax.Array:
        """input_ids [T] -> their embeddings [T, D]."""
        return embed_with(self.embed_tokens, input_ids)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """[R, D] -> [R, V] in f32, only for the rows the sampler needs."""
        return logits_with(self, hidden)


def embed_with(embed_tokens, input_ids: jax.Array) -> jax.Array:
    """The rows of an embedding parameter (kept [V, D], or quantized [D, V]) for input_ids [T]."""
    if isinstance(embed_tokens, QuantizedParam):
        return gather_columns(embed_tokens[...], input_ids)
    if isinstance(embed_tokens, PanelParam):
        return embed_tokens.rows(input_ids)
    return jnp.take(embed_tokens[...], input_ids, axis=0)


def logits_with(module, hidden: jax.Array) -> jax.Array:
    """[R, D] -> [R, V] in f32 through ``module``'s LM head (its ``lm_head``, or its
    ``embed_tokens`` where ``config.tie_word_embeddings``) and ``dense_fn``."""
    if isinstance(module.embed_tokens, (QuantizedParam, PanelParam)) and module.config.tie_word_embeddings:
        logits = module.dense_fn(hidden, module.embed_tokens[...])        # kept as the head [D, V]
    elif module.config.tie_word_embeddings:
        # [V, D] used transposed: XLA's dot reads it as it lies at about OpenBLAS's speed
        logits = jnp.einsum("rd,vd->rv", hidden, module.embed_tokens[...])
    else:
        logits = module.dense_fn(hidden, module.lm_head[...])
    return logits.astype(jnp.float32)


def decoder_layer(cfg: ModelConfig, dtype, attention_fn: Callable, *, expert_parallel: bool = False,
                  latent_attention_form: str = "absorbed") -> Callable[[nnx.Rngs], DecoderLayer]:
    """Makes one decoder layer of ``cfg``'s kind: its attention (latent attention where
    configured) and its MLP (dense, experts, or none where dense layers sit among sparse ones and
    the model picks each layer's from stacks of their own)."""
    def layer(rngs: nnx.Rngs) -> DecoderLayer:
        if cfg.dense_layers:
            mlp = None
        elif cfg.is_moe:
            mlp = SparseMoeBlock(cfg, dtype, expert_parallel=expert_parallel, rngs=rngs)
        else:
            mlp = MLP(cfg, dtype, rngs=rngs)
        attention = LatentAttention(cfg, dtype, attention_fn, form=latent_attention_form,
                                    rngs=rngs) if cfg.is_mla else None
        return DecoderLayer(cfg, dtype, attention_fn, mlp, attention=attention, rngs=rngs)
    return layer


def stacked(make: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> nnx.Module:
    """``count`` modules made by ``make``, their parameters stacked on a leading axis (unsplit over
    the mesh)."""
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def make_all(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)
    return make_all(rngs)


def init_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.float32,
                   sharding: jax.sharding.Sharding | None = None, layer_axis: bool = True,
                   grouped: bool = False) -> KVCache:
    """(k, v), each [L, P, S, K*H], heads one after the other (latent attention: one array,
    ``cfg.kv_cache_parts``); with a ``sharding``, created in place on its devices. A float8 cache
    is stored as its bytes on the CPU (``kernels.paged_attention.layout``). Without ``layer_axis``
    a one-layer model's (a speculative head's) [P, S, K*H]: the shape its layer reads and writes,
    so that no step reshapes the cache it wrote (``layout``). With ``grouped`` L is a layer group's
    span (``ModelConfig.kv_group_size``), for steps whose metadata has a table per group (the
    runner's); without, every layer has its place (a draft model's cache, and steps given one table)."""
    if not layer_axis and cfg.num_layers != 1:
        raise ValueError(f"init_kv_caches: only a one-layer cache goes without its layer axis ({cfg.num_layers} layers)")
    leading = (cfg.kv_group_size if grouped else cfg.num_kv_layers, num_blocks) if layer_axis else (num_blocks,)
    shapes = [(*leading, *block) for block in cfg.kv_block_shapes(block_size)]
    platform = next(iter(sharding.device_set)).platform if sharding is not None else jax.devices()[0].platform
    dtype = storage_dtype(dtype, platform)
    zeros = jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for shape in shapes), out_shardings=sharding)
    return zeros()
