"""Where `kvboost bench` and `kvboost eval` find the repository's top-level `benchmarks` package (never installed):
importable already, else beside this package's source in a clone (``<clone>/benchmarks``), else NEEDS_A_CHECKOUT."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = "benchmarks"
COMMANDS = f"{PACKAGE}.commands"  # defines register(bench_app, eval_app)
NEEDS_A_CHECKOUT = ("kvboost bench and kvboost eval run from a source checkout: clone the KVBoost repository and "
                    "run pip install -e \".[bench]\" in it")


def _import_commands() -> ModuleType | None:
    try:
        return importlib.import_module(COMMANDS)
    except ModuleNotFoundError as exc:
        # Only "no such package" means absent; a module missing inside the benchmarks is a real error.
        if exc.name in (PACKAGE, COMMANDS):
            return None
        raise


def find_benchmark_commands(beside: Path | None = None) -> ModuleType | None:
    """The `benchmarks.commands` module, or None without a checkout (beside: default the clone an editable install
    leaves this package in, ``<clone>/src/kvboost`` -> ``<clone>``)."""
    module = _import_commands()
    if module is not None:
        return module
    root = beside if beside is not None else Path(__file__).resolve().parents[2]
    if not (root / PACKAGE / "commands.py").is_file():
        return None
    sys.path.append(str(root))
    return _import_commands()
