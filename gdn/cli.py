"""The ``gdn`` command line."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    """Entry point of the ``gdn`` console script."""
    parser = argparse.ArgumentParser(prog="gdn", description="Gated DeltaNet toolkit")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("demo", help="run every op through every backend and print agreement and time")
    args = parser.parse_args(argv)
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if args.command == "demo":
        from .demo import main as demo

        demo()
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
