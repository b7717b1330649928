"""Model tiers: loading, quantization, and the continuous-batching engine with speculative drafting."""

from tiers.engine import Engine, EngineFullError, EngineLoad, RequestHandle
from tiers.output import StepOutput
from tiers.scheduler import SchedulerConfig
from tiers.sequence import SamplingParams

__all__ = [
    "Engine",
    "EngineFullError",
    "EngineLoad",
    "RequestHandle",
    "SamplingParams",
    "SchedulerConfig",
    "StepOutput",
]
