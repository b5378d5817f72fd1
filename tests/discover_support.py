"""Scripted replies for `fleetcuda discover` over the fake connector: what remote/discover_probe.sh prints, framed
with the call's own nonce (connectors.fake.framed), from pct's text and the environments a container holds."""

from __future__ import annotations

from collections.abc import Callable

from fleetcuda.connectors.base import RunResult
from fleetcuda.connectors.fake import Call, FakeTransport, framed, ok

ROW = "%-10s %-10s %-12s %-20s\n"  # pct.pm's printf
LIST_HEADER = ROW % ("VMID", "Status", "Lock", "Name")  # noqa: UP031


def pct_list(*rows: tuple[int, str, str, str]) -> str:
    """pct list's text as pct.pm prints it (nothing at all without containers)."""
    if not rows:
        return ""
    return LIST_HEADER + "".join(ROW % row for row in sorted(rows))


def _payload(text: str) -> str:
    return "".join(f"| {line}\n" for line in text.split("\n")[:-1 if text.endswith("\n") else None]) if text else ""


def host_reply(listing: str, configs: dict[int, str | tuple[int, str, str]], list_rc: int = 0,
               list_err: str = "", done: bool = True) -> Callable[[Call], RunResult]:
    """The host function's frames: pct list, then pct config of each listed vmid (text, or (rc, stdout, stderr))."""
    def reply(call: Call) -> RunResult:
        out = framed(call, "pve", "list", "-", str(list_rc)) + _payload(listing)
        out += framed(call, "pve-err", "list", "-") + _payload(list_err)
        if list_rc:
            return RunResult(0, out, 0.0)
        count = 0
        for line in listing.splitlines()[1:]:
            vmid = int(line.split()[0])
            conf = configs.get(vmid, (255, "", f"Configuration file 'nodes/pve/lxc/{vmid}.conf' does not exist\n"))
            rc, stdout, stderr = (0, conf, "") if isinstance(conf, str) else conf
            out += framed(call, "pve", "config", str(vmid), str(rc)) + _payload(stdout)
            out += framed(call, "pve-err", "config", str(vmid)) + _payload(stderr)
            count += 1
        if done:
            out += framed(call, "pve-done", str(count))
        return RunResult(0, out, 0.0)
    return reply


def envs_reply(*envs: tuple[str, ...], skipped: int = 0, done: bool = True,
               extra: str = "") -> Callable[[Call], RunResult]:
    """The container function's frames: one `pyenv` per env (kind, path, python, pyver, torch, cuda)."""
    def reply(call: Call) -> RunResult:
        out = extra + "".join(framed(call, "pyenv", *e) for e in envs)
        if done:
            out += framed(call, "pyenv-done", str(len(envs)), str(skipped), "0")
        return ok(out)
    return reply


def script(fake: FakeTransport, listing: str, configs: dict[int, str | tuple[int, str, str]],
           envs: dict[int, Callable[[Call], RunResult]] | None = None) -> FakeTransport:
    fake.on(label="fleetcuda-discover", reply=host_reply(listing, configs))
    for vmid, reply in (envs or {}).items():
        fake.on(label="fleetcuda-discover-probe", match=lambda c, v=vmid: c.place == v, reply=reply)
    return fake


VENV_TORCH = ("venv", "/root/venv", "/root/venv/bin/python", "3.11", "2.11.0+cu128", "12.8")
DEV_CONFIG = ("arch: amd64\ncores: 8\ndev0: /dev/nvidia0\ndev1: /dev/nvidiactl\ndev2: /dev/nvidia-uvm\n"
              "hostname: {name}\nmemory: 32768\nostype: debian\nrootfs: local-lvm:vm-{vmid}-disk-0,size=64G\n"
              "swap: 512\nunprivileged: 1\n")
OLD_CONFIG = ("arch: amd64\nhostname: {name}\nostype: debian\nunprivileged: 1\n"
              "lxc.cgroup2.devices.allow: c 195:* rwm\n"
              "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n")
PLAIN_CONFIG = "arch: amd64\nhostname: {name}\nostype: debian\n"
