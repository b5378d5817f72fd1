"""The Python side of the framing protocol (fleetcuda.remote.framing), for programs that run on targets.

Programs there cannot import fleetcuda, so each one that reports records carries a copy of the block below,
between its marker lines (tests keep every copy equal to this file's). The shell that starts the program
hands it the run's nonce in FLEETCUDA_NONCE, for that one process; `take_nonce` removes it from the
environment, so no subprocess the program starts (nvcc, a compiler) inherits it.
"""

import json
import os
import sys

# >>> fleetcuda frame emitter
_NONCE = ""


def take_nonce():
    """Read (and remove from the environment) the nonce the shell gave this program."""
    global _NONCE
    _NONCE = os.environ.pop("FLEETCUDA_NONCE", "")
    return _NONCE


def emit(kind, *fields):
    """Print one frame line `@@fleetcuda:<nonce> <kind> <fields...>`. No field holds whitespace, so nothing a
    field carries (a version string, a path) can start a line of its own, let alone a frame."""
    if not _NONCE:
        sys.exit("fleetcuda: no frame nonce (FLEETCUDA_NONCE): this program reports to fleetcuda only")
    for field in (kind, *fields):
        if not field or any(c.isspace() for c in field):
            raise ValueError(f"a frame field must be a non-empty word: {field!r}")
    sys.stdout.write(f"\n@@fleetcuda:{_NONCE} {' '.join((kind, *fields))}\n")
    sys.stdout.flush()


def emit_json(kind, value):
    """One frame whose one field is `value` as JSON: ASCII only, no whitespace (a space is \\u0020)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    emit(kind, text.replace(" ", "\\u0020"))
# <<< fleetcuda frame emitter
