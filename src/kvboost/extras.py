"""Optional extras: which are installed (find_spec, which imports nothing), and a one-line exit for a command that
needs a missing one, naming the extra from the source this KVBoost came from (install_source)."""
from __future__ import annotations

import importlib.util
import sys

from .install_source import extra_install_args

# extra name in pyproject -> the import names its commands need
EXTRAS: dict[str, tuple[str, ...]] = {
    "server": ("fastapi", "uvicorn", "pydantic", "prometheus_client"),
    "bench": ("matplotlib",),
    "redis": ("redis",),
    "structured": ("xgrammar",),
    "cluster": ("ray",),
}
# Modules outside any extra that a command may still need: module -> what to pip install.
STANDALONE = {"openai": "openai", "jsonschema": "jsonschema"}


def missing(*modules: str) -> list[str]:
    """The import names among `modules` that cannot be imported (None in sys.modules counts as missing)."""
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package that fails, or a module set to None
            found = False
        if not found:
            absent.append(name)
    return absent


def missing_extras(*extras: str) -> list[str]:
    """The extras among `extras` with at least one module missing."""
    return [extra for extra in extras if missing(*EXTRAS[extra])]


def require(command: str, *extras: str, modules: tuple[str, ...] = ()) -> None:
    """Exit with code 1 and a one-line install hint on stderr unless every extra and module is importable, e.g.
    "kvboost serve needs the server extra: pip install -e '/home/me/kvboost[server]'"."""
    extras, modules = tuple(missing_extras(*extras)), tuple(missing(*modules))  # the absent ones
    if extras or modules:
        needs = [f"the {', '.join(extras)} extra{'s' if len(extras) > 1 else ''}"] if extras else []
        needs += [f"the {m} package" for m in modules]
        pip = (extra_install_args(extras) if extras else []) + [STANDALONE.get(m, m) for m in modules]
        print(f"{command} needs {' and '.join(needs)}: pip install {' '.join(pip)}", file=sys.stderr)
        raise SystemExit(1)
