#!/usr/bin/env python
"""Regenerate the benchmark workloads (benchmarks/workloads/ and src/kvboost/bench/data/).

    python scripts/make_workloads.py            # write both copies from the default seed
    python scripts/make_workloads.py --check    # exit 1 if the committed files differ from the generator
    python scripts/make_workloads.py --seed 7 --out /tmp/wl   # a different sample, elsewhere

All logic lives in kvboost.bench.workloads; this file only parses arguments.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from kvboost.bench import workloads
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from kvboost.bench import workloads


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=workloads.DEFAULT_SEED)
    ap.add_argument("--out", type=Path, action="append",
                    help="output directory (repeatable); default: the repo and package data directories")
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on any difference")
    args = ap.parse_args(argv)
    dirs = args.out or [workloads.repo_workloads_dir(), workloads.package_data_dir()]
    if args.check:
        stale = [f"{d / name}" for d in dirs for name in workloads.check_workloads(d, args.seed)]
        for path in stale:
            print(f"stale or missing: {path}", file=sys.stderr)
        return 1 if stale else 0
    for path in workloads.write_workloads(dirs, args.seed):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
