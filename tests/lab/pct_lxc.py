#!/usr/bin/python3
"""Stand-in for Proxmox's /usr/sbin/pct on the fleetcuda lab hosts, over real LXC containers.

NOT Proxmox: it implements the verbs fleetcuda relies on (exec, push, pull, status, list, start,
stop) with Proxmox's messages and exit codes (see shared reference pct.md). The lab host it serves
is the network namespace it runs in: each lab host is a namespace with its own sshd, and sudo or
an SSH session cannot change that, while environment variables would not survive sudo.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

LAB = Path(os.environ.get("FLEETCUDA_LAB_ROOT", "/var/lib/fleetcuda-lab"))
VMID_MIN, VMID_MAX = 100, 999_999_999


def fail(*lines: str, code: int = 255) -> None:
    for line in lines:
        print(line, file=sys.stderr)
    sys.exit(code)


def lab_host() -> str:
    """Which lab host are we on? The one whose network namespace we are in."""
    mine = os.stat("/proc/self/ns/net").st_ino
    for host_dir in sorted((LAB / "hosts").glob("*")):
        ns = Path("/run/netns") / f"fclab-{host_dir.name}"
        try:
            if os.stat(ns).st_ino == mine:
                return host_dir.name
        except FileNotFoundError:
            continue
    fail("pct (fleetcuda lab stand-in): not running inside a lab host's network namespace")
    raise AssertionError


def parse_vmid(raw: str | None) -> int:
    if raw is None:
        fail("400 not enough arguments", "pct <command> <vmid> ...")
    try:
        vmid = int(raw, 10)
    except ValueError:
        fail("400 Parameter verification failed.", f"vmid: type check ('integer') failed - got '{raw}'")
    if not VMID_MIN <= vmid <= VMID_MAX:
        fail("400 Parameter verification failed.", f"vmid: value must have a minimum value of {VMID_MIN}"
             if vmid < VMID_MIN else f"vmid: value must have a maximum value of {VMID_MAX}")
    return vmid


class Node:
    def __init__(self, name: str):
        self.name = name
        self.lxcpath = LAB / "hosts" / name / "lxc"

    def exists(self, vmid: int) -> bool:
        return (self.lxcpath / str(vmid) / "config").is_file()

    def require(self, vmid: int) -> None:
        if not self.exists(vmid):
            fail(f"Configuration file 'nodes/{self.name}/lxc/{vmid}.conf' does not exist")

    def state(self, vmid: int) -> str:
        out = subprocess.run(["lxc-info", "-P", str(self.lxcpath), "-n", str(vmid), "-s", "-H"],
                             capture_output=True, text=True)
        return "running" if out.stdout.strip() == "RUNNING" else "stopped"

    def vmids(self) -> list[int]:
        found = []
        for d in self.lxcpath.glob("*"):
            if d.name.isdigit() and (d / "config").is_file():
                found.append(int(d.name))
        return sorted(found)

    def attach(self, vmid: int, argv: list[str], keep_env: bool, **kwargs: object) -> list[str]:
        return ["lxc-attach", "-P", str(self.lxcpath), "-n", str(vmid),
                "--keep-env" if keep_env else "--clear-env", "--", *argv]


def cmd_exec(node: Node, args: list[str]) -> None:
    vmid = parse_vmid(args[0] if args else None)
    rest = args[1:]
    keep_env = True  # PVE 8's default; the option exists since early 2024
    while rest and rest[0] != "--":
        opt = rest.pop(0)
        if opt.startswith("--keep-env"):
            value = opt.split("=", 1)[1] if "=" in opt else (rest.pop(0) if rest else "")
            if value not in ("0", "1"):
                fail("400 Parameter verification failed.", f"keep-env: type check ('boolean') failed - got '{value}'")
            keep_env = value == "1"
        else:
            fail("400 unable to parse option", f"Unknown option: {opt}")
    command = rest[1:] if rest else []
    node.require(vmid)
    if node.state(vmid) != "running":
        fail(f"container '{vmid}' not running!")
    if not command:
        fail("missing command")
    for var in ("SSL_CERT_FILE", "SSL_CERT_DIR"):
        os.environ.pop(var, None)
    argv = node.attach(vmid, command, keep_env)
    os.execvp(argv[0], argv)


def _perms(args: list[str]) -> tuple[list[str], dict[str, str]]:
    positional, opts = [], {}
    it = iter(args)
    for a in it:
        if a.startswith("--"):
            key, _, value = a[2:].partition("=")
            opts[key] = value or next(it, "")
        else:
            positional.append(a)
    return positional, opts


def cmd_push(node: Node, args: list[str]) -> None:
    positional, opts = _perms(args)
    if len(positional) != 3:
        fail("400 not enough arguments", "pct push <vmid> <file> <destination> [OPTIONS]")
    vmid = parse_vmid(positional[0])
    node.require(vmid)
    if node.state(vmid) != "running":
        fail("can only push files to a running CT")
    src, dest = positional[1], positional[2]
    perms = opts.get("perms")
    mode = None
    if perms:
        mode = int(perms, 16) if perms.startswith("0x") else int(perms, 8)
    script = 'umask 077; cat > "$1"' + (f' && chmod {mode:o} "$1"' if mode is not None else "")
    for key in ("user", "group"):
        if opts.get(key):
            script += f' && chown {opts[key]} "$1"' if key == "user" else f' && chgrp {opts[key]} "$1"'
    try:
        with open(src, "rb") as fh:
            rc = subprocess.run(node.attach(vmid, ["/bin/sh", "-c", script, "sh", dest], False), stdin=fh).returncode
    except FileNotFoundError:
        fail(f"unable to open file '{src}' - No such file or directory")
    sys.exit(rc)


def cmd_pull(node: Node, args: list[str]) -> None:
    positional, opts = _perms(args)
    if len(positional) != 3:
        fail("400 not enough arguments", "pct pull <vmid> <path> <destination> [OPTIONS]")
    vmid = parse_vmid(positional[0])
    node.require(vmid)
    if node.state(vmid) != "running":
        fail("can only pull files from a running VM")
    with open(positional[2], "wb") as out:
        rc = subprocess.run(node.attach(vmid, ["/bin/cat", "--", positional[1]], False), stdout=out).returncode
    # Like Proxmox: --perms (octal unless 0x), --user and --group apply to the file written on the host.
    if rc == 0 and opts.get("perms"):
        perms = opts["perms"]
        os.chmod(positional[2], int(perms, 16) if perms.startswith("0x") else int(perms, 8))
    if rc == 0 and (opts.get("user") or opts.get("group")):
        shutil.chown(positional[2], user=opts.get("user") or None, group=opts.get("group") or None)
    sys.exit(rc)


def cmd_status(node: Node, args: list[str]) -> None:
    vmid = parse_vmid(args[0] if args else None)
    node.require(vmid)
    print(f"status: {node.state(vmid)}")


def cmd_list(node: Node, args: list[str]) -> None:
    vmids = node.vmids()
    if not vmids:
        return
    row = "{:<10} {:<10} {:<12} {:<20}"  # pct's printf "%-10s %-10s %-12s %-20s\n"
    print(row.format("VMID", "Status", "Lock", "Name"))
    for vmid in vmids:
        print(row.format(vmid, node.state(vmid), "", f"ct{vmid}"))


def cmd_start(node: Node, args: list[str]) -> None:
    vmid = parse_vmid(args[0] if args else None)
    node.require(vmid)
    if node.state(vmid) == "running":
        fail(f"CT {vmid} already running")
    sys.exit(subprocess.run(["lxc-start", "-P", str(node.lxcpath), "-n", str(vmid)]).returncode)


def cmd_stop(node: Node, args: list[str]) -> None:
    vmid = parse_vmid(args[0] if args else None)
    node.require(vmid)
    if node.state(vmid) != "running":
        fail(f"CT {vmid} not running")
    sys.exit(subprocess.run(["lxc-stop", "-P", str(node.lxcpath), "-n", str(vmid), "-k"]).returncode)


VERBS = {"exec": cmd_exec, "push": cmd_push, "pull": cmd_pull, "status": cmd_status, "list": cmd_list,
         "start": cmd_start, "stop": cmd_stop}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in VERBS:
        fail("ERROR: unknown command 'pct " + " ".join(sys.argv[1:2]) + "'",
             "USAGE: pct <COMMAND> [ARGS] [OPTIONS]  (fleetcuda lab stand-in: " + ", ".join(VERBS) + ")")
    if os.geteuid() != 0:
        fail("only root can run pct (use sudo)")
    VERBS[sys.argv[1]](Node(lab_host()), sys.argv[2:])


if __name__ == "__main__":
    main()
