"""Where jaxengine keeps what it downloads and converts: ``$JAXENGINE_CACHE``, by default
~/.cache/jaxengine, and the folder of a checkpoint's converted weights (and tokenizer) in it;
and the error a checkpoint file that cannot be read raises. Imports neither JAX nor Flax, so
host-side code can find the cache cheaply."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


class CheckpointFileError(ValueError):
    """A checkpoint file (safetensors shard, GGUF, config.json, shard index, tokenizer or generation
    config file) that is truncated, corrupt or not what its name says; the message names the file
    and what is wrong with it."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = Path(path), problem


def read_json_object(path: str | os.PathLike) -> dict:
    """A JSON file that must hold an object (config.json, an index): CheckpointFileError naming
    it when it is not valid JSON or not an object."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as error:            # JSONDecodeError, and UnicodeDecodeError of binary junk
        raise CheckpointFileError(path, f"not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise CheckpointFileError(path, f"expected a JSON object, got a {type(value).__name__}")
    return value


def cache_dir() -> Path:
    return Path(os.environ.get("JAXENGINE_CACHE", Path.home() / ".cache" / "jaxengine"))


def converted_cache_path(path: Path, variant: str = "") -> Path:
    """The cache folder of ``path``'s converted weights: keyed by its size and modification time
    too, so a file replaced in place is converted again; a ``variant`` (another conversion of
    the same file) has a folder of its own."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{path.stem}-{key}{'-' + variant if variant else ''}"


def publish(tmp: Path, target: Path) -> bool:
    """Move the finished file or folder ``tmp`` (written beside ``target``, under a name no other
    process uses) to ``target`` in one rename, unless another process got there first: then
    theirs is kept and False returned. Readers so see ``target`` complete or not at all; the
    caller removes ``tmp`` if it is still there."""
    if tmp.is_dir():
        try:
            os.rename(tmp, target)                  # fails where target is a folder with files
        except OSError:
            if target.is_dir():
                return False
            raise
        return True
    try:
        os.link(tmp, target)                        # never replaces: the first copy's mtime is kept
    except FileExistsError:
        return False
    except OSError:                                 # a file system without hard links
        if target.exists():
            return False
        os.replace(tmp, target)
    return True
