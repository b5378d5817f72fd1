"""`fleetcuda discover HOST... [-i INVENTORY] [--write FILE]`: a host's containers, their GPU passthrough and
Python environments with torch; `--write` adds the new ones to an inventory file, keeping everything in it."""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from fleetcuda.cli import common
from fleetcuda.cli.environment import Environment
from fleetcuda.results import ExitStatus

if TYPE_CHECKING:
    from fleetcuda.plan.inventory import Inventory
    from fleetcuda.plan.inventory_edit import HostEdit
    from fleetcuda.run.discover import Found, HostReport


def add_parser(sub: argparse._SubParsersAction, env: Environment) -> None:
    sp = sub.add_parser("discover", help="list a host's containers: GPU passthrough, Python environments with "
                                         "torch; --write adds them to an inventory")
    sp.add_argument("hosts", nargs="+", metavar="HOST", help="a host of the inventory")
    common.add_inventory_option(sp, env, with_help=True)
    sp.add_argument("--write", metavar="FILE", help="add the containers found to this inventory file (created "
                                                    "if missing; the -i file itself to merge in place)")
    sp.add_argument("--format", choices=["text", "json"], default="text")


def run(args: argparse.Namespace, env: Environment) -> ExitStatus:
    from concurrent.futures import ThreadPoolExecutor

    from fleetcuda.connectors.base import TransportPool
    from fleetcuda.errors import InputError
    from fleetcuda.plan.inventory import load_inventory
    from fleetcuda.remote import framing
    from fleetcuda.run.discover import discover_host

    inventory = load_inventory(args.inventory)
    hosts = list(dict.fromkeys(args.hosts))
    for host in hosts:
        if host not in inventory.spec.hosts:
            known = ", ".join(inventory.spec.hosts) or "none"
            raise InputError(inventory.path, None, "hosts", f"no host {host!r} (discover HOST names a host of the "
                                                            f"inventory; its hosts: {known})")
    base = inventory
    write_path: Path | None = None
    if args.write:
        write_path = Path(os.path.realpath(args.write))  # a link stays a link: its file is the one updated
        base = load_inventory(args.write) if os.path.lexists(args.write) else None  # type: ignore[assignment]
    nonce = framing.new_nonce()
    pool = TransportPool(common.transport_factory(inventory))
    chains = {t.host: t.chain for t in inventory.targets}
    threads = ThreadPoolExecutor(max_workers=min(8, len(hosts)))
    try:
        futures = [threads.submit(discover_host, h, inventory.spec.hosts[h], chains[h], pool.get(h), nonce)
                   for h in hosts]
        reports = [f.result() for f in futures]
    except BaseException:  # Ctrl-C: close the connections, so that no thread waits on a host any longer
        pool.abort()
        raise
    finally:
        threads.shutdown(wait=False, cancel_futures=True)
        pool.close()
    edits = plan_edits(reports, base, inventory)
    if args.format == "json":
        env.stdout.write(json.dumps(as_json(reports, edits), indent=2) + "\n")
    else:
        render(reports, edits, base, args.write, env)
    code = exit_status(reports)
    if write_path is not None:
        write(write_path, args.write, edits, env, quiet=args.format == "json")
    return code


def exit_status(reports: list[HostReport]) -> ExitStatus:
    if any(r.error and not r.unreachable for r in reports):
        return ExitStatus.FAILED
    if any(c.config_error or c.probe_error for r in reports for c in r.containers):
        return ExitStatus.FAILED
    if any(r.unreachable for r in reports):
        return ExitStatus.UNREACHABLE
    return ExitStatus.OK


def plan_edits(reports: list[HostReport], base: Inventory | None, source: Inventory) -> dict[str, HostEdit]:
    """Per host, what a write adds (containers the base file lacks that are targets) and notes (the others)."""
    from fleetcuda.plan.command import DEFAULT_PCT
    from fleetcuda.plan.inventory import SAFE_NAME_RE
    from fleetcuda.plan.inventory_edit import HostEdit, HostSettings, NewContainer, Skipped

    edits: dict[str, HostEdit] = {}
    for report in reports:
        if report.error and not report.containers:
            continue
        in_base = base is not None and report.host in base.spec.hosts
        present = {t.container.vmid: t for t in (base.targets if base else [])
                   if t.host == report.host and t.container is not None}
        names = {t.container.name for t in present.values() if t.container and t.container.name}
        spec = source.spec.hosts[report.host]
        settings = None
        if not in_base and spec.kind == "ssh" and spec.address and not spec.jump:
            settings = HostSettings(spec.address, spec.user, spec.port, spec.identity_file, spec.known_hosts,
                                    spec.sudo, spec.pct if spec.pct != DEFAULT_PCT else None)
        edit = HostEdit(report.host, settings=settings)
        for found in report.containers:
            if found.vmid in present:
                continue
            name = found.name if SAFE_NAME_RE.fullmatch(found.name) and found.name not in names else None
            why = found.why_not
            if why is None:
                env_ = found.torch_env
                assert env_ is not None
                edit.add.append(NewContainer(found.vmid, name, env_.venv, env_.explicit_python))
                if name:
                    names.add(name)
            else:
                edit.skip.append(Skipped(found.vmid, name, why))
        edits[report.host] = edit
    return edits


def _gpu_lines(found: Found) -> list[str]:
    if found.config is None:
        return []
    return [p.line for p in found.config.passthrough]


FORM_NAMES = {"dev": "devN entries", "cgroup": "cgroup device rule", "mount": "bind mounts"}


def _inventory_line(found: Found, report: HostReport, edits: dict[str, HostEdit], base: Inventory | None,
                    file: str) -> str:
    edit = edits.get(report.host)
    tid = f"{report.host}/{found.vmid}"
    added = next((c for c in edit.add if c.vmid == found.vmid), None) if edit else None
    if added is not None:
        fields = [f"name: {added.name}" if added.name else None, f"venv: {added.venv}" if added.venv else None,
                  f"python: {added.python}" if added.python else None]
        note = "" if added.name or not found.name else " (its name is left out: not a name an inventory may hold, " \
                                                      "or another container's)"
        return f"inventory: would add {tid} to {file}: " + ", ".join(f for f in fields if f) + note
    skipped = next((s for s in edit.skip if s.vmid == found.vmid), None) if edit else None
    if skipped is not None:
        return f"inventory: not a target ({skipped.why}); --write notes it in a comment"
    if base is not None and any(t.id == tid for t in base.targets):
        return f"inventory: already in {file} as {tid}"
    return "inventory: -"


def render(reports: list[HostReport], edits: dict[str, HostEdit], base: Inventory | None, write: str | None,
           env: Environment) -> None:
    from fleetcuda.redact import printable

    file = write or (base.path if base else "")
    out: list[str] = []
    for report in reports:
        where = f" ({report.address})" if report.address else ""
        if report.error and not report.containers:
            out.append(f"{report.host}{where}: {report.error}")
            continue
        count = len(report.containers)
        out.append(f"{report.host}{where}: {count} container{'s' if count != 1 else ''}")
        if report.error:
            out.append(f"  warning: {report.error}")
        for found in report.containers:
            lock = f" (lock: {found.lock})" if found.lock else ""
            out.append(f"  {found.vmid}  {found.name}  {found.status}{lock}")
            pad = "      "
            if found.config_error:
                out.append(f"{pad}config: {found.config_error}")
            elif found.config is not None and found.config.has_gpu:
                forms = ", ".join(FORM_NAMES[f] for f in found.config.forms)
                out.append(f"{pad}GPU passthrough ({forms}):")
                out += [f"{pad}  {line}" for line in _gpu_lines(found)]
            else:
                out.append(f"{pad}GPU passthrough: none")
            if found.probe_error:
                out.append(f"{pad}python: {found.probe_error}")
            elif not found.probed:
                why = ("its config was not read" if found.config_error else found.status
                       if found.status != "running" else "no GPU passthrough")
                out.append(f"{pad}python: not looked for ({why})")
            elif not found.envs:
                out.append(f"{pad}python: no environment found (venvs, conda, the system's python3)")
            for e in found.envs:
                version = f", Python {e.python_version}" if e.python_version else ""
                torch = f"torch {e.torch} (CUDA {e.cuda or '?'})" if e.torch else "no torch"
                out.append(f"{pad}python: {e.path} ({e.kind}{version}): {torch}")
            if found.skipped_paths:
                out.append(f"{pad}python: {found.skipped_paths} environment(s) at paths an inventory cannot name "
                           "were left out")
            if found.truncated:
                out.append(f"{pad}python: more environments than the probe reports (64); the rest were left out")
            out.append(pad + _inventory_line(found, report, edits, base, file))
    adds = sum(len(e.add) for e in edits.values())
    if write is None:
        target = f" to {file}" if file else ""
        out.append(f"would add {adds} container{'s' if adds != 1 else ''}{target}"
                   + (" (--write FILE adds them)" if adds else ""))
    env.stdout.write("".join(printable(line) + "\n" for line in out))


def as_json(reports: list[HostReport], edits: dict[str, HostEdit]) -> dict:
    hosts = []
    for r in reports:
        edit = edits.get(r.host)
        containers = []
        for c in r.containers:
            added = next((a for a in edit.add if a.vmid == c.vmid), None) if edit else None
            skipped = next((s for s in edit.skip if s.vmid == c.vmid), None) if edit else None
            containers.append({
                "vmid": c.vmid, "name": c.name, "status": c.status, "lock": c.lock or None,
                "config_error": c.config_error, "probe_error": c.probe_error,
                "gpu": {"forms": list(c.config.forms) if c.config else [], "lines": _gpu_lines(c)},
                "envs": [{"kind": e.kind, "path": e.path, "python": e.python, "python_version": e.python_version,
                          "torch": e.torch, "cuda": e.cuda} for e in c.envs],
                "inventory": ({"action": "add", "name": added.name, "venv": added.venv, "python": added.python}
                              if added else {"action": "note", "why": skipped.why} if skipped
                              else {"action": "present"}),
            })
        hosts.append({"host": r.host, "address": r.address, "error": r.error, "unreachable": r.unreachable,
                      "containers": containers})
    return {"hosts": hosts}


def write(path: Path, shown: str, edits: dict[str, HostEdit], env: Environment, quiet: bool) -> None:
    """Merge the edits into the file's text, prove the result loads and keeps every target the file had, and
    replace the file in one step with its own mode (a new file: 0600)."""
    import tempfile

    from fleetcuda.errors import FleetcudaError, InputError
    from fleetcuda.plan.inventory import load_inventory
    from fleetcuda.plan.inventory_edit import merge
    from fleetcuda.plan.yamlsrc import read_bounded

    exists = os.path.lexists(path)
    raw = read_bounded(path) if exists else b""
    text = raw.decode("utf-8")  # it loaded as an inventory: UTF-8
    mode = stat.S_IMODE(os.stat(path).st_mode) if exists else 0o600
    merged, done = merge(text, shown, list(edits.values()))
    if merged == text:
        if not quiet:
            env.stdout.write(f"{shown}: nothing to add\n")
        return
    before = load_inventory(path) if exists else None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(merged)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            after = load_inventory(tmp)
        except InputError as exc:
            raise FleetcudaError(f"{shown}: not written: the merged inventory would not load ({exc.message}, line "
                                 f"{exc.line}); this is a bug of discover") from None
        _check_kept(before, after, edits, shown)
        if (read_bounded(path) if exists else b"") != raw:
            raise FleetcudaError(f"{shown}: not written: the file changed while discover ran; run it again")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if not quiet:
        from fleetcuda.redact import printable

        env.stdout.write(printable(f"wrote {shown}:\n" + "".join(f"  {line}\n" for line in done)))


def _check_kept(before: Inventory | None, after: Inventory, edits: dict[str, HostEdit], shown: str) -> None:
    """Every target the file had is there unchanged; the only new ones are those the edits add."""
    from fleetcuda.errors import FleetcudaError

    old = {t.id: t.container for t in before.targets} if before else {}
    new = {t.id: t.container for t in after.targets}
    added = {f"{h}/{c.vmid}" for h, e in edits.items() for c in e.add}
    for tid, container in old.items():
        if tid not in new and not (tid in {h for h in edits} and any(a.startswith(tid + "/") for a in added)):
            raise FleetcudaError(f"{shown}: not written: the merge would lose {tid} (a bug of discover)")
        if tid in new and new[tid] != container:
            raise FleetcudaError(f"{shown}: not written: the merge would change {tid} (a bug of discover)")
    unexpected = set(new) - set(old) - added - set(edits)
    if unexpected:
        raise FleetcudaError(f"{shown}: not written: the merge would add {', '.join(sorted(unexpected))}, which "
                             "discover did not mean to (a bug of discover)")
    for host, edit in edits.items():
        for c in edit.add:
            got = new.get(f"{host}/{c.vmid}")
            if got is None or (got.name, got.venv, got.python) != (c.name, c.venv, c.python):
                raise FleetcudaError(f"{shown}: not written: {host}/{c.vmid} would not read back as written "
                                     "(a bug of discover)")
