"""`fleetcuda cache`: the wheels built on targets and kept here, by ABI fingerprint: list or prune."""

from __future__ import annotations

import argparse
import json

from fleetcuda.cli.environment import Environment
from fleetcuda.errors import InputError
from fleetcuda.results import ExitStatus


def add_parser(sub: argparse._SubParsersAction, env: Environment) -> None:
    cp = sub.add_parser("cache", help="wheels built on targets and kept here, by ABI fingerprint: list or prune")
    csub = cp.add_subparsers(dest="cache_action", required=True)
    cl = csub.add_parser("list", help="every cached wheel: fingerprint, where and when it was built, its sha256")
    cl.add_argument("--package", help="only this package")
    cl.add_argument("--format", choices=["table", "json"], default="table")
    cr = csub.add_parser("prune", help="remove broken entries (and, with options, others)")
    cr.add_argument("--older-than", type=float, metavar="DAYS", help="also entries not installed for DAYS days")
    cr.add_argument("--package", help="also every entry of this package (with --older-than: only the old ones)")
    cr.add_argument("--all", action="store_true", help="empty the cache")
    cr.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")


def run(args: argparse.Namespace, env: Environment) -> ExitStatus:
    from fleetcuda.run.wheelcache import CacheEntry, Problem, WheelCache, render_cache

    cache = WheelCache()  # FLEETCUDA_CACHE_DIR of this process: the engine's shared builds read it there too
    if args.cache_action == "prune":
        if args.older_than is not None and args.older_than < 0:
            raise InputError("--older-than", None, str(args.older_than), "must be 0 or more days")
        removed = cache.prune(everything=args.all, older_than_days=args.older_than, package=args.package,
                              dry_run=args.dry_run)
        for path, why in removed:
            print(f"{'would remove' if args.dry_run else 'removed'} {path}: {why}", file=env.stdout)
        print(f"{len(removed)} entr{'y' if len(removed) == 1 else 'ies'} "
              f"{'would be removed' if args.dry_run else 'removed'} from {cache.root}", file=env.stdout)
        return ExitStatus.OK
    items = [i for i in cache.entries()
             if args.package is None or isinstance(i, Problem) or i.fingerprint.get("package") == args.package]
    if args.format == "json":
        print(json.dumps({"cache": str(cache.root), "entries": [
            {"path": str(i.path), "status": "ok", **i.provenance} if isinstance(i, CacheEntry)
            else {"path": str(i.path), "status": "broken", "why": i.why} for i in items]}, indent=2),
            file=env.stdout)
        return ExitStatus.OK
    render_cache(cache.root, items, env.console())
    return ExitStatus.OK
