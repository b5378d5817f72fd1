"""Files between this machine and a target: SFTP to or from the host over its one SSH connection (a plain
copy for a local host), then `pct push` / `pct pull` between the host and a container. Nothing needs the
internet, and the host keeps nothing: its staging directories are private (mktemp -d) and removed after use.

The engine passes its target's run.channel.TargetChannel as `transport`: so every copy and every helper command
here is logged to the target's log, redacted and cancelled by Ctrl-C like the run's own commands.
"""

from __future__ import annotations

import getpass
import shutil
import tempfile
from pathlib import Path

from fleetcuda.connectors.base import Transport
from fleetcuda.errors import FleetcudaError
from fleetcuda.plan.command import HopChain, Invocation, build, join
from fleetcuda.plan.inventory import Target
from fleetcuda.plan.planner import SYSTEM_PATH


def on_host(transport: Transport, target: Target, argv: list[str], what: str, timeout: float = 600) -> str:
    """A command on the target's host itself (not in its container): argv through the login shell, or local."""
    cmd = build(HopChain(ssh=target.chain.ssh), Invocation(join(argv), {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"}))
    res = transport.run(cmd, timeout=timeout, on_line=lambda line: None)
    if res.rc != 0:
        raise FleetcudaError(f"{what} failed (exit {res.rc}): {res.output.strip()[-500:]}")
    return res.output


def in_target(transport: Transport, target: Target, script: str, what: str, timeout: float = 600) -> str:
    """A short script inside the target (the container, or the host when the target is the host)."""
    cmd = build(target.chain, Invocation(script, {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"}, timeout=int(timeout),
                                         label="fleetcuda:transfer"))
    res = transport.run(cmd, timeout=timeout + 30, on_line=lambda line: None)
    if res.rc != 0:
        raise FleetcudaError(f"{target.id}: {what} failed (exit {res.rc}): {res.output.strip()[-300:]}")
    return res.output


def host_staging_dir(transport: Transport, target: Target) -> str:
    if not transport.local:
        return on_host(transport, target, ["mktemp", "-d", "/tmp/fleetcuda-push.XXXXXX"], "mktemp").strip()
    return tempfile.mkdtemp(prefix="fleetcuda-push.", dir="/tmp")


def remove_on_host(transport: Transport, target: Target, path: str) -> None:
    if not transport.local:
        on_host(transport, target, ["rm", "-rf", "--", path], "cleanup", timeout=60)
    else:
        shutil.rmtree(path, ignore_errors=True)


def to_host(transport: Transport, local: Path, host_path: str) -> None:
    transport.put(local, host_path)


def from_host(transport: Transport, host_path: str, local: Path) -> None:
    transport.get(host_path, local)


def _pct(target: Target, *args: str) -> list[str]:
    pct = target.chain.pct
    assert pct is not None
    return (["sudo", "-n", "--"] if pct.sudo else []) + [pct.pct, *args]


def into_container(transport: Transport, target: Target, host_path: str, ct_path: str, perms: str = "0644") -> None:
    assert target.container is not None
    on_host(transport, target, _pct(target, "push", str(target.container.vmid), host_path, ct_path, "--perms", perms),
            f"{target.id}: pct push {Path(ct_path).name}")


def out_of_container(transport: Transport, target: Target, ct_path: str, host_path: str) -> None:
    """pct pull, the host copy owned by the SSH user (pct runs as root) and private to it."""
    assert target.container is not None
    user = target.chain.ssh.user if target.chain.ssh else getpass.getuser()
    on_host(transport, target, _pct(target, "pull", str(target.container.vmid), ct_path, host_path, "--user", user,
                                    "--perms", "0600"), f"{target.id}: pct pull {Path(ct_path).name}")


def fetch(transport: Transport, target: Target, remote: str, local: Path) -> None:
    """A file of the target (inside its container, if it has one) to `local` on this machine."""
    if target.container is None:
        from_host(transport, remote, local)
        return
    staging = host_staging_dir(transport, target)
    try:
        out_of_container(transport, target, remote, f"{staging}/{Path(remote).name}")
        from_host(transport, f"{staging}/{Path(remote).name}", local)
    finally:
        remove_on_host(transport, target, staging)
