"""arraymp's command line (the arraymp command, or python -m arraymp): doctor
reports what this machine offers shared memory, demo runs the main job, bench
benchmarks queue transfers, stats PID shows what a running program moved."""

from __future__ import annotations

import argparse
import os
import sys

PACKAGES = ("shm-core", "shm-manager", "mp-reductions", "shm-cuda", "mp-spawn")
EXTRAS = ("mp-dask",)  # listed when installed (arraymp[dask])


def versions() -> str:
    """arraymp's version and its packages' (each versioned alone), from the installed metadata."""
    from importlib.metadata import PackageNotFoundError, version

    found = [f"{name} {version(name)}" for name in PACKAGES]
    for name in EXTRAS:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return f"arraymp {version('arraymp')} ({', '.join(found)})"


def _prog() -> str:
    """The name the user ran us by, for usage lines."""
    name = os.path.basename(sys.argv[0])
    return "python -m arraymp" if name in ("__main__.py", "-c", "") else name


def main(argv: list[str] | None = None) -> int:
    prog = _prog()
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=versions())
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="report /dev/shm size and free space, ulimit -n, memfd, start method, CUDA")
    demo = sub.add_parser("demo", help="run a pipeline and a pool over real arrays, against plain pickling (~10 s)")
    scale = demo.add_mutually_exclusive_group()
    scale.add_argument("--quick", dest="scale", action="store_const", const=0.25, default=1,
                       help="a quarter of the work")
    scale.add_argument("--full", dest="scale", action="store_const", const=4,
                       help="four times the work, for steadier numbers")
    sub.add_parser("bench", help="queue transfer benchmark against the stdlib and torch (bench --help)",
                   add_help=False)
    st = sub.add_parser("stats", help="what a running arraymp program moved: messages, arrays shared, copied or "
                        "pickled, segments (arraymp.stats() of process PID)")
    st.add_argument("pid", type=int, help="the process id of a running program that imported arraymp")
    st.add_argument("--json", action="store_true", help="print a JSON object")
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from ._bench import main as bench

        return bench(rest, prog=f"{prog} bench")
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "doctor":
        from ._doctor import main as doctor

        return doctor()
    if args.command == "stats":
        return _stats(args.pid, args.json, prog)
    from ._demo import main as demo_main

    return demo_main(args.scale)


def _stats(pid: int, as_json: bool, prog: str) -> int:
    from mp_reductions import read_stats as read

    try:
        s = read(pid)
    except (LookupError, OSError) as exc:  # (ProcessLookupError, PermissionError are OSErrors)
        print(f"{prog} stats: error: {exc}", file=sys.stderr)
        return 1
    if as_json:
        import json

        print(json.dumps({"pid": s.pid, **s.as_dict(), "sharing_stopped_at": s.where or None}, indent=1))
    else:
        print(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
