"""Command line: `fleetcuda apply`, `verify`, `doctor`, `discover`, `history`, `cache`, `prune`, `schedule`,
`trust`, `wheelhouse`, `export`.

Exit codes: 0 success; 1 a target failed (or drifted, for verify); 2 bad input (inventory,
recipe, arguments); 3 a target unreachable (and none failed); 130 interrupted.

One module per command, each with `add_parser(sub, env)` and `run(args, env) -> ExitStatus`; `main()` builds
the parser from them and is the one place exceptions become exit statuses. Start-up stays light: a module
imports what loads, connects or draws inside the function that needs it, so `--help` and `history` never
load pydantic, yaml or paramiko, and a dry-run never loads paramiko.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import IO

from fleetcuda import __version__
from fleetcuda.cli import (
    apply,
    cache,
    discover,
    doctor,
    export,
    history,
    prune,
    schedule,
    trust,
    verify,
    wheelhouse,
)
from fleetcuda.cli.environment import Environment
from fleetcuda.errors import FleetcudaError, HostKeyError, InputError, UnreachableError
from fleetcuda.redact import KNOWN, printable, redact_known
from fleetcuda.results import ExitStatus

__all__ = ["Environment", "main"]

# In the order `fleetcuda --help` lists them.
COMMANDS = {"apply": apply, "verify": verify, "history": history, "schedule": schedule, "wheelhouse": wheelhouse,
            "cache": cache, "prune": prune, "doctor": doctor, "discover": discover, "trust": trust, "export": export}


class _Parser(argparse.ArgumentParser):
    """argparse writing to the environment's streams; a usage error is exit 2. Subclassed per environment
    (`_parser_class`), so that every subparser, made as type(parent), writes to the same streams."""

    env: Environment
    argv_words: tuple[str, ...] = ()  # the command line, whose NAME=VALUE values an error never quotes

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        if not message:
            return
        # argparse names sys.stdout (help, --version) or sys.stderr/None (errors): this environment's instead.
        if file is sys.stdout:
            stream = self.env.stdout
        elif file is None or file is sys.stderr:
            stream = self.env.stderr
        else:
            stream = file
        try:
            stream.write(message)
        except (AttributeError, OSError):
            pass

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(self.env.stderr)
        # An argument's value is quoted here (`invalid int value: '...'`, `unrecognized arguments: ...`): never a
        # URL's password nor a control code, and of a NAME=VALUE word (`--varr db_password=...`, `--token=...`)
        # never the value: nothing has said yet which values are secrets.
        for word in sorted(self.argv_words, key=len, reverse=True):
            name, sep, value = word.partition("=")
            if sep and value:
                message = message.replace(word, name + "=***")
        print(f"fleetcuda: error: {printable(redact_known(message))}", file=self.env.stderr)
        sys.exit(ExitStatus.INPUT)


def _parser_class(env: Environment, argv: list[str] | None = None) -> type[_Parser]:
    return type("_Parser", (_Parser,), {"env": env, "argv_words": tuple(argv or ())})


def build_parser(env: Environment, argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser_class = _parser_class(env, argv)
    p = parser_class(prog="fleetcuda", description="Provision and verify CUDA build toolchains in Proxmox LXC "
                                                   "containers over SSH.")
    p.add_argument("--version", action="version", version=f"fleetcuda {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=parser_class)
    for command in COMMANDS.values():
        command.add_parser(sub, env)
    return p


def main(argv: list[str] | None = None, env: Environment | None = None) -> int:
    """The one error boundary: every exception of every command becomes an exit status here."""
    env = (env if env is not None else Environment.from_process()).guarded()

    def say(text: str) -> None:  # a file name, a value or a target's words: never terminal control sequences
        env.say(printable(redact_known(text)))  # nor a secret the planner met, nor a URL's password

    KNOWN.forget()  # the secrets of this command only (tests run many in one process)
    try:
        return int(_main(argv, env))
    except InputError as exc:  # bad inventory, recipe or argument, from any command: exit 2
        say(f"fleetcuda: {exc}")
        return ExitStatus.INPUT
    except (UnreachableError, HostKeyError) as exc:
        say(f"fleetcuda: {exc}")
        return ExitStatus.UNREACHABLE
    except FleetcudaError as exc:
        say(f"fleetcuda: {exc}")
        return ExitStatus.FAILED
    except BrokenPipeError:  # `fleetcuda ... --dry-run | head`: the reader left; not an error of ours
        _silence(env.stdout)
        return ExitStatus.OK
    except KeyboardInterrupt:
        env.say("fleetcuda: interrupted")
        return ExitStatus.INTERRUPTED
    except SystemExit:
        raise
    except Exception as exc:
        if env.environ.get("FLEETCUDA_DEBUG"):
            import traceback  # only for a bug's traceback: not a cost of every start

            traceback.print_exc(file=env.stderr)
        say(f"fleetcuda: internal error (a bug; FLEETCUDA_DEBUG=1 shows where): {type(exc).__name__}: {exc}")
        return ExitStatus.INTERNAL


def _silence(stream: IO[str]) -> None:
    """Point a closed pipe's descriptor at /dev/null, so that flushing it at exit cannot fail again."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's StringIO): nothing to flush at exit
        return
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)


def _main(argv: list[str] | None, env: Environment) -> ExitStatus:
    args = build_parser(env, argv if argv is not None else sys.argv[1:]).parse_args(argv)
    if getattr(args, "limit", None) is not None and not args.limit.strip(" ,\t"):
        # `--limit "$HOSTS"` with HOSTS unset must not mean every target.
        raise InputError("--limit", None, repr(args.limit), "is empty: name hosts, groups, containers or globs")
    if "inventory" in vars(args) and not getattr(args, "inventory_later", False):
        # -i, else $FLEETCUDA_INVENTORY, else the one default path: never an example (schedule: install only).
        from fleetcuda.state import inventory_path

        args.inventory = inventory_path(args.inventory, env.environ, env.home)
    return COMMANDS[args.command].run(args, env)


if __name__ == "__main__":
    sys.exit(main())
