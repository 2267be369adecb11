"""The persistent compilation cache: on by default under $JAXENGINE_CACHE/xla, off with
JAXENGINE_XLA_CACHE=0, and a directory the user chose for JAX is kept. It has a size bound, so
JAX locks each read and write of an entry (processes starting together share it)."""
import jax
import pytest

from jaxengine.runner.compile_cache import MAX_BYTES, enable_persistent_cache


@pytest.fixture
def no_cache_dir():
    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_max_size
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_compilation_cache_max_size", -1)
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_compilation_cache_max_size", saved[1])


def test_default_location_and_switch_off(no_cache_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXENGINE_XLA_CACHE", "0")
    assert enable_persistent_cache() is None and jax.config.jax_compilation_cache_dir is None
    monkeypatch.delenv("JAXENGINE_XLA_CACHE")
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path))
    assert enable_persistent_cache() == str(tmp_path / "xla") == jax.config.jax_compilation_cache_dir
    assert jax.config.jax_compilation_cache_max_size == MAX_BYTES == 16 << 30


def test_a_size_bound_the_user_set_is_kept(no_cache_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path))
    jax.config.update("jax_compilation_cache_max_size", 1 << 20)
    assert enable_persistent_cache() == str(tmp_path / "xla")
    assert jax.config.jax_compilation_cache_max_size == 1 << 20


def test_a_directory_the_user_set_is_kept(no_cache_dir, tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    assert enable_persistent_cache() == str(tmp_path / "mine")
    assert jax.config.jax_compilation_cache_max_size == -1


def test_entries_written_without_a_bound_get_access_times_so_later_writes_still_land(no_cache_dir, monkeypatch,
                                                                                     tmp_path):
    """JAX's eviction reads every entry's access time; one written with no size bound has none, and
    then every later write failed (a warning, nothing cached). Opening the cache stamps them."""
    import warnings

    import jax.numpy as jnp

    cache = tmp_path / "xla"
    cache.mkdir()
    (cache / "jit_old-0123-cache").write_bytes(b"x" * 10)                  # as an unbounded writer leaves it
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path))
    saved = jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        assert enable_persistent_cache() == str(cache)
        assert int.from_bytes((cache / "jit_old-0123-atime").read_bytes(), "little") == \
            (cache / "jit_old-0123-cache").stat().st_mtime_ns
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        from jax._src import compilation_cache
        compilation_cache.reset_cache()
        with warnings.catch_warnings():
            warnings.simplefilter("error")                                 # a failed write warns
            jax.jit(lambda x: jnp.sin(x) * 3.25 + 0.5)(jnp.arange(7.0)).block_until_ready()
        written = {p.name.split("-")[0] for p in cache.glob("*-cache")}
        assert "jit__lambda" in written and len(list(cache.glob("*-atime"))) == len(list(cache.glob("*-cache")))
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved)
        from jax._src import compilation_cache
        compilation_cache.reset_cache()
