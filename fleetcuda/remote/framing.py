"""One framing protocol for what fleetcuda's own shell prints around what runs inside it.

A frame line is `@@fleetcuda:<nonce> <kind> <fields...>`, printed by fleetcuda's code only; the output of
anything that runs inside a frame (a check, a fact) goes through `PAYLOAD`, which prefixes every line with
`| `. So no line a check prints can ever start a frame, whatever it prints, and the nonce (new each run)
keeps frames of one run apart from another's. Lines that are neither are ignored.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

MARK = "@@fleetcuda"
# Every line of a program's output, prefixed; the last line gets its newline if it had none.
PAYLOAD = "sed -e 's/^/| /' -e '$a\\'"
_NONCE = re.compile(r"[0-9a-f]{8,64}\Z")


def new_nonce() -> str:
    return secrets.token_hex(8)


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
    return {NONCE_VAR: nonce}


@dataclass
class Frame:
    kind: str
    fields: list[str]
    lines: list[str] = field(default_factory=list)  # payload lines after this frame, unprefixed

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def parse(output: str, nonce: str) -> list[Frame]:
    head = f"{MARK}:{nonce} "
    frames: list[Frame] = []
    for line in output.split("\n"):
        if line.startswith(head):
            kind, *fields = line[len(head):].split(" ")
            frames.append(Frame(kind, fields))
        elif line.startswith("| ") and frames:
            frames[-1].lines.append(line[2:])
    return frames
