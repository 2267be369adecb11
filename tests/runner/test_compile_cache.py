"""The persistent compilation cache: on by default under $JAXENGINE_CACHE/xla, off with
JAXENGINE_XLA_CACHE=0, and a directory the user chose for JAX is kept."""
import jax
import pytest

from jaxengine.runner.compile_cache import enable_persistent_cache


@pytest.fixture
def no_cache_dir():
    saved = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", saved)


def test_default_location_and_switch_off(no_cache_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXENGINE_XLA_CACHE", "0")
    assert enable_persistent_cache() is None and jax.config.jax_compilation_cache_dir is None
    monkeypatch.delenv("JAXENGINE_XLA_CACHE")
    monkeypatch.setenv("JAXENGINE_CACHE", str(tmp_path))
    assert enable_persistent_cache() == str(tmp_path / "xla") == jax.config.jax_compilation_cache_dir


def test_a_directory_the_user_set_is_kept(no_cache_dir, tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    assert enable_persistent_cache() == str(tmp_path / "mine")
