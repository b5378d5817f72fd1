"""One `fleetcuda apply` at a time per target: a lock directory on the target itself, so two control
machines cannot converge the same container at once.

The lock names its owner by more than a hostname: the machine's id, its boot id, the pid and that pid's
start time. A run refreshes the locks it holds (LOCK_REFRESH_S); a lock not refreshed for LOCK_STALE_S is
taken over (its run died without releasing it, or lost its targets), and so is one whose owner is a run
of this machine that no longer exists (same machine and boot, and that pid is gone or is another process).
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


def run_owner(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    machine = _read("/etc/machine-id")[:12] or "unknown"
    boot = _read("/proc/sys/kernel/random/boot_id")[:8] or "unknown"
    return (f"{getpass.getuser()}@{socket.gethostname()} pid {pid} since {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ} "
            f"machine {machine} boot {boot} start {_start_ticks(pid) or '?'}")


_OWNER = re.compile(r"\S+@\S+ pid (\d+) since \S+ machine (\S+) boot (\S+) start (\d+)\Z")


def owner_is_dead(owner: str) -> bool:
    """True only when the owner is a run of this machine, in this boot, whose process no longer exists."""
    m = _OWNER.match(owner)
    if not m:
        return False
    pid, machine, boot, start = int(m[1]), m[2], m[3], m[4]
    if machine != (_read("/etc/machine-id")[:12] or "unknown"):
        return False  # another machine's run: only its staleness can tell
    if boot != (_read("/proc/sys/kernel/random/boot_id")[:8] or "unknown"):
        return True  # this machine rebooted since: that run is gone
    return _start_ticks(pid) != start


@dataclass(frozen=True)
class TargetLock:
    owner: str  # see run_owner
    wait_s: int = 0

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
        """Remove a lock whose owner is known to be dead (a run on this machine that no longer exists)."""
        return self._call(vmid, "fleetcuda_lock_take_over", dead_owner)

    def _call(self, vmid: int | None, function: str, *args: str) -> str:
        """lock.sh's functions, then one call of them: what they say is in `lock` frames (see framing)."""
        return shell_text("lock") + " ".join([function, quote(self.name(vmid)), *map(quote, args)])


def lock_state(frames: list[framing.Frame]) -> tuple[str | None, list[str]]:
    """The last lock frame's word (held, released, busy, stale, refreshed, taken-over) and its fields."""
    found = [r for r in framing.records(frames) if isinstance(r, framing.LockRecord)]
    return (found[-1].state, list(found[-1].fields)) if found else (None, [])
