"""Rewrite the golden wire files from the samples in ``tests/golden_samples.py``.

Usage: ``python tools/regen_golden.py [--check]``. Writes
``tests/golden/wire/<kind>.v<version>.msgpack`` for the current version of every registered
message kind. Files of older versions are never touched: they stay forever so that decoding
(and upgrading) what earlier builds sent stays tested. With ``--check`` nothing is written and
the exit status is 1 when a file is missing or differs.

Tests never run this; a golden diff in review is a deliberate protocol change.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from protocols import REGISTRY, encode

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "tests" / "golden" / "wire"
SAMPLES_FILE = ROOT / "tests" / "golden_samples.py"


def load_samples() -> dict:
    """Import ``tests/golden_samples.py`` by path (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location("golden_samples", SAMPLES_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SAMPLES


def golden_path(kind: str, version: int) -> Path:
    return GOLDEN_DIR / f"{kind}.v{version}.msgpack"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only, write nothing")
    args = parser.parse_args(argv)
    samples = load_samples()
    missing = sorted(set(REGISTRY) - set(samples))
    if missing:
        print(f"no sample for: {', '.join(missing)} (add them to {SAMPLES_FILE})", file=sys.stderr)
        return 1
    stale = 0
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for kind, cls in sorted(REGISTRY.items()):
        path, data = golden_path(kind, cls.VERSION), encode(samples[kind])
        if path.exists() and path.read_bytes() == data:
            continue
        stale += 1
        print(f"{'differs' if path.exists() else 'missing'}: {path.relative_to(ROOT)}")
        if not args.check:
            path.write_bytes(data)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
