"""What the recurrent layers share (Gated DeltaNet, Mamba-2): running a step's flat ragged batch
over the rows' states, in one of two forms (``FORMS``). The token form is one pass in token order,
each token updating its own row's state, so a row's tokens may be a prompt's chunk or one decode
token alike; the chunked form runs segments of one row's tokens at once in the layer's own
chunked form, one segment after another, and a decode step's rows all at once.

A row's state is a causal depthwise convolution's window (its last ``K - 1`` inputs, [K-1, C]) and
a layer's own matrix state; each token's input passes the convolution (SiLU after it) and the
layer's ``step`` turns that and the row's matrix state into the new state and the token's output.
A row starting a sequence starts from zero states (the caller gathers them so); the states after
the step are returned for the caller to keep, and, for prefix caching, copies of a row's states
after chosen tokens (snapshots)."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


CHUNK_SIZE = 64             # the layers' segments, at most (a snapshot ends one sooner)
# How the layers run a step's tokens: one after another; in segments (the chunked form; a decode
# step's rows at once); or auto: one after another on the CPU, where that measured fastest (the
# per-token work is small beside the projections' there), in segments elsewhere, where a loop
# over single tokens is bound by its steps' latency.
FORMS = ("auto", "tokens", "chunked")


def chunked(form: str) -> bool:
    """Whether layers of ``form`` run in segments on this process's platform."""
    if form not in FORMS:
        raise ValueError(f"recurrent_form: {form!r} is not one of {FORMS}")
    return form == "chunked" or (form == "auto" and jax.default_backend() != "cpu")


def set_form(model, form: str) -> None:
    """Have every recurrent layer of ``model`` run its tokens as ``form`` says (``FORMS``)."""
    from flax import nnx

    chunked(form)
    for _, node in nnx.iter_graph(model):
        if hasattr(node, "recurrent_form"):
            node.recurrent_form = form


def decays(cum: jax.Array) -> jax.Array:
    """[..., S] cumulative log decays -> [..., S, S]: exp(cum_i - cum_j) where j <= i, else 0 (the
    decay between tokens j and i of a segment)."""
    s = cum.shape[-1]
    lower = jnp.tril(jnp.ones((s, s), bool))
    return jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))


def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """(I + L)^-1 for strictly lower triangular L [..., S, S]: L is nilpotent, so the inverse is
    the sum of (-L)^i, i < S, which is the product of (I + (-L)^(2^k)) over k < log2(S): a few
    matmuls (a triangular solve's row-by-row loop is slow inside XLA's loops)."""
    eye = jnp.eye(lower.shape[-1], dtype=lower.dtype)
    power, inverse = -lower, eye - lower
    for _ in range(max(0, (lower.shape[-1] - 1).bit_length() - 1)):
        power = power @ power
        inverse = inverse @ (eye + power)
    return inverse


def scan_rows(step: Callable, mixed: jax.Array, per_token, token_rows: jax.Array, conv_state: jax.Array,
              state: jax.Array, conv_weight: jax.Array, conv_bias: jax.Array | None = None,
              captures: jax.Array | None = None, num_captures: int = 0,
              one_token_rows: jax.Array | None = None, segment: Callable | None = None, chunk_size: int = 64,
              num_valid: jax.Array | int | None = None) -> tuple:
    """``mixed`` [T, C]: the convolution's inputs; ``per_token``: the step's other inputs (a pytree
    of [T, ...]); ``token_rows`` [T]: each token's row (B or more for padding, which changes no
    row); ``conv_state`` [B, K-1, C] and ``state`` [B, ...]: the rows' states before the step;
    ``conv_weight`` [K, C] (tap 0 the oldest) and ``conv_bias`` [C]. ``step(conv_out [C] f32,
    state [...] f32, per_token's slice) -> (the new state, the token's output)``. ``captures``
    [T]: where each token's row's states after it go among ``num_captures`` snapshots.
    ``one_token_rows`` (a traced bool): no row has more than one token in the step (a decode
    step); then every token's update runs at once, as one batched step, instead of in turn.
    ``segment(conv_out [S, C] f32, state [...] f32, per_token's [S, ...] slice, valid [S]) -> (the
    state after the segment's valid tokens, their outputs [S, ...])``: the layer's chunked form,
    run over segments of at most ``chunk_size`` tokens of one row each (a snapshot ends one), one
    segment after another, instead of one token after another; ``num_valid``: the step's real
    tokens (the padding after them is left out).

    -> (the outputs [T, ...], the states after the step, and with snapshots their states
    ([N, K-1, C], [N, ...]))."""
    f32 = jnp.float32
    weight = conv_weight.astype(f32)
    bias = None if conv_bias is None else conv_bias.astype(f32)
    num_rows = state.shape[0]
    # A padding row past the real ones takes the padding tokens' updates.
    conv_state = jnp.concatenate([conv_state.astype(f32), jnp.zeros((1, *conv_state.shape[1:]), f32)])
    state = jnp.concatenate([state.astype(f32), jnp.zeros((1, *state.shape[1:]), f32)])
    rows = jnp.minimum(token_rows, num_rows)
    # Snapshots: a buffer row per snapshot, and one past them that the other tokens write.
    captured = (jnp.zeros((num_captures + 1, *conv_state.shape[1:]), f32),
                jnp.zeros((num_captures + 1, *state.shape[1:]), f32))
    capture_of = jnp.full(rows.shape, num_captures, jnp.int32) if captures is None else captures

    def update(conv_rows, state_rows, mixed_t, extra_t):
        """One token's update of its row's states -> (window after, state after, output)."""
        window = jnp.concatenate([conv_rows, mixed_t.astype(f32)[None]])     # [K, C]
        conv_out = jnp.sum(window * weight, axis=0)
        S, out = step(jax.nn.silu(conv_out if bias is None else conv_out + bias), state_rows, extra_t)
        return window[1:], S, out

    def token(carry, xs):
        conv_state, state, (captured_conv, captured_state) = carry
        mixed_t, extra_t, r, c = xs
        conv_t, S, out = update(conv_state[r], state[r], mixed_t, extra_t)
        conv_state, state = conv_state.at[r].set(conv_t), state.at[r].set(S)
        if num_captures:
            captured_conv, captured_state = captured_conv.at[c].set(conv_t), captured_state.at[c].set(S)
        return (conv_state, state, (captured_conv, captured_state)), out

    def in_turn(carry):
        return jax.lax.scan(token, carry, (mixed, per_token, rows, capture_of))

    def at_once(carry):                   # each row's one token: no token reads another's update
        conv_state, state, (captured_conv, captured_state) = carry
        conv_t, S, out = jax.vmap(update)(conv_state[rows], state[rows], mixed, per_token)
        conv_state, state = conv_state.at[rows].set(conv_t), state.at[rows].set(S)
        if num_captures:
            captured_conv, captured_state = captured_conv.at[capture_of].set(conv_t), \
                captured_state.at[capture_of].set(S)
        return (conv_state, state, (captured_conv, captured_state)), out

    def in_segments(carry):
        return _segments(segment, update, chunk_size, carry, mixed, per_token, rows, capture_of, num_captures,
                         mixed.shape[0] if num_valid is None else num_valid, weight, bias,
                         jax.eval_shape(lambda c: in_turn(c)[1], carry))

    carry = (conv_state, state, captured)
    in_order = in_turn if segment is None else in_segments
    if one_token_rows is None:
        (conv_state, state, captured), out = in_order(carry)
    else:
        (conv_state, state, captured), out = jax.lax.cond(one_token_rows, at_once, in_order, carry)
    if num_captures:
        return out, conv_state[:num_rows], state[:num_rows], captured[0][:-1], captured[1][:-1]
    return out, conv_state[:num_rows], state[:num_rows]


def _segments(segment: Callable, update: Callable, size: int, carry, mixed, per_token, rows, capture_of,
              num_captures: int, num_valid, weight, bias, out_shape):
    """``scan_rows``'s chunked form: the real tokens cut into segments, each a run of one row's
    tokens that ends at the row's end, at a snapshot or after ``size`` tokens, run in order: a
    segment's convolution over its row's window and its tokens at once, then the layer's
    ``segment`` from its row's state (a one-token segment, a decode row's, runs ``update``, the
    token form); its states written back to its row (and to its snapshot)."""
    f32 = jnp.float32
    t = rows.shape[0]
    real = jnp.arange(t) < num_valid
    # Cuts: a row's first token, and the token after a snapshot; then every ``size`` tokens of a run
    cut = jnp.concatenate([jnp.ones(1, bool), (rows[1:] != rows[:-1]) | (capture_of[:-1] < num_captures)])
    run_start = jax.lax.cummax(jnp.where(cut, jnp.arange(t), 0))
    starts_here = (cut | ((jnp.arange(t) - run_start) % size == 0)) & real
    starts = jnp.nonzero(starts_here, size=t + 1, fill_value=t)[0]
    ends = jnp.minimum(starts[1:], num_valid)                  # each segment's end (the last's: num_valid)
    pad = lambda a: jnp.concatenate([a, jnp.zeros((size, *a.shape[1:]), a.dtype)])    # noqa: E731
    mixed, per_token = pad(mixed.astype(f32)), jax.tree.map(pad, per_token)
    rows, capture_of = pad(rows), jnp.concatenate([capture_of, jnp.full(size, num_captures, jnp.int32)])
    out = jnp.zeros((t + size, *out_shape.shape[1:]), out_shape.dtype)
    k = weight.shape[0]

    def body(state):
        i, (conv_state, states, (captured_conv, captured_state)), out = state
        start = starts[i]
        length = ends[i] - start
        valid = jnp.arange(size) < length
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, size)      # noqa: E731
        r = rows[start]

        def chunk(conv_rows, state_rows):
            inputs = jnp.where(valid[:, None], take(mixed), 0)
            window = jnp.concatenate([conv_rows, inputs])                    # [K-1+S, C]
            conv_out = sum(weight[j] * window[j:j + size] for j in range(k))
            conv_out = jax.nn.silu(conv_out if bias is None else conv_out + bias)
            S, y = segment(conv_out, state_rows, jax.tree.map(take, per_token), valid)
            return jax.lax.dynamic_slice_in_dim(window, length, k - 1), S, y.astype(out.dtype)

        def one(conv_rows, state_rows):           # a decode row's one token: the token form
            conv_after, S, y = update(conv_rows, state_rows, mixed[start], jax.tree.map(lambda a: a[start], per_token))
            return conv_after, S, jnp.zeros((size, *y.shape), out.dtype).at[0].set(y.astype(out.dtype))

        conv_after, S, y = jax.lax.cond(length == 1, one, chunk, conv_state[r], states[r])
        conv_state, states = conv_state.at[r].set(conv_after), states.at[r].set(S)
        if num_captures:
            c = capture_of[start + length - 1]
            captured_conv, captured_state = captured_conv.at[c].set(conv_after), captured_state.at[c].set(S)
        out = jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), start, 0)
        return i + 1, (conv_state, states, (captured_conv, captured_state)), out

    num_segments = jnp.sum(starts_here)
    _, carry, out = jax.lax.while_loop(lambda state: state[0] < num_segments, body, (jnp.int32(0), carry, out))
    return carry, out[:t]
