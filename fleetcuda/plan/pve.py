"""Proxmox's `pct list` and `pct config <vmid>` output -> typed records (pure: no I/O).

The formats, as pve-container's src/PVE/CLI/pct.pm prints them:

- `pct list`: nothing at all without containers; else a header and one row per container, each
  `printf "%-10s %-10s %-12s %-20s\\n"` of VMID, Status, Lock, Name, sorted by vmid. The name is the
  config's hostname (or `CT<vmid>`) with every whitespace character removed, and a lock never holds
  one, so a row splits on whitespace into 3 words (no lock) or 4.
- `pct config`: one `key: value` line per option, keys sorted (Perl's string sort), `digest` left out,
  `description` URI-escaped onto one line; then the raw `lxc.*` keys in the config file's order, also
  written `key: value` (whichever of `:` or `=` the file used).

GPU passthrough shows in three forms: `devN: /dev/nvidia0[,uid=..,gid=..,mode=..]` (PVE 8.1 and later),
`lxc.cgroup2.devices.allow: c 195:* rwm` (NVIDIA's character major 195; `lxc.cgroup.` on cgroup v1), and
`lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

# NVIDIA's fixed character-device major (nvidia0..N, nvidiactl); nvidia-uvm's major is dynamic.
NVIDIA_MAJOR = "195"
_ROW_HEADER = ["VMID", "Status", "Lock", "Name"]
_KEY = re.compile(r"(?:[a-z][a-z_]*\d*|lxc\.[a-z0-9_.\-]+)\Z")
_DEV_KEY = re.compile(r"dev\d+\Z")
_ALLOW = re.compile(r"([cb]|a)\s+(\*|\d+):(\*|\d+)(?:\s+([rwm]+))?\s*\Z")

Form = Literal["dev", "cgroup", "mount"]


class PveParseError(ValueError):
    """Output that is not what pct prints: the line (1-based) and why."""

    def __init__(self, what: str, line: int, message: str):
        super().__init__(f"{what}, line {line}: {message}")
        self.what = what
        self.line = line
        self.message = message


@dataclass(frozen=True)
class ListedContainer:
    vmid: int
    status: str  # running | stopped (pct can say other states)
    lock: str  # "" when none
    name: str


@dataclass(frozen=True)
class Passthrough:
    """One config line that passes an NVIDIA device through, and which of the three forms it is."""

    form: Form
    key: str
    value: str
    device: str  # /dev/nvidia0, /dev/nvidiactl, ...; for a cgroup rule: `c 195:*`

    @property
    def line(self) -> str:
        return f"{self.key}: {self.value}"


@dataclass(frozen=True)
class ContainerConfig:
    vmid: int
    options: dict[str, str]  # the `key: value` options (not lxc.*)
    raw: tuple[tuple[str, str], ...]  # the lxc.* keys, in the file's order
    passthrough: tuple[Passthrough, ...] = field(default=())

    @property
    def hostname(self) -> str | None:
        return self.options.get("hostname")

    @property
    def forms(self) -> tuple[Form, ...]:
        """The passthrough forms present, in a fixed order."""
        return tuple(f for f in ("dev", "cgroup", "mount") if any(p.form == f for p in self.passthrough))

    @property
    def has_gpu(self) -> bool:
        return bool(self.passthrough)


def parse_list(text: str) -> list[ListedContainer]:
    """`pct list`'s output; empty output is no containers."""
    lines = [ln for ln in text.split("\n") if ln.strip()]
    if not lines:
        return []
    if lines[0].split() != _ROW_HEADER:
        raise PveParseError("pct list", 1, f"expected the header VMID Status Lock Name, got {lines[0].strip()!r}")
    out: list[ListedContainer] = []
    seen: set[int] = set()
    for number, line in enumerate(lines[1:], start=2):
        words = line.split()
        if len(words) not in (3, 4) or not words[0].isdigit() or not words[0].isascii():
            raise PveParseError("pct list", number, f"not a row of VMID, Status, [Lock,] Name: {line.strip()!r}")
        vmid = int(words[0])
        if vmid in seen:
            raise PveParseError("pct list", number, f"vmid {vmid} listed twice")
        seen.add(vmid)
        lock = words[2] if len(words) == 4 else ""
        out.append(ListedContainer(vmid, words[1], lock, words[-1]))
    return out


def parse_config(vmid: int, text: str) -> ContainerConfig:
    """`pct config <vmid>`'s output (stdout only: pct's warnings go to stderr)."""
    options: dict[str, str] = {}
    raw: list[tuple[str, str]] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        key, sep, value = line.partition(": ")
        if not sep and line.endswith(":"):  # `key:` with an empty value
            key, sep, value = line[:-1], ":", ""
        if not sep or not _KEY.match(key):
            raise PveParseError(f"pct config {vmid}", number, f"not a `key: value` line: {line.strip()!r}")
        if key.startswith("lxc."):
            raw.append((key, value))
        elif key in options:
            raise PveParseError(f"pct config {vmid}", number, f"option {key!r} printed twice")
        else:
            options[key] = value
    return ContainerConfig(vmid, options, tuple(raw), tuple(find_passthrough(options, raw)))


def find_passthrough(options: dict[str, str], raw: list[tuple[str, str]]) -> list[Passthrough]:
    found: list[Passthrough] = []
    for key in sorted(options, key=_dev_index):
        if _DEV_KEY.match(key) and (path := _dev_path(options[key])) and _is_nvidia(path):
            found.append(Passthrough("dev", key, options[key], path))
    for key, value in raw:
        if key in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow"):
            m = _ALLOW.match(value.strip())
            # `c 195:* rwm`, or one minor (`c 195:0 rw`); `a` (every device) says nothing about a GPU.
            if m and m[1] == "c" and m[2] == NVIDIA_MAJOR:
                found.append(Passthrough("cgroup", key, value, f"c {m[2]}:{m[3]}"))
        elif key == "lxc.mount.entry":
            source = value.split()[0] if value.split() else ""
            if _is_nvidia(source):
                found.append(Passthrough("mount", key, value, source))
    return found


def _dev_index(key: str) -> tuple[int, str]:
    return (int(key[3:]), key) if _DEV_KEY.match(key) else (-1, key)


def _dev_path(value: str) -> str | None:
    """The device path of a `devN` property string: its default key or `path=`."""
    for part in value.split(","):
        name, eq, rest = part.partition("=")
        if not eq:
            return name.strip()
        if name.strip() == "path":
            return rest.strip()
    return None


def _is_nvidia(path: str) -> bool:
    return path.startswith("/dev/nvidia")
