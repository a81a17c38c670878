"""What the command-line entry points share: loading the engine for a ``--model`` argument.

``cli.py``, ``demo.py`` and the ``kvboost bench`` commands all import this module, and it imports none of
them, so the commands and the CLI that registers them have no import cycle.
"""
from __future__ import annotations

import typer

MODEL_HELP = "Local path or Hugging Face id (default: embedded SmolLM2-135M)."


def load_engine(model: str | None, **options):
    """KVBoost.from_pretrained, with a one-line error instead of a traceback for a bad model argument."""
    from . import KVBoost

    try:
        return KVBoost.from_pretrained(model, **options)
    except (OSError, ValueError, ImportError) as exc:
        typer.echo(f"error: cannot load model {model or '(embedded)'!r}: {str(exc).splitlines()[0]}", err=True)
        raise typer.Exit(2) from None
