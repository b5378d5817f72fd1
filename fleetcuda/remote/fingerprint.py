"""The ABI fingerprint of a target, run there by fleetcuda (see fleetcuda/run/fingerprint.py).

    python - MODE PACKAGE VERSION ARCHS [ARG]   (this file on stdin), with the step's environment (CUDA_HOME)

    show                 report the fingerprint (a `fingerprint` frame; plain JSON when run by hand, without
                         FLEETCUDA_NONCE)
    matches FP_JSON      exit 1, naming the differences, unless this target's fingerprint is FP_JSON
    record PROVENANCE    write the build record (fingerprint + where the wheel came from) for the installed
                         package, then report the fingerprint
    compare              exit 1 if the build record's fingerprint no longer matches this target (stale build)
"""

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import time

# In the order they are shown; the same as fleetcuda.run.fingerprint.FIELDS (a test keeps them equal).
FIELDS = ("package", "version", "python", "abi", "platform", "glibc", "torch", "torch_cuda", "cxx11_abi", "nvcc",
          "archs")


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


def nvcc_release():
    home = os.environ.get("CUDA_HOME")
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not os.access(nvcc, os.X_OK):
        return "none"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return "none"
    m = re.search(r"release (\d+\.\d+),", out)
    return m.group(1) if m else "unknown"


def fingerprint(package, version, archs):
    import torch

    libc, libc_version = platform.libc_ver()
    return {
        "package": package, "version": version,
        "python": "{}.{}".format(*sys.version_info[:2]),
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
    return [f"{k} {built.get(k, '?')} -> {now.get(k, '?')}" for k in FIELDS if built.get(k) != now.get(k)]


def record_path(package):
    root = os.environ.get("FLEETCUDA_BUILD_RECORDS") or (
        "/var/lib/fleetcuda/builds" if os.geteuid() == 0 else os.path.expanduser("~/.local/state/fleetcuda/builds"))
    # One record per package and environment (a container may hold several venvs).
    return os.path.join(root, package + "@" + (sys.prefix.strip("/").replace("/", "_") or "root") + ".json")


def report(now):
    """To fleetcuda in a frame; run by hand (no nonce), as plain JSON, which no parser takes for a report."""
    if _NONCE:
        emit_json("fingerprint", now)
    else:
        print(json.dumps(now, sort_keys=True))


def main(argv):
    take_nonce()
    if len(argv) < 4:
        sys.exit("fleetcuda: usage: fingerprint MODE PACKAGE VERSION ARCHS [ARG]")
    mode, package, version, archs = argv[:4]
    arg = argv[4] if len(argv) > 4 else ""
    now = fingerprint(package, version, archs)
    if mode == "show":
        report(now)
    elif mode == "matches":
        diff = differences(json.loads(arg), now)
        if diff:
            sys.exit("fleetcuda: the wheel was built for another ABI than this target's: " + "; ".join(diff))
    elif mode == "record":
        path = record_path(package)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        record = {"fingerprint": now, "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "python": sys.executable, **json.loads(arg)}
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
        report(now)
    elif mode == "compare":
        try:
            with open(record_path(package)) as fh:
                built = json.load(fh)["fingerprint"]
        except FileNotFoundError:
            print(f"no build record for {package} here (installed without fleetcuda): its ABI fingerprint is not "
                  "checked")
            return 0
        diff = differences(built, now)
        if diff:
            print(f"stale build: {package} {built.get('version')} was built for another ABI: {'; '.join(diff)}")
            return 1
        print(f"{package} {built.get('version')} was built for this ABI (torch {now['torch']}, CUDA "
              f"{now['torch_cuda']}, nvcc {now['nvcc']}, {now['abi']})")
    else:
        sys.exit("fleetcuda: unknown mode " + mode)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
