"""``python -m arraymp``: doctor (machine report), demo (the main job), bench."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arraymp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="report /dev/shm size and free space, ulimit -n, memfd, start method")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from ._doctor import main as doctor

        return doctor()
    return 2


if __name__ == "__main__":
    sys.exit(main())
