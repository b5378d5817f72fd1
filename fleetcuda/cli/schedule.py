"""`fleetcuda schedule`: install, show or remove the nightly `fleetcuda verify` job (cron or systemd)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fleetcuda.cli import common
from fleetcuda.cli.environment import Environment
from fleetcuda.errors import InputError
from fleetcuda.results import ExitStatus


def add_parser(sub: argparse._SubParsersAction, env: Environment) -> None:
    sp = sub.add_parser("schedule", help="install, show or remove the nightly `fleetcuda verify` job")
    sp.add_argument("action", choices=["install", "show", "remove"])
    sp.add_argument("recipe", nargs="?", help="recipe to verify (for install)")
    common.add_inventory_option(sp, env)
    sp.add_argument("--limit")
    sp.add_argument("--name", default="nightly", help="job name, so several can coexist (default nightly)")
    sp.add_argument("--at", default="0 3 * * *", help="cron schedule (default: 03:00 every night)")
    sp.add_argument("--on-calendar", default="*-*-* 03:00:00", help="systemd OnCalendar (with --systemd)")
    sp.add_argument("--systemd", action="store_true", help="a systemd timer instead of a cron entry")
    sp.add_argument("--unit-dir", default="/etc/systemd/system")
    sp.add_argument("--reports-dir", help="where reports and the log go (default: the state directory)")
    sp.add_argument("--textfile-dir", metavar="DIR",
                    help="write the Prometheus report there instead, readable by all (node_exporter's "
                         "--collector.textfile.directory, e.g. /var/lib/prometheus/node-exporter)")
    sp.add_argument("--print", action="store_true", dest="print_only",
                    help="install: print what would be written (crontab line or unit files); write nothing")
    sp.set_defaults(inventory_later=True)  # show and remove need no inventory


def run(args: argparse.Namespace, env: Environment) -> ExitStatus:
    from fleetcuda.run.schedule import ScheduleError, remove_cron, show_cron, show_systemd

    if not args.systemd and not (args.action == "install" and args.print_only):
        common.check_state(env)  # the crontab's lock, and install's reports, are kept there
    crontab_lock = env.state_dir / "crontab.lock"
    try:
        if args.action == "show":
            found = show_systemd(args.name, args.unit_dir) if args.systemd else show_cron(args.name)
            if not found:
                print(f"no fleetcuda verify job named {args.name!r} is installed", file=env.stdout)
                return ExitStatus.FAILED
            if isinstance(found, dict):
                for path, text in found.items():
                    print(f"# {path}\n{text}", file=env.stdout)
            else:
                print(found, file=env.stdout)
            return ExitStatus.OK
        if args.action == "remove":
            if args.systemd:
                return _remove_systemd(args, env)
            removed = remove_cron(args.name, lock_path=crontab_lock)
            print(f"removed {args.name!r}" if removed else f"no job named {args.name!r} was installed",
                  file=env.stdout)
            return ExitStatus.OK
        return _install(args, env, crontab_lock)
    except ValueError as exc:
        print(f"fleetcuda: schedule: {exc}", file=env.stderr)
        return ExitStatus.INPUT
    except (ScheduleError, OSError) as exc:
        print(f"fleetcuda: schedule: {exc}", file=env.stderr)
        return ExitStatus.FAILED


def _install(args: argparse.Namespace, env: Environment, crontab_lock: Path) -> ExitStatus:
    # The recipe and inventory are loaded (checked) only here: show and remove need neither.
    from fleetcuda.plan.inventory import load_inventory
    from fleetcuda.plan.recipe import load_recipe
    from fleetcuda.run.schedule import cron_line, install_cron, install_systemd, systemd_units, unit_name
    from fleetcuda.state import inventory_path

    if not args.recipe:
        raise InputError("schedule install", None, "recipe", "name the recipe to verify")
    args.inventory = inventory_path(args.inventory, env.environ, env.home)
    load_recipe(args.recipe)
    load_inventory(args.inventory)
    if not args.print_only:
        common.check_state(env)
    reports = Path(args.reports_dir) if args.reports_dir else env.state_dir / "reports"
    if reports.exists() and not reports.is_dir():
        raise InputError("--reports-dir" if args.reports_dir else "FLEETCUDA_STATE_DIR", None, "",
                         f"{reports} is not a directory")
    prom = reports / ("fleetcuda_" + args.name + ".prom")
    if args.textfile_dir:
        textfiles = env.resolve(args.textfile_dir)
        if not textfiles.is_dir():
            raise InputError("--textfile-dir", None, "", f"{textfiles} is not a directory (node_exporter's "
                             "--collector.textfile.directory)")
        prom = textfiles / ("fleetcuda_" + args.name + ".prom")
    argv = [_fleetcuda_executable(), "verify", str(env.resolve(args.recipe)), "-i",
            str(env.resolve(args.inventory)), "--plain",
            "--report", f"json={reports / (args.name + '.json')}",
            "--report", f"prometheus={prom}"]
    if args.limit:
        argv += ["--limit", args.limit]
    # What the job reads at 03:00 is what this command saw: the same home and state directory (history, logs).
    pinned = {"HOME": str(env.home), "FLEETCUDA_STATE_DIR": str(env.state_dir)}
    if args.systemd:
        if args.print_only:
            service, timer = systemd_units(args.name, argv, args.on_calendar, working_directory=str(env.cwd),
                                           environment=pinned)
            stem = Path(args.unit_dir) / unit_name(args.name)
            print(f"# would write {stem}.service\n{service}# would write {stem}.timer\n{timer}", end="",
                  file=env.stdout)
            return ExitStatus.OK
        reports.mkdir(parents=True, exist_ok=True, mode=0o700)
        done = install_systemd(args.name, argv, args.unit_dir, on_calendar=args.on_calendar,
                               working_directory=str(env.cwd), environment=pinned)
        print(f"{'wrote' if done.changed else 'unchanged'}: {done.service_path}, {done.timer_path}", file=env.stdout)
        print(f"activate with: {done.activate_command}", file=env.stdout)
    else:
        line = cron_line(argv, log_path=str(reports / f"{args.name}.log"), at=args.at, name=args.name,
                         cwd=str(env.cwd), environment=pinned)
        if args.print_only:
            print("would install into the crontab: " + line, file=env.stdout)
            return ExitStatus.OK
        reports.mkdir(parents=True, exist_ok=True, mode=0o700)
        changed = install_cron(line, args.name, lock_path=crontab_lock)
        print(("installed: " if changed else "already installed: ") + line, file=env.stdout)
    return ExitStatus.OK


def _remove_systemd(args: argparse.Namespace, env: Environment) -> ExitStatus:
    """Undo what install (and its `activate with:` command) did: the timer stopped and disabled, then the unit
    files removed and systemd reloaded. Without systemctl on PATH nothing can have been activated."""
    import shutil

    from fleetcuda.run.schedule import remove_systemd, show_systemd, unit_name

    systemctl_exe = shutil.which("systemctl", path=env.environ.get("PATH", ""))
    user_dir = env.home / ".config" / "systemd" / "user"
    systemctl = [systemctl_exe, "--user"] if systemctl_exe and Path(args.unit_dir) == user_dir else [systemctl_exe]
    timer = f"{unit_name(args.name)}.timer"
    active = bool(systemctl_exe) and bool(show_systemd(args.name, args.unit_dir)) and any(
        _quiet([*systemctl, query, "--quiet", timer]) == 0 for query in ("is-enabled", "is-active"))
    removed = remove_systemd(args.name, args.unit_dir, deactivate=active, systemctl=systemctl)  # type: ignore[arg-type]
    if active:
        print(f"stopped and disabled {timer}", file=env.stdout)
    print(f"removed {args.name!r}: {', '.join(str(p) for p in removed)}" if removed
          else f"no job named {args.name!r} was installed", file=env.stdout)
    return ExitStatus.OK


def _quiet(argv: list[str]) -> int:
    import subprocess

    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired):
        return 1


def _fleetcuda_executable() -> str:
    """Cron's PATH will not find a virtualenv's fleetcuda: name the one beside this Python, by absolute path."""
    import shutil

    beside = Path(sys.executable).parent / "fleetcuda"
    if beside.exists():
        return str(beside)
    found = shutil.which("fleetcuda")
    return str(Path(found).resolve()) if found else str(beside)
