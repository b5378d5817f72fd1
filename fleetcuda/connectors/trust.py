"""`fleetcuda trust HOST`: show the SSH host key a host presents and record it in that host's known_hosts.

Never silently: a key is recorded after the user confirms it on a terminal, or non-interactively only
when it has the `--fingerprint` given (`--yes` alone is refused). The key is fetched the way the
transport reaches the host, through its jump hosts, whose own keys must already be trusted. A key
that the known_hosts file marks @revoked is never recorded.
"""

from __future__ import annotations

import sys
from typing import TextIO

import paramiko

from fleetcuda.connectors.ssh import fetch_host_key, fingerprint, hop_host_keys, known_hosts_name, record_host_key
from fleetcuda.errors import FleetcudaError, InputError
from fleetcuda.plan.inventory import load_inventory

EXIT_OK, EXIT_FAILED, EXIT_INPUT, EXIT_UNREACHABLE = 0, 1, 2, 3


def trust(inventory_path: str, host: str, *, expected: str | None, yes: bool,
          stdin: TextIO | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    err = err or sys.stderr
    inventory = load_inventory(inventory_path)
    if host not in inventory.spec.hosts or inventory.spec.hosts[host].kind != "ssh":
        raise InputError(inventory_path, None, "hosts", f"{host!r} is not an ssh host of this inventory")
    if yes and not expected:
        print("fleetcuda: --yes records a key without asking only when you give its fingerprint: pass "
              "--fingerprint SHA256:... (compare it with `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` "
              "run on the host); nothing recorded", file=err)
        return EXIT_INPUT
    hop = next((t.chain.ssh for t in inventory.targets if t.host == host and t.chain.ssh is not None), None)
    if hop is None:
        raise InputError(inventory_path, None, "hosts", f"{host!r} has no ssh connection settings")
    name = known_hosts_name(hop.address, hop.port)
    via = ""
    j = hop.jump
    while j is not None:
        via += f" via {known_hosts_name(j.address, j.port)}"
        j = j.jump
    try:
        key = fetch_host_key(hop)
    except FleetcudaError as exc:  # a jump host's key unknown, changed or revoked; a jump host unreachable
        print(f"fleetcuda: {name}{via}: {exc}", file=err)
        return EXIT_UNREACHABLE
    except (OSError, EOFError, paramiko.SSHException) as exc:
        print(f"fleetcuda: {name}{via}: cannot connect: {exc or type(exc).__name__}", file=err)
        return EXIT_UNREACHABLE
    shown = f"{key.get_name()} {fingerprint(key)}"
    known = hop_host_keys(hop)
    if known.is_revoked(key):
        print(f"fleetcuda: {name} presents {shown}: {known.revoked_error(key)}; nothing recorded", file=err)
        return EXIT_UNREACHABLE
    if known.is_trusted(key):
        print(f"{name} is already trusted: {shown}", file=out)
        return EXIT_OK
    if known.trusted:
        held = ", ".join(f"{k.get_name()} {fingerprint(k)}" for k in known.trusted)
        print(f"fleetcuda: {name} presents {shown}, but {known.path} holds {held}: refusing; remove the old "
              "line by hand if the host was really reinstalled", file=err)
        return EXIT_UNREACHABLE
    print(f"{name}{via} presents {shown}", file=out)
    if expected:
        if expected != fingerprint(key):
            print(f"fleetcuda: fingerprint mismatch: expected {expected}; nothing recorded", file=err)
            return EXIT_UNREACHABLE
    else:
        if not stdin.isatty():
            print("fleetcuda: not recording without a terminal to confirm; pass --fingerprint SHA256:...", file=err)
            return EXIT_INPUT
        print(f"Record this key for {name}? Compare it with the host's own `ssh-keygen -lf` first. [y/N] ",
              end="", file=out, flush=True)
        if stdin.readline().strip().lower() not in ("y", "yes"):
            print("nothing recorded", file=out)
            return EXIT_FAILED
    path = record_host_key(hop, key)
    print(f"recorded in {path}", file=out)
    return EXIT_OK
