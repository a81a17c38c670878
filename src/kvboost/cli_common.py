"""What the command-line entry points share: loading the engine a --model option names, one-line text. Imports
neither cli.py nor demo.py (no cycle); torch only inside functions, so `kvboost --help` stays fast."""
from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import typer

if TYPE_CHECKING:
    from .engine import InferenceEngine

MODEL_HELP = "Local path or Hugging Face id (default: embedded SmolLM2-135M)."
# "This model cannot be loaded as asked" (not a bug): one line, no traceback.
LOAD_ERRORS = (OSError, ValueError, ImportError)


def exit_cannot_load(what: str, exc: BaseException) -> NoReturn:
    """Exit 2 with ``error: cannot load <what>: <first line of exc>`` on stderr."""
    typer.echo(f"error: cannot load {what}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", err=True)
    raise typer.Exit(2)


def load_engine(model: str | None = None, device: str | None = None, dtype: str | None = None,
                **options) -> InferenceEngine:
    """KVBoost.from_pretrained(model) (None: the embedded SmolLM2), a one-line error for a model that cannot load."""
    from . import KVBoost

    try:
        return KVBoost.from_pretrained(model, device=device, dtype=dtype, **options)
    except LOAD_ERRORS as exc:
        exit_cannot_load(f"model {model or '(embedded)'!r}", exc)


def one_line(text: str, width: int) -> str:
    """text with whitespace runs collapsed to single spaces, cut to `width` with a trailing ellipsis."""
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    return flat[:max(width - 1, 0)] + "…" if width > 0 else ""
