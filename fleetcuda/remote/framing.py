"""One framing protocol for what fleetcuda's own shell prints around what runs inside it.

A frame line is `@@fleetcuda:<nonce> <kind> <fields...>`, printed by fleetcuda's code only; the output of
anything that runs inside a frame (a check, a fact) goes through `PAYLOAD`, which prefixes every line with
`| `. So no line a check prints can ever start a frame, whatever it prints, and the nonce (new each run)
keeps frames of one run apart from another's. Lines that are neither are ignored.

Two emitters write frames: the shell one here (`frame`), and the Python one every program in this package
that reports records carries (fleetcuda/remote/emit.py: its fields never hold whitespace, JSON is written
without any). A Python program gets the nonce in FLEETCUDA_NONCE, for its own process only (`PYTHON_NONCE`).
One parser reads them all: `parse` gives the frames, `records` (or `read`) the typed records they carry.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetcuda.plan.command import Invocation

MARK = "@@fleetcuda"
# Every line of a program's output, prefixed; the last line gets its newline if it had none.
PAYLOAD = "sed -e 's/^/| /' -e '$a\\'"
_NONCE = re.compile(r"[0-9a-f]{8,64}\Z")


# Every nonce this process made or put into a command: what `parse_issued` accepts, for callers that parse a
# command's output without being handed its nonce (fingerprint.parse, whose caller predates frames).
_ISSUED: set[str] = set()


def new_nonce() -> str:
    nonce = secrets.token_hex(8)
    _ISSUED.add(nonce)
    return nonce


# The shell variable that holds the nonce in the scripts that print frames. It is set from stdin (see
# command.Invocation's secret_vars), so the nonce is on no command line a check could read it from.
NONCE_VAR = "fcn"
NONCE_REF = "${" + NONCE_VAR + "}"


def frame(kind: str, *fields: str) -> str:
    """Shell code that prints one frame line. `fields` are fleetcuda's own shell words, expanded inside
    double quotes (`$rc`, `$(( ... ))`). The line starts with a newline of its own, so a payload without a
    final newline cannot swallow it."""
    return f"printf '\\n%s\\n' \"{' '.join([f'{MARK}:{NONCE_REF}', kind, *fields])}\""


def nonce_vars(nonce: str) -> dict[str, str]:
    """The secret variables a framed script needs (the nonce, read from stdin)."""
    if not _NONCE.match(nonce):
        raise ValueError(f"bad frame nonce {nonce!r}")
    _ISSUED.add(nonce)
    return {NONCE_VAR: nonce}


# The environment assignment that gives a Python program (one process, not its shell) the nonce.
PYTHON_NONCE = f'FLEETCUDA_NONCE="{NONCE_REF}"'


def with_nonce(inv: Invocation, nonce: str) -> Invocation:
    """An Invocation whose script prints frames gets the nonce on stdin, with its other secrets."""
    if not nonce or not (f"{MARK}:{NONCE_REF}" in inv.script or PYTHON_NONCE in inv.script):
        return inv
    return replace(inv, secret_vars={**nonce_vars(nonce), **inv.secret_vars})


@dataclass(frozen=True)
class Frame:
    kind: str
    fields: list[str]
    lines: list[str] = field(default_factory=list)  # payload lines after this frame, unprefixed

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def parse(output: str, nonce: str) -> list[Frame]:
    return _parse(output, {nonce})


def parse_issued(output: str) -> list[Frame]:
    """Frames carrying any nonce this process made (see _ISSUED)."""
    return _parse(output, set(_ISSUED))


def _parse(output: str, nonces: set[str]) -> list[Frame]:
    frames: list[Frame] = []
    for line in output.split("\n"):
        if line.startswith(MARK + ":"):
            nonce, _, rest = line[len(MARK) + 1:].partition(" ")
            if nonce in nonces and rest:
                kind, *fields = rest.split(" ")
                frames.append(Frame(kind, fields))
        elif line.startswith("| ") and frames:
            frames[-1].lines.append(line[2:])
    return frames


# -- typed records: what each kind of frame says ------------------------------------------------------------


@dataclass(frozen=True)
class FactRecord:
    name: str
    value: str  # the fact's last line of output, stripped


@dataclass(frozen=True)
class CheckBegin:
    index: int
    output: str  # the check's output, unprefixed


@dataclass(frozen=True)
class CheckEnd:
    index: int
    rc: int
    duration_ms: int


@dataclass(frozen=True)
class Done:
    count: int


@dataclass(frozen=True)
class LockRecord:
    state: str  # held, released, busy, stale, refreshed, taken-over
    fields: tuple[str, ...]  # busy: the lock directory, then its holder's words; stale: the holder's words


@dataclass(frozen=True)
class FingerprintRecord:
    fingerprint: Mapping[str, str]


@dataclass(frozen=True)
class WheelRecord:
    path: str
    sha256: str


@dataclass(frozen=True)
class DoctorRecord:
    report: Mapping[str, Any]


@dataclass(frozen=True)
class GateRecord:
    report: Mapping[str, Any]  # fast_path_gate's findings: transformers' version and each module's gate


@dataclass(frozen=True)
class GpuRecord:
    report: Mapping[str, Any]  # gpu_passthrough's findings: driver, the container's libraries and nodes, verdict


Record = (FactRecord | CheckBegin | CheckEnd | Done | LockRecord | FingerprintRecord | WheelRecord | DoctorRecord
          | GateRecord | GpuRecord)


def _int(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _json_object(fields: list[str]) -> dict[str, Any] | None:
    if len(fields) != 1:
        return None
    try:
        value = json.loads(fields[0])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def record(f: Frame) -> Record | None:
    """The record one frame carries, or None for a frame that is not well formed."""
    n = len(f.fields)
    if f.kind == "fact" and n == 1:
        return FactRecord(f.fields[0], f.lines[-1].strip() if f.lines else "")
    if f.kind == "begin" and n == 1 and (index := _int(f.fields[0])) is not None:
        return CheckBegin(index, f.text)
    if f.kind == "end" and n == 3 and (index := _int(f.fields[0])) is not None:
        # An rc that is not a number (a shell that could not say) counts as a failure.
        rc, took = _int(f.fields[1]), _int(f.fields[2])
        return CheckEnd(index, 255 if rc is None else rc, took or 0)
    if f.kind == "done" and n == 1 and (count := _int(f.fields[0])) is not None:
        return Done(count)
    if f.kind == "lock" and n >= 1:
        return LockRecord(f.fields[0], tuple(f.fields[1:]))
    if f.kind == "wheel" and n == 2:
        return WheelRecord(f.fields[0], f.fields[1])
    if f.kind in ("fingerprint", "doctor", "gate", "gpu") and (data := _json_object(f.fields)) is not None:
        if f.kind == "fingerprint":
            if not all(isinstance(v, str) for v in data.values()):
                return None
            return FingerprintRecord(data)
        if f.kind == "gpu":
            return GpuRecord(data)
        return DoctorRecord(data) if f.kind == "doctor" else GateRecord(data)
    return None


def records(frames: list[Frame]) -> list[Record]:
    return [r for f in frames if (r := record(f)) is not None]


def read(output: str, nonce: str) -> list[Record]:
    """Every well-formed record in a command's output that carries this nonce."""
    return records(parse(output, nonce))


# -- what a user is shown of framed output ------------------------------------------------------------------


class Unframed:
    """What the target printed, line by line, from one command's output (for `--show-output` and the live
    view's last line): once a frame of this run has been seen, frames and the blank lines around them are
    fleetcuda's own and dropped, a payload line (`| ...`) is shown without its prefix; output before any frame (a
    command that is not framed) is shown as it is; blank lines never."""

    def __init__(self, nonce: str):
        self.mark = f"{MARK}:{nonce} "
        self.framed = False

    def __call__(self, line: str) -> str | None:
        if line.startswith(self.mark):
            self.framed = True
            return None
        if not line.strip():  # (a frame starts on a line of its own: a newline is printed before it)
            return None
        if not self.framed:
            return line
        while line.startswith("| ") or line == "|":  # a program's own payload inside a check's: both prefixes
            line = line[2:]
        if line.startswith(self.mark) or not line.strip():
            return None
        return line
