"""Inventory: hosts and their pct containers, groups, and variables with a documented precedence.

Variable precedence, lowest first: recipe defaults < inventory `vars` < group vars (in the order
the groups are listed in the file) < host vars < container vars < `--var K=V`.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints, field_validator, model_validator

from fleetcuda.errors import InputError
from fleetcuda.plan.command import DEFAULT_PCT, HopChain, PctHop, SshHop
from fleetcuda.plan.yamlsrc import SourceDoc, load_yaml

# These patterns are checked by pydantic, whose regex engine reads `\A` and `\z` as the very start and end of
# the text. Never `^...$`: in Python's re, `$` also matches before a trailing newline. Python code checks
# names with the compiled *_RE forms and fullmatch.
_SAFE_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}"
_VAR_NAME = r"[A-Za-z_][A-Za-z0-9_]{0,63}"
SAFE_NAME = rf"\A{_SAFE_NAME}\z"
VAR_NAME = rf"\A{_VAR_NAME}\z"
SAFE_NAME_RE = re.compile(_SAFE_NAME)
VAR_NAME_RE = re.compile(_VAR_NAME)
VMID_MIN, VMID_MAX = 100, 999_999_999
# Absolute paths made of ordinary characters; anything else in a path is refused, not quoted.
ABS_PATH = r"\A/[A-Za-z0-9._/+@-]{0,4095}\z"
LOCAL_PATH = r"\A[A-Za-z0-9._/+@~-][A-Za-z0-9._/+@~ -]{0,4095}\z"
# Host addresses: DNS names, IPv4, or IPv6 literals.
ADDRESS = r"\A[A-Za-z0-9][A-Za-z0-9.:-]{0,252}\z"
USER = r"\A[a-z_][a-z0-9_-]{0,31}\z"
# Longer chains of jump hosts or nested groups are refused (they are resolved recursively).
MAX_CHAIN = 64

Name = Annotated[str, StringConstraints(pattern=SAFE_NAME)]
VarName = Annotated[str, StringConstraints(pattern=VAR_NAME)]
VarValue = str | int | float | bool
AbsPath = Annotated[str, StringConstraints(pattern=ABS_PATH)]
LocalPath = Annotated[str, StringConstraints(pattern=LOCAL_PATH)]


def var_to_str(value: VarValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class ContainerSpec(_Model):
    vmid: int = Field(ge=VMID_MIN, le=VMID_MAX)
    name: Name | None = None
    venv: AbsPath | None = Field(default=None, description="virtualenv inside the container, e.g. /root/venv")
    python: AbsPath | None = Field(default=None, description="interpreter; defaults to <venv>/bin/python")
    vars: dict[VarName, VarValue] = Field(default_factory=dict)

    @field_validator("vmid", mode="before")
    @classmethod
    def _vmid_is_integer(cls, v: object) -> object:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"vmid must be an integer from {VMID_MIN} to {VMID_MAX} (got {v!r})")
        return v


class HostSpec(_Model):
    kind: Literal["ssh", "local"] = "ssh"
    address: Annotated[str, StringConstraints(pattern=ADDRESS)] | None = None
    user: Annotated[str, StringConstraints(pattern=USER)] = "root"
    # Strict: `port: true` must not become `-p 1`, nor `port: "22"` pass for a number.
    port: StrictInt = Field(default=22, ge=1, le=65535)
    identity_file: LocalPath | None = None
    known_hosts: LocalPath | None = None
    jump: Name | None = Field(default=None, description="another host of this inventory to hop through")
    sudo: bool | None = Field(default=None, description="reach pct through `sudo -n` (for a non-root SSH user)")
    pct: AbsPath = DEFAULT_PCT
    connect_timeout: StrictInt = Field(default=10, ge=1, le=300)
    venv: AbsPath | None = None
    python: AbsPath | None = None
    vars: dict[VarName, VarValue] = Field(default_factory=dict)
    containers: dict[int | str, object] | list[object] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _reachable(self) -> HostSpec:
        if self.kind == "ssh" and not self.address:
            raise ValueError("an ssh host needs an address")
        if self.kind == "local" and (self.address or self.jump):
            raise ValueError("a local host takes no address or jump")
        if self.containers and self.user != "root" and self.sudo is None:
            raise ValueError(f"user {self.user!r} is not root: set `sudo: true` to reach pct through sudo -n "
                             "(or `sudo: false` if that user is root under another name)")
        return self


class GroupSpec(_Model):
    members: list[str] = Field(default_factory=list, description="hosts, host/vmid, or container names")
    children: list[Name] = Field(default_factory=list)
    vars: dict[VarName, VarValue] = Field(default_factory=dict)


class InventorySpec(_Model):
    vars: dict[VarName, VarValue] = Field(default_factory=dict)
    groups: dict[Name, GroupSpec] = Field(default_factory=dict)
    hosts: dict[Name, HostSpec]


@dataclass(frozen=True)
class Target:
    """One place a recipe runs: a container on a host, or a host itself when it lists no containers."""

    host: str
    spec: HostSpec
    container: ContainerSpec | None
    chain: HopChain
    groups: tuple[str, ...]
    vars: dict[str, str] = field(hash=False, compare=False)

    @property
    def id(self) -> str:
        return f"{self.host}/{self.container.vmid}" if self.container else self.host

    @property
    def name(self) -> str | None:
        return self.container.name if self.container else None

    @property
    def venv(self) -> str | None:
        return (self.container.venv if self.container else None) or (None if self.container else self.spec.venv)

    @property
    def python(self) -> str:
        explicit = self.container.python if self.container else self.spec.python
        if explicit:
            return explicit
        return f"{self.venv}/bin/python" if self.venv else "python3"


@dataclass
class Inventory:
    path: str
    spec: InventorySpec
    targets: list[Target]
    source: SourceDoc

    def select(self, limit: str | None) -> list[Target]:
        """Targets matching --limit: comma-separated host, host/vmid, group, container name or glob;
        a leading `!` excludes."""
        if not limit:
            return list(self.targets)
        include = [p for p in (s.strip() for s in limit.split(",")) if p and not p.startswith("!")]
        exclude = [p[1:].strip() for p in (s.strip() for s in limit.split(",")) if p.startswith("!")]
        # Every pattern must name something, exclusions too: a misspelt `!host` would otherwise mean "all".
        for pattern in exclude:
            if not pattern:
                raise InputError("--limit", None, repr(limit), "`!` must be followed by what to exclude")
            if not any(self._matches(t, pattern) for t in self.targets):
                raise InputError("--limit", None, "", f"exclusion !{pattern} matches no target in {self.path}")
        chosen = list(self.targets) if not include else []
        for pattern in include:
            matched = [t for t in self.targets if self._matches(t, pattern)]
            if not matched:
                raise InputError("--limit", None, "", f"pattern {pattern!r} matches no target in {self.path}")
            chosen += [t for t in matched if t not in chosen]
        chosen = [t for t in chosen if not any(self._matches(t, p) for p in exclude)]
        if not chosen:
            raise InputError("--limit", None, repr(limit), "selects no target (its exclusions remove every one)")
        order = {t.id: i for i, t in enumerate(self.targets)}
        return sorted(chosen, key=lambda t: order[t.id])

    @staticmethod
    def _matches(target: Target, pattern: str) -> bool:
        names = [target.id, target.host, *target.groups]
        if target.name:
            names.append(target.name)
        return any(fnmatch.fnmatchcase(n, pattern) for n in names)


def load_inventory(path: str | Path) -> Inventory:
    doc = load_yaml(path)
    if not isinstance(doc.data, dict):
        raise doc.error((), "an inventory is a mapping with a `hosts` key")
    spec: InventorySpec = doc.validate(InventorySpec)
    containers = {name: _containers(doc, name, host) for name, host in spec.hosts.items()}
    _check_jumps(doc, spec)
    membership = _group_membership(doc, spec, containers)

    targets: list[Target] = []
    for host_name, host in spec.hosts.items():
        ssh = _ssh_hop(spec, host_name, doc.path) if host.kind == "ssh" else None
        for ct in containers[host_name] or [None]:
            tid = f"{host_name}/{ct.vmid}" if ct else host_name
            groups = tuple(g for g in spec.groups if tid in membership[g])
            merged: dict[str, str] = {k: var_to_str(v) for k, v in spec.vars.items()}
            for g in groups:
                merged.update({k: var_to_str(v) for k, v in spec.groups[g].vars.items()})
            merged.update({k: var_to_str(v) for k, v in host.vars.items()})
            if ct:
                merged.update({k: var_to_str(v) for k, v in ct.vars.items()})
            pct = PctHop(ct.vmid, host.pct, bool(host.sudo)) if ct else None
            targets.append(Target(host_name, host, ct, HopChain(ssh, pct), groups, merged))
    return Inventory(doc.path, spec, targets, doc)


def _containers(doc: SourceDoc, host_name: str, host: HostSpec) -> list[ContainerSpec]:
    base = ("hosts", host_name, "containers")
    items: list[tuple[tuple, dict]] = []
    if isinstance(host.containers, dict):
        for key, body in host.containers.items():
            if not isinstance(body, dict):
                raise doc.error(base + (key,), "a container is a mapping (name, venv, vars)")
            if "vmid" in body:
                raise doc.error(base + (key, "vmid"), "the vmid is the key; do not repeat it")
            items.append((base + (key,), {"vmid": key, **body}))
    else:
        for i, body in enumerate(host.containers):
            if not isinstance(body, dict):
                raise doc.error(base + (i,), "a container is a mapping with a vmid")
            items.append((base + (i,), body))
    out: list[ContainerSpec] = []
    seen_vmids: set[int] = set()
    seen_names: set[str] = set()
    for loc, body in items:
        ct: ContainerSpec = doc.validate(ContainerSpec, body, base=loc)
        if ct.vmid in seen_vmids:
            raise doc.error(loc, f"duplicate vmid {ct.vmid} on host {host_name}")
        if ct.name and ct.name in seen_names:
            raise doc.error(loc + ("name",), f"duplicate container name {ct.name!r} on host {host_name}")
        seen_vmids.add(ct.vmid)
        if ct.name:
            seen_names.add(ct.name)
        out.append(ct)
    return out


def _check_jumps(doc: SourceDoc, spec: InventorySpec) -> None:
    for name, host in spec.hosts.items():
        seen = [name]
        current = host
        while current.jump:
            loc = ("hosts", seen[-1], "jump")
            if current.jump not in spec.hosts:
                raise doc.error(loc, f"jump host {current.jump!r} is not a host of this inventory")
            if current.jump in seen:
                raise doc.error(loc, "jump hosts form a cycle: " + " -> ".join([*seen, current.jump]))
            if spec.hosts[current.jump].kind != "ssh":
                raise doc.error(loc, f"jump host {current.jump!r} must be an ssh host")
            if len(seen) >= MAX_CHAIN:
                raise doc.error(loc, f"more than {MAX_CHAIN} jump hosts in a chain")
            seen.append(current.jump)
            current = spec.hosts[current.jump]


def _ssh_hop(spec: InventorySpec, name: str, path: str) -> SshHop:
    import os
    import shlex

    host = spec.hosts[name]
    assert host.address is not None
    return SshHop(
        address=host.address,
        user=host.user,
        port=host.port,
        identity_file=host.identity_file,
        known_hosts=host.known_hosts,
        jump=_ssh_hop(spec, host.jump, path) if host.jump else None,
        connect_timeout=host.connect_timeout,
        trust_command=f"fleetcuda trust -i {shlex.quote(os.path.abspath(path))} {shlex.quote(name)}",
    )


def _group_membership(doc: SourceDoc, spec: InventorySpec,
                      containers: dict[str, list[ContainerSpec]]) -> dict[str, set[str]]:
    """Target ids in each group, children included; cycles and unknown members are errors."""
    all_ids: dict[str, list[str]] = {}
    for host_name, cts in containers.items():
        ids = [f"{host_name}/{c.vmid}" for c in cts] or [host_name]
        all_ids[host_name] = ids
        for c in cts:
            all_ids.setdefault(f"{host_name}/{c.vmid}", []).append(f"{host_name}/{c.vmid}")
            if c.name:
                all_ids.setdefault(c.name, []).append(f"{host_name}/{c.vmid}")

    resolved: dict[str, set[str]] = {}

    def resolve(group: str, stack: tuple[str, ...]) -> set[str]:
        if group in resolved:
            return resolved[group]
        gspec = spec.groups[group]
        ids: set[str] = set()
        for i, member in enumerate(gspec.members):
            if member not in all_ids:
                raise doc.error(("groups", group, "members", i), f"{member!r} is not a host, host/vmid or container")
            ids.update(all_ids[member])
        for i, child in enumerate(gspec.children):
            loc = ("groups", group, "children", i)
            if child not in spec.groups:
                raise doc.error(loc, f"child group {child!r} is not defined")
            if child in stack:
                raise doc.error(loc, "groups form a cycle: " + " -> ".join([*stack, child]))
            if len(stack) >= MAX_CHAIN:
                raise doc.error(loc, f"groups nested more than {MAX_CHAIN} deep")
            ids |= resolve(child, stack + (child,))
        resolved[group] = ids
        return ids

    return {g: resolve(g, (g,)) for g in spec.groups}
