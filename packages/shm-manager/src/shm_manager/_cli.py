"""The ``shm-manager`` command line: ``list``, ``gc``, ``stats``."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__, _gc

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2

_SAFE = """\
the safe way to clean up:
  shm-manager gc --dry-run   shows what would go; shm-manager gc removes it.
  gc removes only segments you own whose group is provably dead: every
  process of an arraymp program holds a lock on its group's lock file for as
  long as it lives, so a free lock is proof that no process can use the
  segment any more. Segments of running programs and of other users are never
  touched; segments without a lock file are only listed ('unknown'), unless
  you ask for --orphans (a guess from pids).
  Do not `rm /dev/shm/arraymp_*` by hand: that also deletes the segments of
  running programs (which then fail to share them) and other users' files.
  Normally nothing is left to clean: each group's daemon removes its segments
  when the group ends, and every new arraymp program sweeps dead groups.

exit codes: 0 success, 1 error (e.g. the directory cannot be read),
2 bad usage."""


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shm-manager", description="List and safely remove arraymp shared-memory "
                                "segments left in /dev/shm by crashed programs.", epilog=_SAFE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--dir", help="segment directory (default: $ARRAYMP_SHM_DIR, else /dev/shm)")
    sub = p.add_subparsers(dest="command", metavar="{list,gc,stats}")
    ls = sub.add_parser("list", help="our segments: name, size, creating pid, group alive/dead, age")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    g = sub.add_parser("gc", help="remove our segments of dead groups", epilog=_SAFE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--dry-run", "-n", action="store_true", help="show what would be removed, remove nothing")
    g.add_argument("--json", action="store_true", help="print a JSON object")
    g.add_argument("--prefix", action="append", default=None,
                   help="name prefix counted for groups without a lock file (default: arraymp_)")
    g.add_argument("--orphans", action="store_true",
                   help="also remove segments without a group lock file whose creating pid is gone (a guess)")
    st = sub.add_parser("stats", help="shm size, used, free, our share, ulimit -n")
    st.add_argument("--json", action="store_true", help="print a JSON object")
    return p


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.command is None:
        p.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "list":
            return _list(args)
        if args.command == "gc":
            return _gc_cmd(args)
        return _stats(args)
    except OSError as exc:
        print(f"shm-manager: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _print_json(obj) -> int:
    json.dump(obj, sys.stdout, indent=1)
    print()
    return EXIT_OK


def _list(args) -> int:
    segs = _gc.list_segments(args.dir)
    if args.json:
        return _print_json(segs)
    if not segs:
        print("no arraymp segments of this user")
        return EXIT_OK
    print(f"{'NAME':<52} {'SIZE':>10} {'PID':>8} {'GROUP':<14} {'STATE':<8} {'AGE':>8}")
    for s in segs:
        print(f"{s['name']:<52} {_human(s['bytes']):>10} {s['pid']:>8} {s['group']:<14} {s['state']:<8} "
              f"{s['age']:>7.1f}s")
    dead = [s for s in segs if s["state"] == "dead"]
    if dead:
        print(f"{len(dead)} segment(s) of dead groups ({_human(sum(s['bytes'] for s in dead))}): "
              "run `shm-manager gc` to remove them")
    return EXIT_OK


def _gc_cmd(args) -> int:
    prefixes = tuple(args.prefix) if args.prefix else _gc.DEFAULT_PREFIXES
    removed = _gc.gc(dry_run=args.dry_run, dir=args.dir, prefixes=prefixes, orphans=args.orphans)
    freed = sum(size for _, size in removed)
    if args.json:
        return _print_json({"dry_run": args.dry_run, "removed": [{"name": n, "bytes": b} for n, b in removed],
                            "bytes_freed": 0 if args.dry_run else freed})
    verb = "would remove" if args.dry_run else "removed"
    for name, size in removed:
        print(f"{verb} {name} ({_human(size)})")
    if args.dry_run:
        print(f"{len(removed)} segment(s) of dead groups, {freed:,} bytes would be freed (dry run)")
    else:
        print(f"removed {len(removed)} segment(s) of dead groups, freed {freed:,} bytes")
    return EXIT_OK


def _stats(args) -> int:
    s = _gc.stats(args.dir)
    if args.json:
        return _print_json(s)
    print(f"{s['dir']}: size {_human(s['size'])}, used {_human(s['used'])}, free {_human(s['free'])}")
    print(f"ours: {s['our_segments']} segment(s), {_human(s['our_bytes'])}; reclaimable by gc "
          f"{_human(s['reclaimable_bytes'])}; groups alive {s['groups_alive']}, dead {s['groups_dead']}, "
          f"unknown {s['groups_unknown']}")
    print(f"ulimit -n: soft {s['ulimit_nofile_soft']}, hard {s['ulimit_nofile_hard']}")
    return EXIT_OK
