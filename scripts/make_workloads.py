#!/usr/bin/env python
"""Regenerate the benchmark workloads (the one shipped copy: src/kvboost/bench/data/).

    python scripts/make_workloads.py            # write the package data from the default seed
    python scripts/make_workloads.py --check    # exit 1 if the committed files differ from the generator
    python scripts/make_workloads.py --seed 7 --out /tmp/wl   # a different sample, elsewhere

The generators live in scripts/workloads/ (not installed); this file only parses arguments.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # scripts/workloads/, also when this file is loaded by path (tests)
    sys.path.insert(0, str(_HERE))
try:
    import kvboost.bench.workloads  # noqa: F401  (the generators import its file names)
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(_HERE.parent / "src"))

from workloads import generate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=generate.DEFAULT_SEED)
    ap.add_argument("--out", type=Path, action="append",
                    help="output directory (repeatable); default: the package data directory")
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on any difference")
    args = ap.parse_args(argv)
    dirs = args.out or [generate.package_data_dir()]
    if args.check:
        stale = [f"{d / name}" for d in dirs for name in generate.check_workloads(d, args.seed)]
        for path in stale:
            print(f"stale or missing: {path}", file=sys.stderr)
        return 1 if stale else 0
    for path in generate.write_workloads(dirs, args.seed):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
