"""``python -m zeroshard.bench [options]``: the same as ``zeroshard bench``."""

from __future__ import annotations

import argparse
import sys

from zeroshard.bench.cli import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeroshard bench")
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or an argparse error (already printed)
        return exc.code if isinstance(exc.code, int) else 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
