"""What-if profiles: a step's time on a machine that is not here, from datasheet figures
(bandwidth, FLOP/s) and the bench tool's roofline (``jaxengine.costmodel.floors``). A model, not a
measurement, and it says so. It answers the simulator's questions as a ``CostProfile`` does."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from jaxengine.costmodel.floors import kv_bytes_per_token, step_floor_seconds
from jaxengine.costmodel.step_shape import StepShape, write_json


@dataclass(frozen=True)
class Hardware:
    """Datasheet figures of an accelerator."""

    name: str
    memory_bytes: float
    bandwidth_bytes_s: float
    flops: float                       # dense bf16 FLOP/s


@dataclass(frozen=True)
class ModelShape:
    """What a transformer's step costs by: parameters and the KV cache's width."""

    name: str
    num_params: float
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int = 8192
    # A mixture of experts: the parameters a token runs through, and the routing
    num_active_params: float = 0.0          # 0: all of them (a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    # A hybrid model: the layers that keep KV (0: all), and the recurrent state one sequence holds
    # in its other layers (float32 bytes, read and written at every step the sequence runs)
    num_kv_layers: int = 0
    state_bytes_per_slot: float = 0.0

    def params_read(self, num_tokens: float) -> float:
        """Weights a step of ``num_tokens`` reads: all of a dense model's; of a mixture of experts
        the shared part and the experts its tokens touch (each token picks k of E, independently)."""
        if not self.num_experts:
            return self.num_params
        e, k = self.num_experts, self.num_experts_per_tok
        routed = (self.num_params - self.num_active_params) * e / (e - k)      # all routed experts' weights
        touched = 1 - (1 - k / e) ** num_tokens
        return self.num_params - routed + routed * touched


HARDWARE = {
    "h200": Hardware("NVIDIA H200 SXM (datasheet)", 141e9, 4.8e12, 989e12),
    "h100": Hardware("NVIDIA H100 SXM (datasheet)", 80e9, 3.35e12, 989e12),
}
MODELS = {
    "llama-3-8b": ModelShape("Llama-3-8B", 8.03e9, 32, 32, 8, 128),
    "llama-3-70b": ModelShape("Llama-3-70B", 70.6e9, 80, 64, 8, 128),
    "smollm2-135m": ModelShape("SmolLM2-135M", 0.135e9, 30, 9, 3, 64, 2048),
    "qwen3-30b-a3b": ModelShape("Qwen3-30B-A3B", 30.5e9, 48, 32, 4, 128, 32768, 3.35e9, 128, 8),
    "mixtral-8x7b": ModelShape("Mixtral-8x7B", 46.7e9, 32, 32, 8, 128, 32768, 12.9e9, 8, 2),
    # 16 gated attention layers among 48 Gated DeltaNet layers (16 key and 48 value heads of 128,
    # convolution of 4): a state of 48 x 128 x 128 + 3 x 10,240 floats a layer
    "qwen3.5-27b": ModelShape("Qwen3.5-27B", 27.8e9, 64, 24, 4, 256, 262144, num_kv_layers=16,
                              state_bytes_per_slot=4 * 48 * (48 * 128 * 128 + 3 * 10240)),
}


@dataclass
class RooflineProfile:
    """A step's time from datasheet figures: the roofline floor of its padded tokens and attended
    contexts, at assumed shares of the datasheet bandwidth and FLOP/s, plus a fixed per-step
    overhead. A model, not a measurement: every figure it gives is labelled so."""

    hardware: Hardware
    model: ModelShape
    bytes_per_param: float = 2.0                 # bf16
    bandwidth_efficiency: float = 0.75           # assumed share of datasheet bandwidth a step reaches
    flops_efficiency: float = 0.5                # assumed share of datasheet FLOP/s
    step_overhead_s: float = 0.004               # assumed host + launch time per step
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    num_cpu_blocks: int = 0
    request_overhead_s: float = 0.0
    noise: list[float] = field(default_factory=list)
    kind: str = "roofline"
    note: str = "a roofline model from datasheet figures and assumed efficiencies, not a measurement"

    def __post_init__(self) -> None:
        if isinstance(self.hardware, dict):
            self.hardware = Hardware(**self.hardware)
        if isinstance(self.model, dict):
            self.model = ModelShape(**self.model)

    @property
    def kv_bytes_per_token(self) -> float:
        return kv_bytes_per_token(self.model, self.bytes_per_param)

    @property
    def num_gpu_blocks(self) -> int:
        """The KV blocks the memory left holds; a hybrid model's state slots are taken first, as the
        engine sizes them by default (``EngineArgs.state_slots``: 4 x 64 + 1 slots with prefix
        caching, at most half the memory)."""
        free = self.hardware.memory_bytes * self.gpu_memory_utilization - self.model.num_params * self.bytes_per_param
        free -= min(4 * 64 + 1, free // 2 // max(self.model.state_bytes_per_slot, 1)) * self.model.state_bytes_per_slot
        return max(int(free // (self.kv_bytes_per_token * self.block_size)), 2)

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    def step_seconds(self, shape: StepShape, token_bucket: int) -> float:
        """The predicted time of a step of ``shape`` padded to ``token_bucket`` tokens."""
        hw = self.hardware
        model = self.model
        return self.step_overhead_s + step_floor_seconds(
            model, model.params_read(shape.num_tokens), token_bucket, shape.sum_context, shape.attention_work,
            bytes_per_param=self.bytes_per_param, bandwidth_bytes_s=hw.bandwidth_bytes_s * self.bandwidth_efficiency,
            flops_per_s=hw.flops * self.flops_efficiency, num_active_params=model.num_active_params or None,
            num_rows=shape.num_rows)

    def noise_ratio(self, u: float) -> float:
        return 1.0

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        return write_json(self.to_dict(), path)


def roofline_profile(hardware: str = "h200", model: str = "llama-3-8b", **assumptions) -> RooflineProfile:
    """A what-if profile of a named accelerator and model (see ``HARDWARE``, ``MODELS``)."""
    for name, table, what in ((hardware, HARDWARE, "hardware"), (model, MODELS, "model")):
        if name not in table:
            raise ValueError(f"{what}: unknown {name!r}; known: {', '.join(table)}")
    return RooflineProfile(HARDWARE[hardware], MODELS[model], **assumptions)
