"""The start-up check of the attention kernels and KV writes the engine will run.

On an accelerator the model runs Pallas kernels that the CPU test suite only ever interprets.
Before serving, each attention layer's kernel and KV write run once on a small random mixed batch
in the engine's own layout and are compared with the plain-jnp reference. Checked: the model's
query and KV heads, head size, page size and dtype; the KV cache's dtype as the engine stores it
(an FP8 cache included: float8, or its bytes on the CPU, ``layout``), written with rows in the
dtype the model writes; the attention sinks when the model has them; every sliding window its
layers use, with rows whose context runs past the window (up to ``MAX_WINDOW``); latent
attention's absorbed form (one key head of R + Hr whose value is the key itself). A kernel that
fails to compile or disagrees beyond the dtype's tolerance is logged with the reason and replaced
by the plain-jnp path; what the check found (``KernelCheck``) shows in the server's /health and
/metrics.

Not checked: the plain-jnp path itself (the fallback, the CPU's decode kernel in it); latent
attention's cache write (always XLA's scatter) and its decompressed form (plain jnp); the
kernels as a mesh runs them per shard (the check runs them whole on one device); a draft
model's or speculative head's attention; the matmul kernels. An FP8 cache's per-tensor scales
are applied outside the kernels, so an unscaled cache is what a kernel sees.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.kernels.paged_attention import AttentionMetadata, paged_attention, paged_attention_tiled, write_kv
from jaxengine.kernels.paged_attention.layout import FP8, as_stored, is_fp8, storage_dtype
from jaxengine.kernels.paged_attention.reference import write_rows
from jaxengine.models.config import ModelConfig
from jaxengine.models.latent_attention import LatentAttention, softmax_scale
from jaxengine.models.layers import Attention, kernel_name

logger = logging.getLogger(__name__)

# Largest |kernel - reference| allowed, as a fraction of the reference's largest |output|, by the
# queries' dtype: f32 dots run at full precision; 16-bit queries round the softmax weights and the
# output. An FP8 cache's values convert exactly to each of these, so it adds no error of its own.
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2, "float16": 1e-2}
# A sliding window up to this many tokens is exercised by rows whose context runs past it; a wider
# one is passed to the kernel but not reached (its rows would cost more than the check is worth).
MAX_WINDOW = 8192
ATTENTION, KV_WRITE, LATENT = "attention", "kv_write", "latent_attention"


@dataclass(frozen=True)
class KernelResult:
    kernel: str                  # ATTENTION, KV_WRITE or LATENT
    name: str                    # the implementation checked
    problem: str | None = None   # None: it matched the reference
    fallback: str | None = None  # what serves in its place when it did not

    @property
    def ok(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class KernelCheck:
    """What the start-up check found. ``status``: "passed", "failed" (some kernel was replaced by
    the plain-jnp path, which serves instead) or "not run"; ``detail``: what was checked, or why
    nothing was."""
    status: str
    detail: str
    results: tuple[KernelResult, ...] = ()

    def as_dict(self) -> dict:
        return {"status": self.status, "detail": self.detail,
                "kernels": [{"kernel": r.kernel, "name": r.name, "ok": r.ok, "problem": r.problem,
                             "serving": r.name if r.ok else r.fallback} for r in self.results]}

    def apply(self, model: nnx.Module) -> nnx.Module:
        """Put the plain-jnp path in place of the kernels that failed in another copy of the model
        (a data-parallel replica: the same kernels on the same kind of device); returns it."""
        failed = {(r.kernel, r.name) for r in self.results if not r.ok}
        for layer in attention_layers(model):
            for kernel in _kernels_of(layer):
                if (kernel, _name(_kernel_fn(layer, kernel))) in failed:
                    _use_fallback(layer, kernel)
        return model


@dataclass(frozen=True)
class CheckBatch:
    q: jax.Array                    # [T, N, H] in the model's dtype
    caches: tuple[jax.Array, ...]   # (k, v) [P, S, K*H] or latent attention's (pages,), as stored; random
    new: tuple[jax.Array, ...]      # this step's rows [T, K, H] per cache, as the model writes them
    md: AttentionMetadata
    num_real_tokens: int            # the tokens past it are padding (slot 0, the null block)


def check_model_kernels(model, model_config: ModelConfig, block_size: int, dtype, *, kv_dtype=None,
                        enabled: bool | None = None) -> KernelCheck:
    """Check the attention kernels and KV writes of ``model`` as the engine runs them (``dtype``:
    the model's; ``kv_dtype``: the KV cache's, the model's by default) and put the plain-jnp path
    in place of any that fails. ``enabled=None``: on an accelerator only (the CPU runs the
    plain-jnp path unless told otherwise); True forces it, False skips it."""
    if not (_on_accelerator() if enabled is None else enabled):
        return KernelCheck("not run", "turned off (skip_kernel_check)" if enabled is False else
                           "on the CPU only when forced: the plain-jnp path serves")
    cache_dtype = storage_dtype(kv_dtype if kv_dtype is not None else dtype, jax.devices()[0].platform)
    results: dict[tuple[str, str], KernelResult] = {}      # the layers of one model share their kernels
    scopes = []
    for layer in attention_layers(model):
        kernels = [k for k in _kernels_of(layer) if not _is_plain(_kernel_fn(layer, k))]
        scope = _scope(layer, model_config, block_size, dtype, cache_dtype)
        for kernel in kernels:
            fn = _kernel_fn(layer, kernel)
            key = (kernel, _name(fn))
            if key not in results:
                problem = _problem(kernel, fn, model_config, block_size, dtype, cache_dtype)
                fallback = None if problem is None else FALLBACK_NAMES[kernel]
                results[key] = KernelResult(kernel, key[1], problem, fallback)
                _log(results[key], scope)
            if not results[key].ok:
                _use_fallback(layer, kernel)
        if kernels:
            scopes.append(scope)
    if not results:
        return KernelCheck("not run", "only the plain-jnp path serves: nothing to check")
    status = "passed" if all(r.ok for r in results.values()) else "failed"
    return KernelCheck(status, "; ".join(dict.fromkeys(scopes)), tuple(results.values()))


def check_kernels(attention_fn: Callable, kv_write_fn: Callable, model_config: ModelConfig, block_size: int,
                  dtype, seed: int = 0, *, kv_dtype=None) -> tuple[str | None, str | None]:
    """-> (what is wrong with the attention kernel, with the KV write); None where it matches.
    ``kv_dtype``: the KV cache's dtype as stored (``layout.storage_dtype``), the model's by default."""
    cache_dtype = jnp.dtype(kv_dtype if kv_dtype is not None else dtype)
    kv_problem = None if kv_write_fn is write_kv else _kv_write_problem(
        kv_write_fn, mixed_batch(model_config, block_size, dtype, seed, cache_dtype=cache_dtype))
    attention_problem = None
    if not _is_plain(attention_fn):
        attention_problem = _attention_problem(attention_fn, model_config, block_size, dtype, cache_dtype, seed)
    return attention_problem, kv_problem


def check_latent_kernel(attention_fn: Callable, model_config: ModelConfig, block_size: int, dtype, seed: int = 0, *,
                        kv_dtype=None) -> str | None:
    """What is wrong with latent attention's kernel in its absorbed form; None where it matches."""
    cache_dtype = jnp.dtype(kv_dtype if kv_dtype is not None else dtype)
    b = latent_batch(model_config, block_size, dtype, seed, cache_dtype=cache_dtype)
    (pages,) = (write_rows(c, n, b.md.slot_mapping) for c, n in zip(b.caches, b.new))
    kw = dict(scale=softmax_scale(model_config))
    return _compare(attention_fn, b, (pages, pages), [kw])


def attention_layers(model: nnx.Module) -> list[nnx.Module]:
    """Every attention layer of ``model``: the Llama family's and latent attention's."""
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, (Attention, LatentAttention))]


def mixed_batch(cfg: ModelConfig, block_size: int, dtype, seed: int = 0, *, cache_dtype=None) -> CheckBatch:
    """Three decodes over contexts of several pages, a prefill chunk after a cached prefix, a whole
    prompt, then padding tokens and a padding row; the rows' pages scattered through the pool. With
    a sliding window (up to ``MAX_WINDOW``), a decode and a prefill chunk whose contexts run past it."""
    extra = []
    if cfg.sliding_window is not None and cfg.sliding_window <= MAX_WINDOW:
        extra = [(cfg.sliding_window + block_size + 3, 1), (cfg.sliding_window + 2, block_size + 5)]
    return _batch(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 2, block_size, dtype, seed, extra,
                  cache_dtype=cache_dtype)


def latent_batch(cfg: ModelConfig, block_size: int, dtype, seed: int = 0, *, cache_dtype=None) -> CheckBatch:
    """``mixed_batch``'s rows for latent attention: queries of R + Hr per head and one cache of one
    key head of R + Hr (what the absorbed form hands its kernel)."""
    return _batch(cfg.num_heads, 1, cfg.kv_lora_rank + cfg.head_dim, 1, block_size, dtype, seed, [],
                  cache_dtype=cache_dtype)


def _batch(num_heads: int, num_kv_heads: int, head_size: int, num_caches: int, block_size: int, dtype, seed: int,
           extra: list[tuple[int, int]], *, cache_dtype=None) -> CheckBatch:
    rows = [(2 * block_size + 3, 1), (block_size - 1, 1), (5, 1), (block_size + 2, block_size + 5), *extra, (0, 7)]
    rng = np.random.default_rng(seed)
    pages = [-(-(c + n) // block_size) for c, n in rows]
    free = rng.permutation(np.arange(1, sum(pages) + 3))      # block 0 is the null block
    tables = [free[sum(pages[:i]):sum(pages[:i + 1])].tolist() for i in range(len(rows))]
    num_real = sum(n for _, n in rows)
    num_tokens = num_real + 5
    md = AttentionMetadata.build([(c, n, t) for (c, n), t in zip(rows, tables)], block_size, num_tokens,
                                 max(pages) + 1, num_rows=len(rows) + 1)
    cache_dtype = jnp.dtype(cache_dtype if cache_dtype is not None else dtype)
    new_dtype = FP8 if is_fp8(cache_dtype) else cache_dtype         # the model writes an FP8 cache float8 rows
    keys = jax.random.split(jax.random.key(seed), 2 * num_caches + 1)
    cache_shape = (len(free) + 1, block_size, num_kv_heads * head_size)
    new_shape = (num_tokens, num_kv_heads, head_size)
    caches = tuple(as_stored(jax.random.normal(k, cache_shape), cache_dtype) for k in keys[:num_caches])
    new = tuple(jax.random.normal(k, new_shape).astype(new_dtype) for k in keys[num_caches:2 * num_caches])
    q = jax.random.normal(keys[-1], (num_tokens, num_heads, head_size), dtype)
    return CheckBatch(q, caches, new, md, num_real)


def _problem(kernel: str, fn: Callable, cfg: ModelConfig, block_size: int, dtype, cache_dtype) -> str | None:
    if kernel == LATENT:
        return check_latent_kernel(fn, cfg, block_size, dtype, kv_dtype=cache_dtype)
    if kernel == KV_WRITE:
        return _kv_write_problem(fn, mixed_batch(cfg, block_size, dtype, cache_dtype=cache_dtype))
    return _attention_problem(fn, cfg, block_size, dtype, cache_dtype)


def _kv_write_problem(kv_write_fn: Callable, b: CheckBatch) -> str | None:
    """The written caches must equal the XLA scatter's, bit for bit, outside the null block
    (which padding tokens write to, in no defined order)."""
    args = (*b.caches, *b.new, b.md.slot_mapping)
    want = jax.jit(write_kv)(*args)
    try:
        got = jax.block_until_ready(jax.jit(kv_write_fn)(*args))
    except Exception as error:      # noqa: BLE001 - any failure to compile or run means: do not use it
        return f"failed: {type(error).__name__}: {str(error)[:300]}"
    for name, g, w in zip(("K", "V"), got, want):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"returned the {name} cache as {g.dtype}{list(g.shape)}, not {w.dtype}{list(w.shape)}"
        wrong = np.asarray(g[1:] != w[1:]).sum()
        if wrong:
            return f"disagrees with the XLA scatter: {wrong} {name} cache values differ"
    return None


def _attention_problem(attention_fn: Callable, cfg: ModelConfig, block_size: int, dtype, cache_dtype,
                       seed: int = 0) -> str | None:
    """The kernel as the model's layers call it: each window they use, with their sinks."""
    b = mixed_batch(cfg, block_size, dtype, seed, cache_dtype=cache_dtype)
    caches = write_kv(*b.caches, *b.new, b.md.slot_mapping)
    kw = dict(scale=cfg.head_dim ** -0.5)
    if cfg.attention_sinks:         # as large as the scores, so that a kernel without them is off by much
        kw["sinks"] = 2 * jax.random.normal(jax.random.key(seed + 1), (cfg.num_heads,), dtype)
    windows = (None, cfg.sliding_window) if cfg.mixes_windows else (cfg.sliding_window,)
    return _compare(attention_fn, b, caches, [dict(kw, sliding_window=w) for w in windows])


def _compare(attention_fn: Callable, b: CheckBatch, caches: tuple[jax.Array, jax.Array],
             calls: list[dict]) -> str | None:
    """The kernel against the reference for each call's keyword arguments; the first problem found."""
    for kw in calls:
        with jax.default_matmul_precision("highest"):       # the oracle at full f32 precision
            want = np.asarray(paged_attention(b.q, *caches, b.md, **kw), np.float32)[:b.num_real_tokens]
        try:
            got = jax.jit(functools.partial(attention_fn, **kw))(b.q, *caches, b.md)
            got = np.asarray(got, np.float32)[:b.num_real_tokens]
        except Exception as error:      # noqa: BLE001 - any failure to compile or run means: do not use it
            return f"failed: {type(error).__name__}: {str(error)[:300]}"
        error, limit = attention_error(got, want, b.q.dtype)
        if not error <= limit:
            window = "" if kw.get("sliding_window") is None else f" (sliding window {kw['sliding_window']})"
            return f"disagrees with the plain-jnp path: max |difference| {error:.3g} > {limit:.3g}{window}"
    return None


def attention_error(got, want, dtype) -> tuple[float, float]:
    """(largest |got - want|, the most the dtype allows) over the real tokens' outputs; a NaN or
    infinity in ``got`` is an infinite error."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    limit = TOLERANCE.get(jnp.dtype(dtype).name, 1e-2) * float(np.abs(want).max())
    return (float(np.abs(got - want).max()) if np.isfinite(got).all() else float("inf")), limit


# ---- the layers' kernels ----
FALLBACK_NAMES = {ATTENTION: "paged_attention_tiled", KV_WRITE: "write_kv", LATENT: "paged_attention_tiled"}


def _kernels_of(layer) -> list[str]:
    """The kernels a layer runs: latent attention's decompressed form runs none (plain jnp)."""
    if isinstance(layer, LatentAttention):
        return [LATENT] if layer.form == "absorbed" else []
    return [ATTENTION, KV_WRITE]


def _kernel_fn(layer, kernel: str) -> Callable:
    return layer.kv_write_fn if kernel == KV_WRITE else layer.attention_fn


def _use_fallback(layer, kernel: str) -> None:
    if kernel == KV_WRITE:
        layer.kv_write_fn = write_kv
    else:
        layer.attention_fn = paged_attention_tiled


def _inner(fn: Callable) -> Callable:
    """The kernel inside latent attention's ``backend.where_served`` (which picks it per layout)."""
    if isinstance(fn, functools.partial) and "kernel" in fn.keywords:
        return fn.keywords["kernel"]
    return fn


def _is_plain(fn: Callable) -> bool:
    return _inner(fn) in (paged_attention_tiled, write_kv)


def _name(fn: Callable) -> str:
    return kernel_name(_inner(fn))


def _scope(layer, cfg: ModelConfig, block_size: int, dtype, cache_dtype) -> str:
    """What the check runs for this layer, in words (for the log and /health)."""
    kv = "float8_e4m3fn (as bytes)" if jnp.dtype(cache_dtype) == jnp.uint8 else jnp.dtype(cache_dtype).name
    if isinstance(layer, LatentAttention):
        return (f"latent attention (absorbed form, {cfg.num_heads} query heads over one key head of "
                f"{cfg.kv_lora_rank + cfg.head_dim}), {jnp.dtype(dtype).name} queries, {kv} cache, pages of "
                f"{block_size}")
    parts = [f"{cfg.num_heads} query and {cfg.num_kv_heads} KV heads of {cfg.head_dim}",
             f"{jnp.dtype(dtype).name} queries", f"{kv} cache", f"pages of {block_size}"]
    if cfg.attention_sinks:
        parts.append("sinks")
    if cfg.sliding_window is not None:
        reached = "reached" if cfg.sliding_window <= MAX_WINDOW else f"not reached: contexts stop at {MAX_WINDOW}"
        windows = "full and sliding window" if cfg.mixes_windows else "sliding window"
        parts.append(f"{windows} {cfg.sliding_window} ({reached})")
    return "attention (" + ", ".join(parts) + ")"


def _log(result: KernelResult, scope: str) -> None:
    what = {ATTENTION: "attention kernel", KV_WRITE: "KV write", LATENT: "latent attention kernel"}[result.kernel]
    reference = "the XLA scatter" if result.kernel == KV_WRITE else "the plain-jnp path"
    if result.ok:
        logger.info("%s %s matches %s on %s", what, result.name, reference, scope)
    else:
        logger.warning("%s %s %s on %s; using %s instead", what, result.name, result.problem, scope, reference)


def _on_accelerator() -> bool:
    return jax.devices()[0].platform != "cpu"
