"""Run the test suite while CPU hogs take cores, as on a shared CI machine.

    python tools/run_tests_under_load.py [--hogs 1] [-- PYTEST ARGS...]

Starts ``--hogs`` processes that spin forever (each takes one core), runs ``python -m pytest``
with the given arguments (default: the whole suite), stops the hogs and exits with pytest's
status. Nothing in the suite may depend on having the machine to itself: timing lives in
benchmarks, and the virtual-clock tests' watchdogs extend while their virtual time moves.
"""
from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time


def spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--hogs", type=int, default=1, help="spinning processes (default 1: one core)")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="arguments after -- go to pytest")
    args = p.parse_args(argv)
    if args.hogs < 0:
        p.error("--hogs must be >= 0")
    extra = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    hogs = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    t0 = time.monotonic()
    try:
        rc = subprocess.call([sys.executable, "-m", "pytest", *extra])
    finally:
        for h in hogs:
            h.terminate()
    print(f"suite exit {rc} in {time.monotonic() - t0:.0f} s with {args.hogs} CPU hog(s)", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
