"""jaxengine: a vLLM-class LLM inference and serving engine on JAX/XLA."""
from jaxengine.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxengine.core.policy import SchedulingPolicy
from jaxengine.engine import Engine
from jaxengine.lora_request import LoRARequest
from jaxengine.request import Request, RequestStatus, SequenceGroup
from jaxengine.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "EngineArgs", "BeamSearchParams", "CacheConfig", "Engine", "EngineConfig", "LoRARequest", "Request", "RequestStatus", "SamplingParams",
           "SchedulerConfig", "SchedulingPolicy", "SequenceGroup"]


def __getattr__(name: str):
    if name == "LLM":           # lazily: importing jaxengine must not import JAX
        from jaxengine.llm import LLM

        return LLM
    if name == "EngineArgs":    # its module imports the kernels' backend list, and so JAX
        from jaxengine.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'jaxengine' has no attribute {name!r}")
