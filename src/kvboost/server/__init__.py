"""OpenAI-compatible server: FastAPI routes, pydantic schemas, one worker thread with prefix-aware batching.

Needs the `server` extra (fastapi, uvicorn, pydantic, prometheus-client). Start it with `kvboost serve`
or `kvboost-server`; embed it with `create_app(engine, ServerSettings(...))`.
"""
from __future__ import annotations

from .app import create_app
from .background import BackgroundServer
from .scheduler import Job, QueueFullError, Scheduler
from .settings import ServerSettings

__all__ = ["BackgroundServer", "Job", "QueueFullError", "Scheduler", "ServerSettings", "create_app"]
