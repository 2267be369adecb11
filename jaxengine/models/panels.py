"""Float32 projections laid out for the CPU matmul kernel: a loaded model's plain (unquantized)
projection weights and LM head become ``PanelParam`` modules in place of their parameters, each
read as a ``kernels.matmul.cpu_matmul.PanelWeight`` (strips of 32 output columns, each strip one
contiguous block), where the kernel reads them: a float32 model on one CPU device. A tied
embedding ([V, D]) is laid out as its LM head ([D, V]) and a token's row gathered from its strip.
Elsewhere, and for a mixture's routed experts (read by expert), the parameters stay as they are.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.kernels.matmul import cpu_matmul
from jaxengine.kernels.matmul.cpu_matmul import PANEL, PanelWeight, can_panel, panel, unpanel

# The weights laid out, with each one's output axes per layer: q, k and v are [D, N, H], o is
# [N, H, D], the MLP's and the LM head are [in, out]. A tied embedding ([V, D]) is its head's.
PANELED_KINDS = {"q_proj": 2, "k_proj": 2, "v_proj": 2, "o_proj": 1, "gate_proj": 1, "up_proj": 1, "down_proj": 1,
                 "lm_head": 1}
_PER_LAYER_AXES = {"q_proj": 3, "k_proj": 3, "v_proj": 3, "o_proj": 3}      # else 2


class PanelParam(nnx.Module):
    """A float32 weight laid out as panels; ``self[...]`` is its ``PanelWeight`` (``self[i]``: layer
    i's of a stacked one), ``unpacked()`` the parameter it replaced."""

    def __init__(self, weight: PanelWeight, shape: tuple[int, ...], transposed: bool = False) -> None:
        self.panels = nnx.Param(weight.panels)
        self.out_shape = weight.out_shape
        self.shape = tuple(shape)                  # the parameter's, a layer's of a stacked one
        self.transposed = transposed               # an embedding [V, D] laid out as its head [D, V]

    def __getitem__(self, index) -> PanelWeight:
        return PanelWeight(self.panels[index], self.out_shape)

    def unpacked(self) -> jax.Array:
        """The parameter as it was: [(L,) ...] (stacked, or a layer's slice of the stack's)."""
        w = unpanel(self[...])
        if self.transposed:
            return w.T
        return w.reshape(*w.shape[:w.ndim - 1 - len(self.out_shape)], *self.shape)

    def rows(self, ids: jax.Array) -> jax.Array:
        """Rows ``ids`` [T] of a tied embedding -> [T, D]: each a column of its strip."""
        panels = self.panels[...]
        return panels[ids // PANEL, :, ids % PANEL]


def panel_for_cpu(model: nnx.Module, dtype, devices: int) -> int:
    """Lay ``model``'s float32 projections and LM head out as panels where the CPU matmul kernel
    reads them (a float32 model on one CPU device); returns how many weights were laid out."""
    if not (jax.default_backend() == "cpu" and devices == 1 and jnp.dtype(dtype) == jnp.float32
            and cpu_matmul.available()):
        return 0
    count = 0
    for path, module in list(nnx.iter_graph(model)):
        if not isinstance(module, nnx.Module) or "experts" in path:
            continue
        for kind, out_axes in PANELED_KINDS.items():
            param = getattr(module, kind, None)
            if isinstance(param, nnx.Param) and param[...].dtype == jnp.float32:
                value = param[...]
                stacked = value.ndim > _PER_LAYER_AXES.get(kind, 2)
                if can_panel(value.shape[1:] if stacked else value.shape, out_axes):
                    setattr(module, kind, PanelParam(panel(value, out_axes, stacked), value.shape[stacked:]))
                    count += 1
        embed = getattr(module, "embed_tokens", None)
        config = getattr(module, "config", None)
        if (isinstance(embed, nnx.Param) and getattr(config, "tie_word_embeddings", False)
                and embed[...].dtype == jnp.float32 and can_panel(embed[...].T.shape, 1)):
            module.embed_tokens = PanelParam(panel(embed[...].T, 1, False), embed[...].shape, transposed=True)
            count += 1
    return count


def plain(param) -> jax.Array:
    """A parameter's value as the model made it, whether or not it was laid out as panels."""
    return param.unpacked() if isinstance(param, PanelParam) else param[...]
