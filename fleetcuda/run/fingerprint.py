"""ABI fingerprints: what a compiled extension's wheel was built against, and whether a target still matches.

Pure (no I/O here): the program that runs on the target, and what the control machine does with its answers.
A wheel built on one target installs on another only when every field is equal. Versions are compared at the
level that changes the binary: Python major.minor plus its SOABI, nvcc's release (12.8, not the patch build),
torch's full version (a torch upgrade breaks its C++ symbols).
"""

from __future__ import annotations

import hashlib
import json
import re

FINGERPRINT_MARK = "@@fleetcuda-fingerprint"
WHEEL_MARK = "@@fleetcuda-wheel"
KEPT_WHEEL = re.compile(r"/tmp/fleetcuda-wheel\.[A-Za-z0-9]{6}/[A-Za-z0-9_.+-]+\.whl")

# In the order they are shown.
FIELDS = ("package", "version", "python", "abi", "platform", "glibc", "torch", "torch_cuda", "cxx11_abi", "nvcc",
          "archs")

# Runs on the target as `python -c PROGRAM MODE PACKAGE VERSION ARCHS [ARG]`, with the step's environment (CUDA_HOME).
#   show                 print the fingerprint
#   matches FP_JSON      exit 1, naming the differences, unless this target's fingerprint is FP_JSON
#   record PROVENANCE    write the build record (fingerprint + where the wheel came from) for the installed package
#   compare              exit 1 if the build record's fingerprint no longer matches this target (stale build)
TARGET_PROGRAM = r'''import json, os, platform, re, shutil, subprocess, sys, sysconfig, time
mode, package, version, archs = sys.argv[1:5]
arg = sys.argv[5] if len(sys.argv) > 5 else ""
MARK = "@@fleetcuda-fingerprint"
FIELDS = @FIELDS@


def nvcc_release():
    home = os.environ.get("CUDA_HOME")
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not os.access(nvcc, os.X_OK):
        return "none"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120).stdout
    except OSError:
        return "none"
    m = re.search(r"release (\d+\.\d+),", out)
    return m.group(1) if m else "unknown"


def fingerprint():
    import torch
    libc, libc_version = platform.libc_ver()
    return {
        "package": package, "version": version,
        "python": "%d.%d" % sys.version_info[:2],
        "abi": sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag,
        "platform": sysconfig.get_platform(),
        "glibc": libc_version if libc == "glibc" else (libc or "none"),
        "torch": torch.__version__,
        "torch_cuda": str(getattr(torch.version, "cuda", None) or "none"),
        "cxx11_abi": str(int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", False)))),
        "nvcc": nvcc_release(),
        "archs": archs,
    }


def differences(built, now):
    return ["%s %s -> %s" % (k, built.get(k, "?"), now.get(k, "?")) for k in FIELDS if built.get(k) != now.get(k)]


def record_path():
    root = os.environ.get("FLEETCUDA_BUILD_RECORDS") or (
        "/var/lib/fleetcuda/builds" if os.geteuid() == 0 else os.path.expanduser("~/.local/state/fleetcuda/builds"))
    # One record per package and environment (a container may hold several venvs).
    return os.path.join(root, package + "@" + (sys.prefix.strip("/").replace("/", "_") or "root") + ".json")


now = fingerprint()
if mode == "show":
    print(MARK, json.dumps(now, sort_keys=True))
elif mode == "matches":
    diff = differences(json.loads(arg), now)
    if diff:
        sys.exit("fleetcuda: the wheel was built for another ABI than this target's: " + "; ".join(diff))
elif mode == "record":
    path = record_path()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    record = {"fingerprint": now, "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "python": sys.executable, **json.loads(arg)}
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(record, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)
    print(MARK, json.dumps(now, sort_keys=True))
elif mode == "compare":
    try:
        with open(record_path()) as fh:
            built = json.load(fh)["fingerprint"]
    except FileNotFoundError:
        print(f"no build record for {package} here (installed without fleetcuda): its ABI fingerprint is not checked")
        sys.exit(0)
    diff = differences(built, now)
    if diff:
        print("stale build: %s %s was built for another ABI: %s" % (package, built.get("version"), "; ".join(diff)))
        sys.exit(1)
    print("%s %s was built for this ABI (torch %s, CUDA %s, nvcc %s, %s)" % (
        package, built.get("version"), now["torch"], now["torch_cuda"], now["nvcc"], now["abi"]))
else:
    sys.exit("fleetcuda: unknown mode " + mode)
'''.replace("@FIELDS@", repr(FIELDS))


def key(fingerprint: dict[str, str]) -> str:
    """A short stable name for a fingerprint: the cache's directory and what logs show."""
    canonical = json.dumps({k: fingerprint.get(k) for k in FIELDS}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def parse(output: str) -> dict[str, str] | None:
    """The fingerprint a target printed (the last one), or None if it printed none."""
    found = None
    for line in output.splitlines():
        if line.startswith(FINGERPRINT_MARK + " "):
            try:
                data = json.loads(line[len(FINGERPRINT_MARK) + 1:])
            except json.JSONDecodeError:
                continue
            if isinstance(data, dict) and all(isinstance(data.get(k), str) for k in FIELDS):
                found = {k: data[k] for k in FIELDS}
    return found


def parse_wheel(output: str) -> tuple[str, str] | None:
    """(path in the target, sha256) of the wheel a build left for the control machine to fetch."""
    found = None
    for line in output.splitlines():
        parts = line.split()
        # Only where the build script puts it: the path is later removed with rm -rf.
        if len(parts) == 3 and parts[0] == WHEEL_MARK and KEPT_WHEEL.fullmatch(parts[1]) \
                and re.fullmatch(r"[0-9a-f]{64}", parts[2]):
            found = (parts[1], parts[2])
    return found


def describe(fingerprint: dict[str, str]) -> str:
    f = fingerprint
    return (f"{f['package']} {f['version']} for Python {f['python']} ({f['abi']}, glibc {f['glibc']}), "
            f"torch {f['torch']} (CUDA {f['torch_cuda']}, cxx11 ABI {f['cxx11_abi']}), nvcc {f['nvcc']}, "
            f"archs {f['archs']}")
