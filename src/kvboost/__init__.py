"""KVBoost: chunk-level KV-cache reuse for Hugging Face causal LMs."""
from __future__ import annotations

from .config import EngineConfig
from .errors import (
    ContextLengthError,
    EmbeddedModelMissingError,
    InvalidRequestError,
    KVBoostError,
    ModelNotSupportedError,
)
from .results import CorrectnessReport, GenerationMode, GenerationResult, PromptCheck, RecomputeStrategy, WarmResult

__version__ = "0.2.0"

__all__ = [
    "KVBoost", "InferenceEngine", "EngineConfig", "GenerationMode", "RecomputeStrategy", "GenerationResult",
    "WarmResult", "CorrectnessReport", "PromptCheck", "KVBoostError", "InvalidRequestError", "ContextLengthError",
    "ModelNotSupportedError", "EmbeddedModelMissingError", "__version__",
]


def __getattr__(name: str):
    # The engine pulls in torch + transformers; importing it lazily keeps `import kvboost` and the CLI's --help fast.
    if name in ("KVBoost", "InferenceEngine"):
        from .engine import InferenceEngine
        return InferenceEngine
    raise AttributeError(f"module 'kvboost' has no attribute {name!r}")
