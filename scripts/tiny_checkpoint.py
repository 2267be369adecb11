"""The tests' tiny random Llama (2 layers, hidden 64, byte-level tokenizer) as a checkpoint folder,
for the scripts that measure the engine's own overheads rather than a model's speed. Needs torch
and transformers (the test extra)."""
from __future__ import annotations

import os
import sys


def tiny_checkpoint(folder: str) -> str:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.conftest import make_chat_checkpoint

    make_chat_checkpoint(folder)
    return folder


def tiny_deepseek_checkpoint(folder: str) -> str:
    """The tests' tiny random DeepSeek-V3 (3 layers, the first dense, latent attention without the
    query's low-rank step, 8 experts in 4 groups)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.conftest import make_deepseek_checkpoint

    make_deepseek_checkpoint(folder, "no-q-lora")
    return folder


if __name__ == "__main__":        # python scripts/tiny_checkpoint.py FOLDER [--deepseek]
    (tiny_deepseek_checkpoint if "--deepseek" in sys.argv else tiny_checkpoint)(sys.argv[1])
