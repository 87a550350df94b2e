"""``python -m arraymp``: doctor (machine report), demo (the main job), bench (queue transfer benchmark)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arraymp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="report /dev/shm size and free space, ulimit -n, memfd, start method")
    demo = sub.add_parser("demo", help="run a pipeline and a pool over real arrays, against plain pickling")
    demo.add_argument("--quick", action="store_true", help="a quarter of the work")
    sub.add_parser("bench", help="queue transfer benchmark against the stdlib and torch (bench --help)",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from ._bench import main as bench

        return bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "doctor":
        from ._doctor import main as doctor

        return doctor()
    from ._demo import main as demo_main

    return demo_main(quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
