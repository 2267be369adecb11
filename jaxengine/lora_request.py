"""Which LoRA adapter a request runs with (vLLM's ``LoRARequest``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name``: the adapter's name (the server's ``model`` for it); ``lora_int_id``: its
    identity in the engine, an integer >= 1 (the scheduler's adapter limit and the device slots
    count adapters by it); ``lora_path``: the PEFT folder (``adapter_config.json`` and
    ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name: must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id: must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, Path)):
            raise ValueError(f"lora_request.lora_path: must be a folder path, got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))
