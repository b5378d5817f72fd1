"""ABI fingerprints: what a compiled extension's wheel was built against, and whether a target still matches.

Pure (no I/O here): what the control machine does with the answers of the program that runs on the target
(fleetcuda/remote/fingerprint.py), which reports in frames (see fleetcuda.remote.framing).
A wheel built on one target installs on another only when every field is equal. Versions are compared at the
level that changes the binary: Python major.minor plus its SOABI, nvcc's release (12.8, not the patch build),
torch's full version (a torch upgrade breaks its C++ symbols).
"""

from __future__ import annotations

import hashlib
import json
import re

from fleetcuda.remote import framing, program

KEPT_WHEEL = re.compile(r"/tmp/fleetcuda-wheel\.[A-Za-z0-9]{6}/[A-Za-z0-9_.+-]+\.whl")
SHA256 = re.compile(r"[0-9a-f]{64}")

# In the order they are shown (the target program, fleetcuda/remote/fingerprint.py, has the same tuple).
FIELDS = ("package", "version", "python", "abi", "platform", "glibc", "torch", "torch_cuda", "cxx11_abi", "nvcc",
          "archs")

# Runs on the target (its text on stdin, see remote.python_heredoc) with the step's environment (CUDA_HOME);
# its modes are described in the file.
TARGET_PROGRAM = program("fingerprint").text


def key(fingerprint: dict[str, str]) -> str:
    """A short stable name for a fingerprint: the cache's directory and what logs show."""
    canonical = json.dumps({k: fingerprint.get(k) for k in FIELDS}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _frames(output: str, nonce: str | None) -> list[framing.Frame]:
    # Without a nonce: any this process put into a command (the engine's callers pass none).
    return framing.parse(output, nonce) if nonce is not None else framing.parse_issued(output)


def parse(output: str, nonce: str | None = None) -> dict[str, str] | None:
    """The fingerprint a target reported (the last one, in a `fingerprint` frame), or None if it reported none."""
    found = None
    for r in framing.records(_frames(output, nonce)):
        if isinstance(r, framing.FingerprintRecord) and all(isinstance(r.fingerprint.get(k), str) for k in FIELDS):
            found = {k: r.fingerprint[k] for k in FIELDS}
    return found


def parse_wheel(output: str, nonce: str | None = None) -> tuple[str, str] | None:
    """(path in the target, sha256) of the wheel a build left for the control machine to fetch (its `wheel`
    frame)."""
    found = None
    for r in framing.records(_frames(output, nonce)):
        # Only where the build script puts it: the path is later removed with rm -rf.
        if isinstance(r, framing.WheelRecord) and KEPT_WHEEL.fullmatch(r.path) and SHA256.fullmatch(r.sha256):
            found = (r.path, r.sha256)
    return found


def describe(fingerprint: dict[str, str]) -> str:
    f = fingerprint
    return (f"{f['package']} {f['version']} for Python {f['python']} ({f['abi']}, glibc {f['glibc']}), "
            f"torch {f['torch']} (CUDA {f['torch_cuda']}, cxx11 ABI {f['cxx11_abi']}), nvcc {f['nvcc']}, "
            f"archs {f['archs']}")
