"""Install, show and remove the nightly `fleetcuda verify` job: a crontab line or a systemd timer.

Each job has a name (letters, digits, `.`, `_`, `-`). Its crontab line ends in the marker comment
`# fleetcuda-verify:<name>`, which is how it is found again: installing replaces the line with the same
marker (installing twice leaves one line) and removing deletes only that line. Its systemd units are
`fleetcuda-verify-<name>.service` and `.timer`.

The command is taken as an argv and quoted here, for sh (cron) or for systemd's own syntax, so no
argument can break out of its word. The job must run without a terminal: stdin is /dev/null, and the
argv should use `--plain` and write its report with `--output`.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MARKER = "fleetcuda-verify"
DEFAULT_NAME = "nightly"
DEFAULT_AT = "0 3 * * *"
DEFAULT_ON_CALENDAR = "*-*-* 03:00:00"
SYSTEM_UNIT_DIR = "/etc/systemd/system"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_CRON_FIELD = re.compile(r"[A-Za-z0-9*/,-]+")
_ON_CALENDAR = re.compile(r"[A-Za-z0-9*:/,.~+_ -]+")
_TIMESPAN = re.compile(r"[0-9]+ ?(us|ms|s|sec|m|min|h|hr|d|w|M|y)?( ?[0-9]+ ?(us|ms|s|sec|m|min|h|hr|d|w|M|y))*")
_USER = re.compile(r"[a-z_][a-z0-9_.-]{0,31}\$?")
# Words systemd and sh both read as themselves; anything else is quoted.
_PLAIN_WORD = re.compile(r"[A-Za-z0-9._/=:,+@-]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ScheduleError(RuntimeError):
    """crontab or systemctl could not be run, or refused."""


# -- validation ---------------------------------------------------------------------------------


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"job name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter "
                         "or digit")
    return name


def check_cron_at(at: str) -> str:
    """Five cron fields (minute hour day-of-month month day-of-week) of [A-Za-z0-9*/,-]; returns them normalized."""
    fields = at.split() if not any(c in at for c in "\n\r\v\f") else []
    if len(fields) != 5 or not all(_CRON_FIELD.fullmatch(f) for f in fields):
        raise ValueError(f"schedule {at!r}: expected 5 cron fields (minute hour day month weekday) made of "
                         "letters, digits and * / , - only, e.g. '0 3 * * *'")
    return " ".join(fields)


def check_on_calendar(on_calendar: str) -> str:
    """A systemd OnCalendar= value of safe characters (letters, digits, space and * : / , . ~ + _ -)."""
    value = " ".join(on_calendar.split())
    if not value or any(c in on_calendar for c in "\n\r\v\f") or len(value) > 200 or not _ON_CALENDAR.fullmatch(value):
        raise ValueError(f"OnCalendar {on_calendar!r}: use a systemd calendar expression such as "
                         "'*-*-* 03:00:00' or 'Mon..Fri 02:30' (letters, digits, space and * : / , . ~ + _ - only)")
    return value


def _check_argv(argv: Sequence[str], for_what: str) -> list[str]:
    argv = list(argv)
    if not argv:
        raise ValueError("the command is empty")
    if not os.path.isabs(argv[0]):
        # cron's PATH is /usr/bin:/bin and a venv's fleetcuda is in neither.
        raise ValueError(f"{for_what}: the command must start with an absolute path (got {argv[0]!r})")
    for arg in argv:
        if any(c in arg for c in "\n\r\0"):
            raise ValueError(f"{for_what}: argument {arg!r} contains a newline or NUL")
    return argv


# -- cron ---------------------------------------------------------------------------------------


def marker(name: str) -> str:
    return f"# {MARKER}:{check_name(name)}"


def _cron_escape(text: str) -> str:
    # cron turns an unescaped % into a newline (the rest becomes stdin) before any shell sees the line,
    # and only `\%` stands for a literal %; a backslash right before a % can therefore not be written.
    if "\\%" in text:
        raise ValueError(f"cron cannot carry a backslash followed by %: {text!r}")
    return text.replace("%", "\\%")


def _check_environment(environment: Mapping[str, str] | None, for_what: str) -> dict[str, str]:
    out = dict(environment or {})
    for k, v in out.items():
        if not _ENV_NAME.fullmatch(k) or any(c in v for c in "\n\r\0"):
            raise ValueError(f"{for_what}: environment {k}={v!r}: a variable name, and a value of one line")
    return out


def cron_line(command_argv: Sequence[str], *, log_path: str, at: str = DEFAULT_AT, name: str = DEFAULT_NAME,
              cwd: str | None = None, environment: Mapping[str, str] | None = None) -> str:
    """One crontab line: `<at> umask 077; [cd DIR &&] [K=V...] ARGV... </dev/null >>LOG 2>&1 # fleetcuda-verify:<name>`.

    Every word is shell-quoted (shlex.quote) and every % escaped for cron. umask 077 keeps the log private.
    `environment` pins variables for the command (HOME, FLEETCUDA_STATE_DIR: what the installer saw).
    """
    schedule = check_cron_at(at)
    argv = _check_argv(command_argv, "cron")
    if not os.path.isabs(log_path) or any(c in log_path for c in "\n\r\0"):
        raise ValueError(f"cron: the log path must be an absolute path (got {log_path!r})")
    words = ["umask 077;"]
    if cwd is not None:
        if not os.path.isabs(cwd) or any(c in cwd for c in "\n\r\0"):
            raise ValueError(f"cron: the working directory must be an absolute path (got {cwd!r})")
        words += ["cd", shlex.quote(cwd), "&&"]
    words += [f"{k}={shlex.quote(v)}" for k, v in _check_environment(environment, "cron").items()]
    words += [shlex.quote(a) for a in argv]
    words += ["</dev/null", ">>" + shlex.quote(log_path), "2>&1", marker(name)]
    return f"{schedule} " + _cron_escape(" ".join(words))


def _marker_re(name: str) -> re.Pattern[str]:
    return re.compile(r"#\s*" + re.escape(MARKER) + ":" + re.escape(check_name(name)) + r"\s*\Z")


def _crontab_argv(crontab_cmd: str | Sequence[str]) -> list[str]:
    return [crontab_cmd] if isinstance(crontab_cmd, str) else list(crontab_cmd)


def read_crontab(crontab_cmd: str | Sequence[str] = "crontab") -> str:
    """The current user's crontab (`crontab -l`); "no crontab for ..." reads as empty."""
    argv = _crontab_argv(crontab_cmd)
    try:
        proc = subprocess.run([*argv, "-l"], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    except FileNotFoundError as exc:
        raise ScheduleError(f"{argv[0]} not found: is cron installed? (or use the systemd timer)") from exc
    if proc.returncode == 0:
        return proc.stdout
    if "no crontab for" in proc.stderr.lower():
        return ""
    raise ScheduleError(f"{shlex.join([*argv, '-l'])} failed (exit {proc.returncode}): {proc.stderr.strip()}")


def write_crontab(text: str, crontab_cmd: str | Sequence[str] = "crontab") -> None:
    """Replace the current user's crontab with `text` (`crontab -`)."""
    argv = _crontab_argv(crontab_cmd)
    if text and not text.endswith("\n"):
        text += "\n"  # cron ignores a last line without a newline
    try:
        proc = subprocess.run([*argv, "-"], input=text, capture_output=True, text=True, timeout=60)
    except FileNotFoundError as exc:
        raise ScheduleError(f"{argv[0]} not found: is cron installed? (or use the systemd timer)") from exc
    if proc.returncode != 0:
        raise ScheduleError(f"{shlex.join([*argv, '-'])} refused the new crontab (exit {proc.returncode}): "
                            f"{proc.stderr.strip()}")


def default_lock_path() -> Path:
    """The lock that serializes this user's crontab edits: in fleetcuda's state directory."""
    from fleetcuda.state import state_dir

    return state_dir() / "crontab.lock"


@contextmanager
def crontab_lock(lock_path: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Hold an exclusive flock for a read-modify-write of the crontab, so that two `fleetcuda schedule` runs at
    once cannot both read the old table and one of them drop the other's line."""
    path = Path(lock_path) if lock_path is not None else default_lock_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as exc:
        raise ScheduleError(f"cannot create the crontab lock {path}: {exc.strerror or exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def install_cron(line: str, name: str = DEFAULT_NAME, crontab_cmd: str | Sequence[str] = "crontab", *,
                 lock_path: str | os.PathLike[str] | None = None) -> bool:
    """Put `line` (from cron_line, same name) in the crontab in place of the job's old line; True if it changed.

    Other lines are kept as they are; an old line of this job keeps its position. The read and the write hold
    crontab_lock(lock_path), so concurrent installs of different jobs all end up in the table.
    """
    pattern = _marker_re(name)
    if "\n" in line or not pattern.search(line):
        raise ValueError(f"the crontab line must be one line ending in {marker(name)!r} (build it with cron_line)")
    with crontab_lock(lock_path):
        return _install_cron(line, pattern, crontab_cmd)


def _install_cron(line: str, pattern: re.Pattern[str], crontab_cmd: str | Sequence[str]) -> bool:
    current = read_crontab(crontab_cmd)
    lines = current.splitlines()
    kept: list[str] = []
    placed = False
    for existing in lines:
        if pattern.search(existing):
            if not placed:
                kept.append(line)
                placed = True
            continue
        kept.append(existing)
    if not placed:
        kept.append(line)
    new = "\n".join(kept) + "\n"
    if new == current:
        return False
    write_crontab(new, crontab_cmd)
    return True


def show_cron(name: str = DEFAULT_NAME, crontab_cmd: str | Sequence[str] = "crontab") -> str | None:
    """The job's crontab line, or None when it is not installed."""
    pattern = _marker_re(name)
    return next((ln for ln in read_crontab(crontab_cmd).splitlines() if pattern.search(ln)), None)


def remove_cron(name: str = DEFAULT_NAME, crontab_cmd: str | Sequence[str] = "crontab", *,
                lock_path: str | os.PathLike[str] | None = None) -> bool:
    """Delete the job's line, leaving every other line as it is; True if there was one (under crontab_lock)."""
    pattern = _marker_re(name)
    with crontab_lock(lock_path):
        return _remove_cron(pattern, crontab_cmd)


def _remove_cron(pattern: re.Pattern[str], crontab_cmd: str | Sequence[str]) -> bool:
    current = read_crontab(crontab_cmd)
    lines = current.splitlines()
    kept = [ln for ln in lines if not pattern.search(ln)]
    if len(kept) == len(lines):
        return False
    write_crontab("\n".join(kept) + "\n" if kept else "", crontab_cmd)
    return True


# -- systemd ------------------------------------------------------------------------------------


def unit_name(name: str) -> str:
    """`fleetcuda-verify-<name>`: the stem of the job's .service and .timer."""
    return f"{MARKER}-{check_name(name)}"


def systemd_quote(arg: str) -> str:
    """One word of an ExecStart= line, read back by systemd as exactly `arg`.

    systemd expands `%` specifiers and `$VAR` even inside quotes, so they are doubled; backslash and double
    quote are C-escaped inside double quotes; control characters become \\xNN.
    """
    text = arg.replace("%", "%%").replace("$", "$$")
    if _PLAIN_WORD.fullmatch(text):
        return text
    out = []
    for c in text:
        if c in '\\"':
            out.append("\\" + c)
        elif c == "\t":
            out.append("\\t")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _systemd_env_quote(assignment: str) -> str:
    """One `Environment=` word: systemd expands % specifiers there (doubled), but not $ (kept as it is)."""
    out = []
    for c in assignment.replace("%", "%%"):
        if c in '\\"':
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def systemd_units(name: str, command_argv: Sequence[str], on_calendar: str = DEFAULT_ON_CALENDAR, *,
                  nice: int = 10, randomized_delay: str = "15min", user: str | None = None,
                  working_directory: str | None = None, description: str | None = None,
                  environment: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The (service, timer) unit files' text for the job; nothing is written. `environment`: one
    `Environment=` line per variable (HOME, FLEETCUDA_STATE_DIR: what the installer saw)."""
    stem = unit_name(name)
    argv = _check_argv(command_argv, "systemd")
    calendar = check_on_calendar(on_calendar)
    if not -20 <= nice <= 19:
        raise ValueError(f"Nice {nice}: must be from -20 to 19")
    if not _TIMESPAN.fullmatch(randomized_delay):
        raise ValueError(f"RandomizedDelaySec {randomized_delay!r}: use a time span such as '15min' or '900'")
    if user is not None and not _USER.fullmatch(user):
        raise ValueError(f"User {user!r}: not a valid user name")
    if working_directory is not None and (not os.path.isabs(working_directory)
                                          or any(c in working_directory for c in "\n\r\0%$\\")):
        raise ValueError(f"WorkingDirectory {working_directory!r}: use a plain absolute path")
    about = " ".join((description or f"fleetcuda verify ({name})").split()).replace("%", "%%")
    service = [
        f"# Written by fleetcuda ({MARKER}:{name}); `fleetcuda schedule` replaces or removes it.",
        "[Unit]",
        f"Description={about}",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=oneshot",
        "ExecStart=" + " ".join(systemd_quote(a) for a in argv),
        "StandardInput=null",
        f"Nice={nice}",
        "IOSchedulingClass=idle",
        "UMask=0077",
    ]
    if user is not None:
        service.append(f"User={user}")
    if working_directory is not None:
        service.append(f"WorkingDirectory={working_directory}")
    for k, v in _check_environment(environment, "systemd").items():
        service.append("Environment=" + _systemd_env_quote(f"{k}={v}"))
    timer = [
        f"# Written by fleetcuda ({MARKER}:{name}); `fleetcuda schedule` replaces or removes it.",
        "[Unit]",
        f"Description=Timer for {about}",
        "",
        "[Timer]",
        f"OnCalendar={calendar}",
        "Persistent=true",
        f"RandomizedDelaySec={randomized_delay}",
        f"Unit={stem}.service",
        "",
        "[Install]",
        "WantedBy=timers.target",
    ]
    return "\n".join(service) + "\n", "\n".join(timer) + "\n"


@dataclass(frozen=True)
class SystemdInstall:
    service_path: Path
    timer_path: Path
    changed: bool  # False when both files already had exactly this content
    activate_command: str  # what to run (as root) to load and start the timer
    activated: bool  # whether install_systemd ran activate_command itself


Runner = Callable[[list[str]], object]


def _run_checked(argv: list[str]) -> object:
    try:
        return subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=120)
    except FileNotFoundError as exc:
        raise ScheduleError(f"{argv[0]} not found") from exc
    except subprocess.CalledProcessError as exc:
        raise ScheduleError(f"{shlex.join(argv)} failed (exit {exc.returncode}): {exc.stderr.strip()}") from exc


def _write_if_changed(path: Path, text: str) -> bool:
    from fleetcuda.reports.formats import write_atomically  # not at the top: show and remove draw nothing

    try:
        if path.read_text(encoding="utf-8") == text and (path.stat().st_mode & 0o777) == 0o644:
            return False
    except FileNotFoundError:
        pass
    write_atomically(path, text, mode=0o644)
    return True


def activate_commands(name: str, systemctl: Sequence[str] = ("systemctl",)) -> list[list[str]]:
    """The argvs that load the units and start the timer now and at every boot."""
    return [[*systemctl, "daemon-reload"], [*systemctl, "enable", "--now", f"{unit_name(name)}.timer"]]


def install_systemd(name: str, command_argv: Sequence[str], unit_dir: str | os.PathLike[str] = SYSTEM_UNIT_DIR, *,
                    on_calendar: str = DEFAULT_ON_CALENDAR, nice: int = 10, randomized_delay: str = "15min",
                    user: str | None = None, working_directory: str | None = None, description: str | None = None,
                    environment: Mapping[str, str] | None = None, activate: bool = False,
                    systemctl: Sequence[str] = ("systemctl",), runner: Runner = _run_checked) -> SystemdInstall:
    """Write the job's .service and .timer (0644) into unit_dir, replacing older versions of them.

    With activate=True, also runs `systemctl daemon-reload` and `systemctl enable --now <unit>.timer`
    through `runner` (pass systemctl=("systemctl", "--user") for a user unit directory).
    The other options are systemd_units'.
    """
    service_text, timer_text = systemd_units(name, command_argv, on_calendar, nice=nice,
                                             randomized_delay=randomized_delay, user=user,
                                             working_directory=working_directory, description=description,
                                             environment=environment)
    directory = _unit_dir(unit_dir)
    if not directory.is_dir():
        raise ScheduleError(f"unit directory {directory} does not exist")
    stem = unit_name(name)
    service_path, timer_path = directory / f"{stem}.service", directory / f"{stem}.timer"
    changed = _write_if_changed(service_path, service_text)
    changed = _write_if_changed(timer_path, timer_text) or changed
    commands = activate_commands(name, systemctl)
    if activate:
        for argv in commands:
            runner(argv)
    return SystemdInstall(service_path, timer_path, changed, " && ".join(shlex.join(c) for c in commands), activate)


def _unit_dir(unit_dir: str | os.PathLike[str]) -> Path:
    """unit_dir as a Path; ValueError (bad input) when something other than a directory is there."""
    directory = Path(unit_dir)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"unit directory {directory} is not a directory")
    return directory


def show_systemd(name: str, unit_dir: str | os.PathLike[str] = SYSTEM_UNIT_DIR) -> dict[Path, str]:
    """The job's unit files that exist in unit_dir, path -> text (empty when it is not installed)."""
    stem = unit_name(name)
    directory = _unit_dir(unit_dir)
    found: dict[Path, str] = {}
    for suffix in (".service", ".timer"):
        path = directory / f"{stem}{suffix}"
        if path.exists():
            found[path] = path.read_text(encoding="utf-8")
    return found


def remove_systemd(name: str, unit_dir: str | os.PathLike[str] = SYSTEM_UNIT_DIR, *, deactivate: bool = False,
                   systemctl: Sequence[str] = ("systemctl",), runner: Runner = _run_checked) -> list[Path]:
    """Delete the job's unit files from unit_dir; returns the paths removed.

    With deactivate=True, first runs `systemctl disable --now <unit>.timer`, and afterwards
    `systemctl daemon-reload`, through `runner`.
    """
    stem = unit_name(name)
    directory = _unit_dir(unit_dir)
    if deactivate:
        runner([*systemctl, "disable", "--now", f"{stem}.timer"])
    removed: list[Path] = []
    for suffix in (".timer", ".service"):
        path = directory / f"{stem}{suffix}"
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    if deactivate:
        runner([*systemctl, "daemon-reload"])
    return removed


def deactivate_command(name: str, systemctl: Sequence[str] = ("systemctl",)) -> str:
    """What to run before removing the unit files by hand: stop and disable the timer."""
    return shlex.join([*systemctl, "disable", "--now", f"{unit_name(name)}.timer"])
