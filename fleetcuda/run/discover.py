"""`fleetcuda discover`: a Proxmox host's containers, their GPU passthrough and the Python environments with torch
inside them, over the host's one connection.

One round trip per host (`pct list`, then `pct config` of every container it lists: remote/discover_probe.sh's
`fleetcuda_discover_host`), then one per running container with GPU passthrough (`fleetcuda_discover_envs`:
venvs, conda installs and envs, torch's version read from torch/version.py, never imported). Every command is
built by plan.command.build with the host's hop chain; everything is reported in frames (remote.framing)
carrying this run's nonce, so nothing a container or a config holds can pass for a report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from fleetcuda.connectors.base import Transport
from fleetcuda.errors import HostKeyError, UnreachableError
from fleetcuda.plan.command import BuiltCommand, HopChain, Invocation, PctHop, build, internal_label, quote
from fleetcuda.plan.inventory import ABS_PATH, HostSpec
from fleetcuda.plan.pve import ContainerConfig, ListedContainer, PveParseError, parse_config, parse_list
from fleetcuda.remote import framing, shell_text

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_TIMEOUT_S = 600  # a pct call is a perl start on Proxmox (about a second): one per container
PROBE_TIMEOUT_S = 60
_ABS_PATH = re.compile(ABS_PATH.removeprefix(r"\A").removesuffix(r"\z"))
_WORD = re.compile(r"[A-Za-z0-9.+_-]{1,64}")


@dataclass(frozen=True)
class PyEnv:
    """A Python environment the probe found: kind venv | conda | system."""

    kind: str
    path: str
    python: str
    python_version: str | None
    torch: str | None
    cuda: str | None  # torch's CUDA ("none": a CPU build)

    @property
    def venv(self) -> str | None:
        return None if self.kind == "system" else self.path

    @property
    def explicit_python(self) -> str | None:
        """The interpreter an inventory must name: none when it is <venv>/bin/python."""
        return None if self.venv and self.python == f"{self.venv}/bin/python" else self.python


@dataclass
class Found:
    """One container of a host, as discovery saw it."""

    vmid: int
    name: str
    status: str
    lock: str = ""
    config: ContainerConfig | None = None
    config_error: str | None = None
    probed: bool = False
    envs: list[PyEnv] = field(default_factory=list)
    probe_error: str | None = None
    skipped_paths: int = 0  # environments at paths no inventory may name
    truncated: bool = False

    @property
    def has_gpu(self) -> bool:
        return bool(self.config and self.config.has_gpu)

    @property
    def torch_env(self) -> PyEnv | None:
        """The environment to write: the first holding torch, in the probe's order of preference."""
        return next((e for e in self.envs if e.torch), None)

    @property
    def why_not(self) -> str | None:
        """Why this container is not a target to add; None when it is one."""
        if self.config_error:
            return "its config could not be read"
        if self.status != "running":
            return f"it is {self.status}"
        if not self.has_gpu:
            return "it has no GPU passthrough"
        if self.probe_error:
            return "its environments could not be read"
        if self.torch_env is None:
            return "no Python environment with torch was found in it"
        return None


@dataclass
class HostReport:
    host: str
    address: str | None
    containers: list[Found] = field(default_factory=list)
    error: str | None = None
    unreachable: bool = False


def host_command(spec: HostSpec, chain: HopChain, nonce: str) -> BuiltCommand:
    """pct list, then pct config of each listed container, on the host (through `sudo -n` when it says so)."""
    script = shell_text("discover_probe") + f"fleetcuda_discover_host {quote(spec.pct)} {1 if spec.sudo else 0}\n"
    inv = Invocation(script, {"PATH": PATH, "LC_ALL": "C"}, timeout=HOST_TIMEOUT_S, label=internal_label("discover"))
    # Every container's config, each at most 1 MiB on the host: read whole up to 16 MiB (connectors.base.KEEP_HEAD).
    return replace(build(HopChain(chain.ssh, None), framing.with_nonce(inv, nonce)), output_keep=16 * 1024 * 1024)


def probe_command(spec: HostSpec, chain: HopChain, vmid: int, nonce: str) -> BuiltCommand:
    """The container's Python environments, in one `pct exec`."""
    script = shell_text("discover_probe") + "fleetcuda_discover_envs\n"
    inv = Invocation(script, {"PATH": PATH, "LC_ALL": "C"}, timeout=PROBE_TIMEOUT_S,
                     label=internal_label("discover-probe"))
    return build(HopChain(chain.ssh, PctHop(vmid, spec.pct, bool(spec.sudo))), framing.with_nonce(inv, nonce))


@dataclass(frozen=True)
class PctOutput:
    rc: int
    stdout: str
    stderr: str


def parse_host(output: str, nonce: str) -> tuple[PctOutput | None, dict[int, PctOutput], bool]:
    """(pct list's result, each vmid's pct config result, whether the report was complete)."""
    listing: PctOutput | None = None
    configs: dict[int, PctOutput] = {}
    done = False
    frames = framing.parse(output, nonce)
    for i, f in enumerate(frames):
        if f.kind == "pve" and len(f.fields) == 3 and f.fields[2].isdigit():
            what, vmid = f.fields[0], f.fields[1]
            err = frames[i + 1] if i + 1 < len(frames) else None
            stderr = err.text if err and err.kind == "pve-err" and err.fields == [what, vmid] else ""
            result = PctOutput(int(f.fields[2]), f.text, stderr)
            if what == "list" and vmid == "-":
                listing = result
            elif what == "config" and vmid.isdigit():
                configs[int(vmid)] = result
        elif f.kind == "pve-done" and len(f.fields) == 1:
            done = True
    return listing, configs, done


def parse_envs(output: str, nonce: str) -> tuple[list[PyEnv], int, bool, bool]:
    """(environments, paths skipped, truncated, whether the report was complete). A field that is not what the
    probe prints (a path no inventory may hold, a version that is not one word) is not believed."""
    envs: list[PyEnv] = []
    skipped, truncated, done = 0, False, False
    for f in framing.parse(output, nonce):
        if f.kind == "pyenv" and len(f.fields) == 6:
            kind, path, python, pyver, torch, cuda = f.fields
            if kind not in ("venv", "conda", "system") or not _ABS_PATH.fullmatch(path) \
                    or not _ABS_PATH.fullmatch(python):
                skipped += 1
                continue
            envs.append(PyEnv(kind, path, python, _word(pyver), _word(torch), _word(cuda)))
        elif f.kind == "pyenv-done" and len(f.fields) == 3 and all(x.isdigit() for x in f.fields):
            skipped += int(f.fields[1])
            truncated = f.fields[2] == "1"
            done = True
    return envs, skipped, truncated, done


def _word(text: str) -> str | None:
    return text if _WORD.fullmatch(text) and text not in ("-", "?") else None


def _tail(text: str, lines: int = 3) -> str:
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " / ".join(kept[-lines:])


def discover_host(host: str, spec: HostSpec, chain: HopChain, transport: Transport, nonce: str) -> HostReport:
    """Everything discovery learns of one host; what fails is said in the report, never raised."""
    report = HostReport(host, spec.address)
    try:
        res = transport.run(host_command(spec, chain, nonce), timeout=HOST_TIMEOUT_S, on_line=lambda line: None)
    except (UnreachableError, HostKeyError) as exc:
        report.error, report.unreachable = str(exc), True
        return report
    listing, configs, done = parse_host(res.output, nonce)
    if listing is None:
        report.error = f"no report from the host (exit {res.rc}): {_tail(res.output) or 'no output'}"
        return report
    if listing.rc != 0:
        report.error = f"pct list failed (exit {listing.rc}): {_tail(listing.stderr or listing.stdout)}"
        return report
    try:
        listed: list[ListedContainer] = parse_list(listing.stdout)
    except PveParseError as exc:
        report.error = str(exc)
        return report
    if not done:
        report.error = f"the host's report ended early (exit {res.rc}): {_tail(res.output) or 'no output'}"
    for row in listed:
        found = Found(row.vmid, row.name, row.status, row.lock)
        out = configs.get(row.vmid)
        if out is None:
            found.config_error = "pct config was not read"
        elif out.rc != 0:
            found.config_error = f"pct config {row.vmid} failed (exit {out.rc}): {_tail(out.stderr or out.stdout)}"
        else:
            try:
                found.config = parse_config(row.vmid, out.stdout)
            except PveParseError as exc:
                found.config_error = str(exc)
        report.containers.append(found)
    for found in report.containers:
        if found.status == "running" and found.has_gpu:
            _probe(found, spec, chain, transport, nonce)
    return report


def _probe(found: Found, spec: HostSpec, chain: HopChain, transport: Transport, nonce: str) -> None:
    found.probed = True
    try:
        res = transport.run(probe_command(spec, chain, found.vmid, nonce), timeout=PROBE_TIMEOUT_S,
                            on_line=lambda line: None)
    except (UnreachableError, HostKeyError) as exc:
        found.probe_error = str(exc)
        return
    envs, skipped, truncated, done = parse_envs(res.output, nonce)
    found.envs, found.skipped_paths, found.truncated = envs, skipped, truncated
    if not done:
        found.probe_error = f"no report from the container (exit {res.rc}): {_tail(res.output) or 'no output'}"
