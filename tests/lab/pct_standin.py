"""Stand-in for Proxmox's /usr/sbin/pct, for tests (stdlib only).

The fixture installs a copy with an absolute ``/usr/bin/python3`` shebang and
STATE_DIR filled in.  A container is ``STATE_DIR/<vmid>.conf`` holding a
``status: running|stopped`` line and optionally ``name: X``; any other ``key: value`` lines there are its
Proxmox options (``dev0: /dev/nvidia0``, ``lxc.cgroup2.devices.allow: c 195:* rwm``), which ``config`` prints
as pct does (options sorted, raw ``lxc.*`` keys last, ``name`` as ``hostname``).  Containers are
not isolated: ``exec`` runs the command on this machine.  Every invocation is
appended as one JSON line to ``STATE_DIR/calls.jsonl``.
"""

import fcntl
import json
import os
import socket
import sys
from pathlib import Path

STATE_DIR = "__STATE_DIR__"

USAGE = """\
USAGE: pct <COMMAND> [ARGS] [OPTIONS]

       pct list
       pct config <vmid>
       pct start <vmid>
       pct status <vmid>
       pct stop <vmid>
       pct exec <vmid> [<extra-args>] [OPTIONS]
"""

BOOLEANS = {"1": True, "yes": True, "true": True, "on": True,
            "0": False, "no": False, "false": False, "off": False}


class PctError(Exception):
    """A pct failure: the message goes to stderr and pct exits 255."""


def state() -> Path:
    return Path(STATE_DIR)


def record(entry: dict) -> None:
    # flock: concurrent pct calls (parallel fleet runs) must not interleave lines.
    with open(state() / "calls.jsonl", "a", encoding="utf-8") as log:
        fcntl.flock(log, fcntl.LOCK_EX)
        log.write(json.dumps(entry) + "\n")


def param_error(name: str, message: str) -> PctError:
    return PctError(f"400 Parameter verification failed.\n{name}: {message}")


def parse_vmid(args: list[str], command: str) -> int:
    if not args:
        raise PctError(f"400 not enough arguments\npct {command} <vmid>")
    raw = args[0]
    try:
        vmid = int(raw)
    except ValueError:
        raise param_error("vmid", f"type check ('integer') failed - got '{raw}'") from None
    if vmid < 100:
        raise param_error("vmid", "value must have a minimum value of 100")
    return vmid


def conf_lines(vmid: int) -> list[tuple[str, str]]:
    path = state() / f"{vmid}.conf"
    if not path.is_file():
        node = socket.gethostname().split(".")[0]
        raise PctError(f"Configuration file 'nodes/{node}/lxc/{vmid}.conf' does not exist")
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            lines.append((key.strip(), value.strip()))
    return lines


def read_conf(vmid: int) -> dict[str, str]:
    return {key: value for key, value in conf_lines(vmid) if not key.startswith("lxc.")}


def cmd_config(vmid: int) -> None:
    """pct.pm's config printer: options sorted (name is the hostname), then raw lxc.* keys in file order."""
    lines = conf_lines(vmid)
    options = {("hostname" if k == "name" else k): v for k, v in lines if not k.startswith("lxc.") and k != "status"}
    for key in sorted(options, key=lambda k: k.encode()):
        sys.stdout.write(f"{key}: {options[key]}\n")
    for key, value in lines:
        if key.startswith("lxc."):
            sys.stdout.write(f"{key}: {value}\n")


def set_status(vmid: int, status: str) -> None:
    lines = [(k, v) for k, v in conf_lines(vmid) if k != "status"]
    body = "".join(f"{key}: {value}\n" for key, value in [("status", status), *lines])
    (state() / f"{vmid}.conf").write_text(body, encoding="utf-8")


def cmd_list() -> None:
    rows = []
    for path in state().glob("*.conf"):
        if path.stem.isdigit():
            conf = read_conf(int(path.stem))
            rows.append((int(path.stem), conf.get("status", "stopped"),
                         conf.get("lock", ""), conf.get("name", f"ct{path.stem}")))
    if not rows:
        return
    line = "%-10s %-10s %-12s %-20s\n"
    sys.stdout.write(line % ("VMID", "Status", "Lock", "Name"))
    for row in sorted(rows):
        sys.stdout.write(line % row)


def split_exec_args(args: list[str]) -> tuple[bool, list[str]]:
    """Split ``[--keep-env X] [--] cmd...`` into (keep_env, command)."""
    keep_env = True  # PVE 8 default: keep the caller's environment
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            return keep_env, args[index + 1:]
        if arg == "--keep-env" or arg.startswith("--keep-env="):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif index + 1 < len(args):
                index += 1
                value = args[index]
            else:
                raise PctError("400 unable to parse option\nkeep-env: missing value")
            if value.lower() not in BOOLEANS:
                raise param_error("keep-env", f"type check ('boolean') failed - got '{value}'")
            keep_env = BOOLEANS[value.lower()]
        elif arg.startswith("-"):
            raise PctError(f"Unknown option: {arg.lstrip('-')}\n400 unable to parse option")
        else:
            return keep_env, args[index:]
        index += 1
    return keep_env, []


def refeed_stdin(data: bytes) -> None:
    """Make ``data`` the new stdin; a detached grandchild writes it into a pipe."""
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:
        # Double fork: the writer must not linger as a zombie of the exec'd command.
        if os.fork() == 0:
            os.close(read_fd)
            # Hold no session fds: ssh waits for EOF on them.
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            try:
                with os.fdopen(write_fd, "wb") as pipe:
                    pipe.write(data)
            except BrokenPipeError:
                pass  # the command exited without reading all of its stdin
        os._exit(0)
    os.waitpid(child, 0)
    os.close(write_fd)
    os.dup2(read_fd, 0)
    os.close(read_fd)


def prepare_exec(args: list[str], entry: dict) -> tuple[list[str], dict[str, str]]:
    """Validate ``exec`` and return (command, environment) for execvpe."""
    vmid = parse_vmid(args, "exec")
    keep_env, command = split_exec_args(args[1:])
    if read_conf(vmid).get("status") != "running":
        raise PctError(f"container '{vmid}' not running!")
    if not command:
        raise PctError("missing command")
    if (state() / "record-stdin").exists():
        data = sys.stdin.buffer.read()
        entry["stdin"] = data.decode("utf-8", errors="backslashreplace")
        refeed_stdin(data)
    env = dict(os.environ) if keep_env else {}
    env.pop("SSL_CERT_FILE", None)
    env.pop("SSL_CERT_DIR", None)
    return command, env


def main(argv: list[str]) -> int:
    entry = {"argv": argv, "uid": os.getuid(), "env": dict(os.environ)}
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    if command == "exec":
        try:
            exec_argv, env = prepare_exec(args, entry)
        finally:
            record(entry)  # after prepare_exec: the entry may carry stdin
        sys.stdout.flush()
        try:
            os.execvpe(exec_argv[0], exec_argv, env)
        except OSError as exc:
            raise PctError(f"lxc-attach: failed to exec '{exec_argv[0]}': {exc.strerror}") from None
    record(entry)
    if command == "list":
        cmd_list()
    elif command == "config":
        cmd_config(parse_vmid(args, command))
    elif command == "status":
        vmid = parse_vmid(args, command)
        print(f"status: {read_conf(vmid).get('status', 'stopped')}")
    elif command in ("start", "stop"):
        set_status(parse_vmid(args, command), "running" if command == "start" else "stopped")
    elif not command:
        raise PctError(f"ERROR: no command specified\n{USAGE}".rstrip("\n"))
    else:
        raise PctError(f"ERROR: unknown command 'pct {command}'\n{USAGE}".rstrip("\n"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except PctError as exc:
        sys.stdout.flush()
        print(exc, file=sys.stderr)
        sys.exit(255)
