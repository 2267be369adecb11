"""The ``eagle3`` proposer: an EAGLE-3 head (``models.eagle3``) drafts from the model's hidden
states, on the device, greedily.

The head's one-layer KV cache sits under the model's block tables, as a draft model's does
(``spec_decode.drafter``), and at the same positions: its entry at position p is made of the model's
hidden states at p and the token at p + 1, so it lags the model's by one token. Two compiled
functions keep it in step:

- ``sync``, right after each model step and on the device: the head runs over every token of
  the step, each with the token that follows it (the next prompt token, or the token sampled at
  that position: for a row with a draft, a position's own sample, so the accepted positions get
  the tokens that were output), and with the step's aux hidden states, which never leave the
  device. For every sample row it keeps the head's first draft token and pre-norm output;
  positions past a rejected draft hold stale KV that the next steps overwrite before anything
  reads them;
- ``propose``, once the step is verified: a row starts from the sample row its verified tokens
  ended on (``ProposalRows.sample_rows``), whose first draft is the row's first draft token,
  and drafts on, each step feeding back the head's pre-norm output, writing its KV at the
  row's next positions (slots the scheduler allocated with the step). One executable per row
  bucket, compiled at start-up.

Only a row of the step just run is proposed for (a swap-in, a fork's new sequences get no draft
in their first step). Where a fork row samples several tokens at one position, the head's KV
there holds the first one's (acceptance, never outputs, depends on it).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.kernels.paged_attention import AttentionMetadata
from jaxengine.models.mesh import replicated
from jaxengine.spec_decode.drafter import Drafter, ProposalRows, choose_drafts, draft_slots, keep_probs


class EagleDrafter(Drafter):
    """The EAGLE-3 head, its cache and its compiled steps (see the module's docstring)."""

    layer_axis = False               # one layer's caches, [P, S, K*H], the shape the head writes and reads

    def __init__(self, model, model_config, **kw) -> None:
        self.aux_layers = model_config.aux_layers
        self.max_rows = kw["row_buckets"][-1]
        self.hidden_size = model_config.layer.hidden_size
        super().__init__(model, model_config.layer, **kw)
        dtype = model.hidden_dtype
        # The last step's per-sample-row first draft, pre-norm output and (sampled drafts) the
        # first draft's distribution, padded to the most rows.
        self._last = (self._device(np.zeros(self.max_rows, np.int32)),
                      self._device(np.zeros((self.max_rows, self.hidden_size), dtype)),
                      None if not self.sampled else self._device(
                          np.zeros((self.max_rows, model_config.vocab_size), np.float32)))

    def _device(self, a: np.ndarray) -> jax.Array:
        return jax.device_put(a, None if self.mesh is None else replicated(self.mesh))

    def _sync_fn(self, graphdef) -> Callable:
        return _sync_fn(graphdef, self.max_rows, self.sampled)

    def _propose_fn(self, graphdef) -> Callable:
        return _propose_fn(graphdef, self.k, self.block_size, self.sampled)

    def _sync_shardings(self, mesh, model_config):
        return self._kv_sharding(mesh, model_config), replicated(mesh), replicated(mesh), replicated(mesh)

    # ---- compilation ----
    def compile_step(self, bucket: tuple[int, int], inputs, ids, step_outputs) -> None:
        """``step_outputs``: the model step's outputs, as shapes (its sampled tokens and aux states)."""
        self._sync_executables[bucket] = self._sync.lower(
            self.state, self._kv_spec, *self._sync_args(inputs, step_outputs)).compile()

    @staticmethod
    def _sync_args(inputs, step_outputs) -> tuple:
        result, aux = step_outputs[0], step_outputs[-1]
        return aux, inputs.following_ids, _sample_targets(inputs), result.token_ids, inputs.attention, \
            inputs.logits_indices, inputs.sampling

    # ---- each step ----
    def before_step(self, inputs, ids) -> None:
        """(The head runs after the model's step.)"""

    def after_step(self, inputs, step_outputs) -> None:
        executable = self._sync_executable(inputs, None, step_outputs, "EAGLE-3 head")
        self.kv_caches, *last = executable(self.state, self.kv_caches, *self._sync_args(inputs, step_outputs))
        self._last = tuple(last)

    def _starts(self, rows: ProposalRows) -> np.ndarray:
        """A row starts from the sample row its output ended on (its first draft is there)."""
        return rows.sample_rows

    def _propose_args(self, *arrays) -> tuple:
        return (*self._last, *super()._propose_args(*arrays))


def _sample_targets(inputs) -> np.ndarray:
    """Per sample row, the token whose following token its sample is (a row past the real ones,
    or a fork row's later samples at the same position: the step's width, which the scatter
    drops)."""
    indices, n, width = inputs.logits_indices, inputs.num_sample_rows, len(inputs.input_ids)
    targets = np.full(len(indices), width, np.int32)
    if n:
        first = np.ones(n, bool)
        first[1:] = indices[1:n] != indices[:n - 1]
        targets[:n] = np.where(first, indices[:n], width)
    return targets


def _sync_fn(graphdef, max_rows: int, sampled: bool):
    def sync(state, kv_caches, aux, following, targets, sampled_tokens, md: AttentionMetadata, logits_indices, smd):
        head = nnx.merge(graphdef, state)
        next_ids = following.at[targets].set(sampled_tokens, mode="drop")
        normed, prenorm, kv_caches = head(next_ids, head.combine(aux), kv_caches, md)
        # Each sample row's first draft is the token after the one it samples.
        sampling = (smd.temperature, smd.seed, smd.sample_index) if sampled else None
        first, probs = choose_drafts(head.model_logits(normed[logits_indices]), md.positions[logits_indices] + 2,
                                     sampling)

        def padded(x):
            return None if x is None else jnp.zeros((max_rows, *x.shape[1:]), x.dtype).at[:x.shape[0]].set(x)
        return kv_caches, padded(first), padded(prenorm[logits_indices]), padded(probs)
    return sync


def _propose_fn(graphdef, k: int, block_size: int, sampled: bool):
    def propose(state, kv_caches, probs_buffer, first, prenorm, first_probs, starts, positions, tables, counts,
                temperature, seeds, sample_index):
        """The first draft from the last step, then k - 1 steps of the head, greedy or sampled;
        step i of a row with counts <= i + 1 writes into the null block."""
        head = nnx.merge(graphdef, state)
        rows = starts.shape[0]
        sampling = (temperature, seeds, sample_index) if sampled else None

        def step(carry, i):
            kv_caches, tokens, hidden = carry
            pos = positions + i
            live = i + 1 < counts
            md = AttentionMetadata(jnp.where(live, pos, 0), draft_slots(tables, pos, live, block_size),
                                   jnp.arange(rows + 1, dtype=jnp.int32), jnp.where(live, pos + 1, 0), tables)
            normed, hidden, kv_caches = head(tokens, hidden, kv_caches, md)
            nxt, probs = choose_drafts(head.model_logits(normed), pos + 2, sampling)
            return (kv_caches, nxt, hidden), (nxt, probs)

        tokens = first[starts]
        (kv_caches, _, _), (rest, probs) = jax.lax.scan(step, (kv_caches, tokens, prenorm[starts]), jnp.arange(k - 1))
        drafts = jnp.concatenate([tokens[:, None], rest.T], axis=1)
        if not sampled:
            return kv_caches, (drafts, None)
        probs = jnp.concatenate([first_probs[starts][:, None], probs.transpose(1, 0, 2)], axis=1)
        return kv_caches, (drafts, keep_probs(probs_buffer, probs))
    return propose
