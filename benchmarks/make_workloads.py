"""Regenerate the benchmark workloads and the package's system-prompt sample (each file's one committed copy).

    python -m benchmarks.make_workloads            # write the committed copies from the default seed
    python -m benchmarks.make_workloads --check    # exit 1 if a committed file differs from the generator
    python -m benchmarks.make_workloads --seed 7 --out /tmp/wl   # a different sample, every file in one folder

The generators live in benchmarks/workload_generators/; this module only parses arguments.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .workload_generators import generate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=generate.DEFAULT_SEED)
    ap.add_argument("--out", type=Path, action="append",
                    help="output directory (repeatable); default: each file's committed copy "
                         "(benchmarks/data/, src/kvboost/data/)")
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on any difference")
    args = ap.parse_args(argv)
    if args.check:
        dirs = args.out or [None]
        stale = [path for d in dirs for path in generate.check_workloads(d, args.seed)]
        for path in stale:
            print(f"stale or missing: {path}", file=sys.stderr)
        return 1 if stale else 0
    for path in generate.write_workloads(args.out, args.seed):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
