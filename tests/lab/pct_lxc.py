#!/usr/bin/python3
"""Stand-in for Proxmox's /usr/sbin/pct on the fleetcuda lab hosts, over real LXC containers.

NOT Proxmox: it implements the verbs fleetcuda relies on (exec, push, pull, status, list, config, start,
stop) with Proxmox's messages and exit codes (see shared reference pct.md). The lab host it serves
is the network namespace it runs in: each lab host is a namespace with its own sshd, and sudo or
an SSH session cannot change that, while environment variables would not survive sudo.

`list` and `config` read each container's Proxmox-style config, LAB/hosts/<host>/pve/<vmid>.conf (what
/etc/pve/lxc/<vmid>.conf is on Proxmox; labctl `up` writes it), and print it as pve-container's
src/PVE/CLI/pct.pm does (parsed as src/PVE/LXC/Config.pm's parse_pct_config parses it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.parse
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
    def __init__(self, name: str, lab: Path | None = None):
        self.name = name
        self.lxcpath = (lab or LAB) / "hosts" / name / "lxc"
        self.pvepath = (lab or LAB) / "hosts" / name / "pve"

    def exists(self, vmid: int) -> bool:
        return (self.lxcpath / str(vmid) / "config").is_file()

    def require(self, vmid: int) -> None:
        if not self.exists(vmid):
            fail(f"Configuration file 'nodes/{self.name}/lxc/{vmid}.conf' does not exist")

    def state(self, vmid: int) -> str:
        out = subprocess.run(["lxc-info", "-P", str(self.lxcpath), "-n", str(vmid), "-s", "-H"],
                             capture_output=True, text=True)
        return "running" if out.stdout.strip() == "RUNNING" else "stopped"

    def pve_conf(self, vmid: int) -> PveFile | None:
        """The container's Proxmox config (LAB/hosts/<host>/pve/<vmid>.conf), parsed; None when missing."""
        try:
            raw = (self.pvepath / f"{vmid}.conf").read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return None
        return parse_pve_conf(vmid, raw)

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
    rows = []
    for vmid in node.vmids():
        conf = node.pve_conf(vmid)
        rows.append((vmid, node.state(vmid), conf.current if conf else None))
    sys.stdout.write(render_list(rows))


def render_list(rows: list[tuple[int, str, PveConf | None]]) -> str:
    """pct list: nothing without containers; else pct.pm's printf rows, by vmid. The name is the config's
    hostname or CT<vmid>, its whitespace removed (PVE::LXC::vmstatus)."""
    if not rows:
        return ""
    row = "%-10s %-10s %-12s %-20s\n"  # pct.pm's format
    out = row % ("VMID", "Status", "Lock", "Name")
    for vmid, status, conf in sorted(rows, key=lambda r: r[0]):
        options = conf.options if conf else {}
        name = re.sub(r"\s", "", options.get("hostname") or f"CT{vmid}")
        out += row % (vmid, status, options.get("lock") or "", name)
    return out


# -- Proxmox's container config (/etc/pve/lxc/<vmid>.conf), as pve-container parses and prints it --------

# Option types of PVE::LXC::Config's confdesc that parse_pct_config normalises (check_type); any other key of
# this set is a string. A key outside them all is "unknown setting" (a warning; the value is kept).
BOOLEAN_KEYS = {"onboot", "template", "console", "protection", "unprivileged", "debug"}
INTEGER_KEYS = {"cores", "memory", "swap", "tty", "cpuunits"}
STRING_KEYS = {"arch", "cmode", "cpulimit", "description", "entrypoint", "env", "features", "hookscript",
               "hostname", "lock", "nameserver", "ostype", "parent", "rootfs", "searchdomain", "snaptime",
               "startup", "tags", "timezone"}
_INDEXED = re.compile(r"(?:net|mp|unused|dev)\d+\Z")
_VALID_LXC = re.compile(r"lxc\.(?:cgroup2?\.|prlimit\.|net\.|mount\.|apparmor\.|idmap|include|arch|uts\.name"
                        r"|signal\.|init\.|rootfs\.|environment|hook\.|start\.|autodev|tty|console|cap\.|seccomp"
                        r"|selinux|sysctl|log\.|pty|ephemeral|namespace|keyring|monitor|proc\.|hook)")


class PveConf:
    """One section of a parsed config: options, and the raw lxc.* keys in file order."""

    def __init__(self) -> None:
        self.options: dict[str, str] = {}
        self.lxc: list[tuple[str, str]] = []


class PveFile:
    def __init__(self) -> None:
        self.current = PveConf()
        self.pending = PveConf()
        self.snapshots: dict[str, PveConf] = {}
        self.warnings: list[str] = []


def _check_type(key: str, value: str) -> str:
    """PVE::LXC::Config::check_type: the value as stored, or the reason it is refused."""
    if key in BOOLEAN_KEYS:
        if value == "1" or value.lower() in ("on", "yes", "true"):
            return "1"
        if value == "0" or value.lower() in ("off", "no", "false"):
            return "0"
        raise ValueError(f"type check ('boolean') failed - got '{value}'")
    if key in INTEGER_KEYS:
        if re.fullmatch(r"\d+", value, re.ASCII):
            return str(int(value))
        raise ValueError(f"type check ('integer') failed - got '{value}'")
    if key in STRING_KEYS or _INDEXED.match(key):
        return value
    raise ValueError(f"unknown setting '{key}'")


def parse_pve_conf(vmid: int, raw: str) -> PveFile:
    """parse_pct_config, not strict (as when pct reads a config): what it cannot parse is a warning."""
    res = PveFile()
    conf, descr, section = res.current, "", ""
    for line in raw.split("\n"):
        if not line.strip():
            continue
        if re.fullmatch(r"\[pve:pending\]\s*", line, re.I):
            if descr:
                conf.options["description"] = descr
            descr, section, conf = "", "pending", res.pending
            continue
        m = re.fullmatch(r"\[([a-z][a-z0-9_\-]+)\]\s*", line, re.I)
        if m:
            if descr:
                conf.options["description"] = descr
            descr, section = "", m[1]
            conf = res.snapshots.setdefault(m[1], PveConf())
            continue
        if line.startswith("#"):
            descr += urllib.parse.unquote(line[1:]) + "\n"
            continue
        m = re.match(r"(lxc\.[a-z0-9_\-.]+)(:|\s*=)\s*(.*?)\s*\Z", line)
        if m:
            key, value = m[1], m[3]
            if key == "lxc.environment.runtime":
                old = conf.options.get("env")
                conf.options["env"] = value if old is None else f"{old}\0{value}"
            elif _VALID_LXC.match(key):
                conf.lxc.append((key, value))
            else:
                res.warnings.append(f"vm {vmid} - unable to parse config: {line}")
            continue
        m = re.fullmatch(r"(description):\s*(.*\S)\s*", line)
        if m:
            descr += urllib.parse.unquote(m[2])
            continue
        m = re.fullmatch(r"snapstate:\s*(prepare|delete)\s*", line)
        if m:
            continue
        m = re.fullmatch(r"delete:\s*(.*\S)\s*", line)
        if m:
            if section == "pending":
                conf.options["delete"] = m[1]
            else:
                res.warnings.append(f"vm {vmid} - property 'delete' is only allowed in [pve:pending]")
            continue
        m = re.fullmatch(r"([a-z][a-z_]*\d*):\s*(.+?)\s*", line)
        if m:
            key, value = m[1], m[2]
            try:
                value = _check_type(key, value)
            except ValueError as exc:
                res.warnings.append(f"vm {vmid} - unable to parse value of '{key}' - {exc}")
            conf.options[key] = value
            continue
        res.warnings.append(f"vm {vmid} - unable to parse config: {line}")
    if descr:
        conf.options["description"] = descr
    return res


def encode_text(text: str) -> str:
    """PVE::Tools::encode_text: every control and non-ASCII byte, ':' and '%' URI-escaped."""
    safe = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) not in ":%")
    return urllib.parse.quote(text.encode("utf-8"), safe=safe)


def render_config(conf: PveFile, current: bool = False, snapshot: str | None = None) -> str:
    """pct config: load_current_config (pending changes taken in unless --current), then pct.pm's printer."""
    if snapshot is not None:
        if snapshot not in conf.snapshots:
            raise LookupError(f"snapshot '{snapshot}' does not exist")
        section = conf.snapshots[snapshot]
        options, lxc = dict(section.options), list(section.lxc)
    else:
        options, lxc = dict(conf.current.options), list(conf.current.lxc)
        if not current:
            options.update({k: v for k, v in conf.pending.options.items() if k != "delete"})
            for opt in re.split(r"[\s,;]+", conf.pending.options.get("delete", "").strip()):
                opt = opt.removeprefix("!")
                if opt and options.get(opt):
                    del options[opt]
    out = ""
    for key in sorted(options, key=lambda k: k.encode()):  # Perl's sort: by bytes
        value = encode_text(options[key]) if key == "description" else options[key]
        out += f"{key}: {value}\n"
    for key, value in lxc:
        out += f"{key}: {value}\n"
    return out


def cmd_config(node: Node, args: list[str]) -> None:
    vmid = parse_vmid(args[0] if args else None)
    positional, opts = _perms(args[1:])
    if positional:
        fail("400 too many arguments", "pct config <vmid> [OPTIONS]")
    for key in opts:
        if key not in ("current", "snapshot"):
            fail(f"Unknown option: {key}", "400 unable to parse option")
    current = opts.get("current", "0") or "1"  # a bare --current means 1
    if current.lower() not in ("0", "1", "yes", "no", "on", "off", "true", "false"):
        fail("400 Parameter verification failed.", f"current: type check ('boolean') failed - got '{current}'")
    snapshot = opts.get("snapshot")
    if snapshot is not None and current.lower() in ("1", "yes", "on", "true"):
        fail("400 Parameter verification failed.", "current: cannot use 'snapshot' parameter with 'current'",
             "snapshot: cannot use 'snapshot' parameter with 'current'")
    conf = node.pve_conf(vmid)
    if conf is None:
        fail(f"Configuration file 'nodes/{node.name}/lxc/{vmid}.conf' does not exist")
    assert conf is not None
    for warning in conf.warnings:
        print(warning, file=sys.stderr)
    try:
        sys.stdout.write(render_config(conf, current.lower() in ("1", "yes", "on", "true"), snapshot))
    except LookupError as exc:
        fail(str(exc))


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
         "config": cmd_config, "start": cmd_start, "stop": cmd_stop}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in VERBS:
        fail("ERROR: unknown command 'pct " + " ".join(sys.argv[1:2]) + "'",
             "USAGE: pct <COMMAND> [ARGS] [OPTIONS]  (fleetcuda lab stand-in: " + ", ".join(VERBS) + ")")
    if os.geteuid() != 0:
        fail("only root can run pct (use sudo)")
    VERBS[sys.argv[1]](Node(lab_host()), sys.argv[2:])


if __name__ == "__main__":
    main()
