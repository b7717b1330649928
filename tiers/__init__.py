"""Model tiers: loading, quantization, and the continuous-batching engine with speculative drafting."""

from tiers.core.output import StepOutput
from tiers.core.sched.scheduler import SchedulerConfig
from tiers.core.sequence import SamplingParams
from tiers.engine.llm_engine import Engine, EngineFullError, EngineLoad, RequestHandle

__all__ = [
    "Engine",
    "EngineFullError",
    "EngineLoad",
    "RequestHandle",
    "SamplingParams",
    "SchedulerConfig",
    "StepOutput",
]
