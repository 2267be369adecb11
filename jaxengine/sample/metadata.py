"""Per-sample-row sampling parameters as device arrays (R = sample rows, padded)."""
from __future__ import annotations

from dataclasses import dataclass

import jax


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array   # [R] f32; 0 = greedy
    top_p: jax.Array         # [R] f32; 1 = off
    top_k: jax.Array         # [R] i32; 0 = off
    min_p: jax.Array         # [R] f32; 0 = off
    seed: jax.Array          # [R, 2] u32: the request's 64-bit seed, high and low words (drawn at
                             # random when not given)
    sample_index: jax.Array  # [R] i32: which of the group's n samples
    step: jax.Array          # [R] i32: the output position being sampled (stream position)
    want_logprobs: jax.Array  # [R] bool: the request asked for logprobs
    # Penalties and logit bias (OpenAI / vLLM semantics); all neutral when unused.
    presence_penalty: jax.Array    # [R] f32
    frequency_penalty: jax.Array   # [R] f32
    repetition_penalty: jax.Array  # [R] f32; 1 = off
    history: jax.Array             # [R, W] i32: prompt then output token ids of the row's sequence
    num_prompt: jax.Array          # [R] i32: how many of ``history`` are prompt tokens
    num_history: jax.Array         # [R] i32: how many are valid
    bias_ids: jax.Array            # [R, MAX_LOGIT_BIAS] i32
    bias_values: jax.Array         # [R, MAX_LOGIT_BIAS] f32 (0 for unused entries)
    logprobs_temperature: jax.Array  # [R] f32: logprobs are of log_softmax(logits / this); 1 = the model's
    # Structured output: token t is allowed when bit t & 31 of word t >> 5 is set (-1: every token).
    token_bitmask: jax.Array       # [R, ceil(V / 32)] i32
    constrained: jax.Array         # [R] bool: some row of the step has a grammar (the mask is applied)
    # min_tokens: until a row has that many output tokens its stop tokens (EOS unless ignore_eos,
    # stop_token_ids) may not come: bit t of ``stop_bitmask`` set masks token t.
    stop_bitmask: jax.Array        # [R, ceil(V / 32)] i32
    masks_stops: jax.Array         # [R] bool: the row's stop_bitmask applies
    beam_scores: jax.Array         # [R] bool: a beam's row: its logprobs keep the model's normalisation
                                   # (the masked stop tokens at -inf), as transformers scores beams
