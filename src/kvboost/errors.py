"""Typed errors. Every bad input raises one of these (all are ValueError subclasses where the input is at fault)."""
from __future__ import annotations


class KVBoostError(Exception):
    """Base class for every error KVBoost raises on purpose."""


class InvalidRequestError(KVBoostError, ValueError):
    """A request argument is wrong (empty prompt, bad temperature, unknown mode...)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt does not fit in the model's context window."""


class ModelNotSupportedError(KVBoostError, ValueError):
    """The architecture cannot have its K/V reused correctly (ALiBi, learned absolute positions...)."""


class EmbeddedModelMissingError(KVBoostError, ImportError):
    """The default model package is not installed."""
