"""One log line per request (`kvboost serve --access-log`): method, path, status, milliseconds, and the prompt, cached
and completion tokens of the generations it ran.

The gateway middleware opens a tally for each request in a context variable; the handlers add each finished
generation to it (`count`), from the request's own task or the tasks it starts, which copy the context and so
share the tally."""
from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass

from ..results import GenerationResult

log = logging.getLogger("kvboost.access")


@dataclass
class Tally:
    prompt: int = 0  # the prompt counts once for n choices
    cached: int = 0
    completion: int = 0


_current: ContextVar[Tally | None] = ContextVar("kvboost_request_tally", default=None)


def open_tally() -> Tally:
    tally = Tally()
    _current.set(tally)
    return tally


def count(result: GenerationResult) -> None:
    tally = _current.get()
    if tally is not None:
        tally.prompt, tally.cached = result.prompt_tokens, result.cached_tokens
        tally.completion += result.generated_tokens


def write(method: str, path: str, status: int, ms: float, tally: Tally) -> None:
    log.info("%s %s %d %.1f ms prompt=%d cached=%d completion=%d", method, path, status, ms, tally.prompt,
             tally.cached, tally.completion)
