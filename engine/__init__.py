"""The paged-KV LLM engine: model, weights, block manager, scheduler, sampler, device worker."""

from engine.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, PoolConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, RequestError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling import SamplingParams
from engine.worker import AsyncEngineClient, EngineDeadError

__all__ = [
    "AsyncEngineClient", "CacheConfig", "CompletionOutput", "ConfigError", "EngineConfig", "EngineDeadError",
    "LLMEngine", "ModelConfig", "PoolConfig", "RequestError", "RequestOutput", "SamplingParams",
    "SchedulerConfig",
]
