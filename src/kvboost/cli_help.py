"""`--help` that reads like a man page: a flag shows bare, an option's value as its parameter name in capitals (as
argparse does), choices as typer lists them; docstring help is reflowed (typer keeps the source's line breaks)."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup


def readable_metavar(param: Any) -> str | None:
    """What `param`'s help shows for its value, or None to leave typer's own (choices, arguments, set metavars)."""
    if getattr(param, "param_type_name", None) != "option" or param.metavar is not None:
        return None
    if getattr(param, "is_flag", False):
        return ""
    # typer with its own parser describes types with a descriptor; older typer hands click a Choice type.
    descriptor = getattr(param, "type_descriptor", None)
    choices = bool(getattr(descriptor, "is_choice", False)) if descriptor is not None \
        else type(getattr(param, "type", None)).__name__ == "Choice"
    if choices or not param.name:
        return None
    return param.name.upper()


class _ReadableParams:
    """Sets each parameter's readable metavar before anything (help, usage, errors) reads the parameters."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]  # the typer command class this is mixed into
        for param in params:
            metavar = readable_metavar(param)
            if metavar is not None:
                param.metavar = metavar
        return params


class ReadableCommand(_ReadableParams, TyperCommand):
    pass


class ReadableGroup(_ReadableParams, TyperGroup):
    pass


def reflowed(doc: str) -> str:
    """A docstring's paragraphs, each on one line (paragraphs stay apart), for the terminal to wrap."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())


class HelpTyper(typer.Typer):
    """typer.Typer whose group and commands render their options as described above."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cls=kwargs.pop("cls", ReadableGroup), **kwargs)

    def command(self, *args: Any, cls: type[TyperCommand] | None = None, **kwargs: Any
                ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:  # type: ignore[override]
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            options = dict(kwargs)
            if options.get("help") is None and fn.__doc__:
                options["help"] = reflowed(fn.__doc__)
            return super(HelpTyper, self).command(*args, cls=cls or ReadableCommand, **options)(fn)

        return register
