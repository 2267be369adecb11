"""The default model (the embedded SmolLM2 GGUF) as a Hugging Face checkpoint folder in float32,
for servers that load such folders (the serving benchmark's peer: ``transformers serve``).

    python scripts/export_hf_checkpoint.py /tmp/smollm2-hf

Needs torch and transformers (the bench extra). transformers refuses to save a model loaded from
a quantized GGUF, so the dequantized weights go into a fresh model of the same config.
"""
from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxengine.default_model import default_model_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    args = p.parse_args()
    gguf = default_model_path()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(args.folder)
    tokenizer.save_pretrained(args.folder)
    print(f"saved {config.architectures[0]} and its tokenizer to {args.folder}")


if __name__ == "__main__":
    main()
