"""One `fleetcuda apply` at a time per target: a lock directory on the target itself, so two control
machines cannot converge the same container at once.

The lock names its owner by more than a hostname: the machine's id, its boot id, the pid, that pid's start
time, the pid namespace the pid belongs to (its inode, and the start time of that namespace's init: two
containers of one host share machine and boot ids, and an inode may be reused once a namespace is gone) and
the run id. A run refreshes the locks it holds (LOCK_REFRESH_S); a lock not refreshed for LOCK_STALE_S is
taken over (its run died without releasing it, or lost its targets), and so is one whose owner is a run
of this machine's pid namespace, in this boot, whose process no longer exists. Either way only once no
process of the owner's run still runs on the target (lock.sh decides that there, from the run id): the
lock stands for the work on the target, not for the control process.
"""

from __future__ import annotations

import getpass
import os
import re
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from fleetcuda.plan.command import quote
from fleetcuda.remote import framing, shell_text

LOCK_REFRESH_S = 60
LOCK_STALE_S = 15 * 60  # 15 missed refreshes


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "unknown"


def _start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid, a
    process identity that survives pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def pid_namespace() -> str:
    """Which pid namespace this process's pids belong to: `<inode of /proc/self/ns/pid>.<start time of its
    init>`, or `?` where that cannot be known (no /proc, or a /proc of another pid namespace than ours, whose
    pids are not the ones os.getpid gives)."""
    try:
        if int(os.readlink("/proc/self")) != os.getpid():
            return "?"
        inode = os.stat("/proc/self/ns/pid").st_ino
    except (OSError, ValueError):
        return "?"
    init = _start_ticks(1)
    return f"{inode}.{init}" if init else "?"


def run_owner(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    machine = _read("/etc/machine-id")[:12] or "unknown"
    boot = _read("/proc/sys/kernel/random/boot_id")[:8] or "unknown"
    return (f"{getpass.getuser()}@{socket.gethostname()} pid {pid} since {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ} "
            f"machine {machine} boot {boot} start {_start_ticks(pid) or '?'} pidns {pid_namespace()}")


_OWNER = re.compile(r"\S+@\S+ pid (\d+) since \S+ machine (\S+) boot (\S+) start (\d+) pidns (\d+\.\d+)"
                    r"(?: run [A-Za-z0-9._-]+)?\Z")


def owner_is_dead(owner: str) -> bool:
    """True only where that can be known: the owner is a run of this machine, in this boot, in this pid
    namespace, whose process no longer exists. Any other owner (another machine, another container of this
    host, a control machine rebooted since, whose machine id may be a copy of an image's) is dead only once its
    lock is stale. (lock.sh still keeps the lock while processes of the owner's run run on the target.)"""
    m = _OWNER.match(owner)
    if not m:
        return False
    pid, machine, boot, start, pidns = int(m[1]), m[2], m[3], m[4], m[5]
    if machine != (_read("/etc/machine-id")[:12] or "unknown") or machine == "unknown":
        return False  # another machine's run: only its staleness can tell
    if boot != (_read("/proc/sys/kernel/random/boot_id")[:8] or "unknown"):
        return False  # rebooted since, or another machine with a copy of this id: only staleness can tell
    if pidns != pid_namespace():
        return False  # another pid namespace (a container of this host): its pids are not ours to look up
    return _start_ticks(pid) != start


@dataclass(frozen=True)
class TargetLock:
    owner_base: str  # see run_owner
    wait_s: int = 0
    run_id: str = ""  # the run whose labelled processes the lock stands for (the engine sets it)

    @property
    def owner(self) -> str:
        """What the lock's owner file holds: run_owner's words, then ` run <run id>` (read by lock.sh)."""
        return f"{self.owner_base} run {self.run_id}" if self.run_id else self.owner_base

    @staticmethod
    def name(vmid: int | None) -> str:
        # Named after the vmid, which is what identifies the container whatever the inventory calls it.
        return f"fleetcuda-apply-{vmid}" if vmid is not None else "fleetcuda-apply"

    def acquire(self, vmid: int | None) -> str:
        return self._call(vmid, "fleetcuda_lock_acquire", self.owner, str(int(self.wait_s)), str(LOCK_STALE_S))

    def release(self, vmid: int | None) -> str:
        return self._call(vmid, "fleetcuda_lock_release", self.owner)

    def refresh(self, vmid: int | None) -> str:
        """Touch the lock this run holds, so that no other run takes it over as stale."""
        return self._call(vmid, "fleetcuda_lock_refresh", self.owner)

    def take_over(self, vmid: int | None, dead_owner: str) -> str:
        """Remove a lock whose owner is known to be dead (a run of this machine's pid namespace that no longer
        exists), unless processes of its run still run on the target."""
        return self._call(vmid, "fleetcuda_lock_take_over", dead_owner)

    def _call(self, vmid: int | None, function: str, *args: str) -> str:
        """lock.sh's functions, then one call of them: what they say is in `lock` frames (see framing)."""
        return shell_text("lock") + " ".join([function, quote(self.name(vmid)), *map(quote, args)])


def lock_state(frames: list[framing.Frame]) -> tuple[str | None, list[str]]:
    """The last lock frame's word (held, released, busy, stale, refreshed, taken-over, working, kept) and its
    fields."""
    found = [r for r in framing.records(frames) if isinstance(r, framing.LockRecord)]
    return (found[-1].state, list(found[-1].fields)) if found else (None, [])
