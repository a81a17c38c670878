"""OpenAI-compatible server (the `server` extra): FastAPI routes, pydantic schemas, one worker thread with
prefix-aware batching. Embed it with `create_app(engine, ServerSettings(...))`."""
from __future__ import annotations

from importlib import import_module
from typing import Any

# Loaded on first use: the CLI registering `serve` loads neither fastapi nor torch, nor fails on a missing extra.
_EXPORTS = {"create_app": ".app", "BackgroundServer": ".background", "Job": ".scheduler",
            "QueueFullError": ".scheduler", "Scheduler": ".scheduler", "ServerSettings": ".settings"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name], __name__), name)
