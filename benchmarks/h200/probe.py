"""The least work that answers `fleetcuda verify recipes/gdn-fastpath.yaml`'s questions on a local GPU machine,
in one Python process: the floor verify is measured against (benchmarks/h200/run.sh, docs/benchmarks.md).

    python3 benchmarks/h200/probe.py CUDA_X.Y

Each question the recipe's steps ask, asked once, with no framing, no report, no per-check process: the host
driver and the user-space libraries (gpu-passthrough), what preflight and host-toolchain look at (torch and its
CUDA, free disk, gcc/g++ within nvcc's bound, Python.h), nvcc's release (cuda-compiler, torch-matches-nvcc),
CUDA_HOME's profile file (cuda-home), the versions of build-deps, causal-conv1d and fla-core, and then the
fast-path gate itself: fleetcuda's own remote/fast_path_gate.py, run in this process (its two kernels and
transformers' gate for qwen3_5, qwen3_5_moe and qwen3_next). Prints one line per question; exit 1 if any fails.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata as md
import re
import runpy
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
failed: list[str] = []


def say(ok: bool, what: str) -> None:
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failed.append(what)


def version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def main(cuda: str) -> int:
    home = f"/usr/local/cuda-{cuda}"
    driver = Path("/proc/driver/nvidia/version")
    text = driver.read_text() if driver.exists() else subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
        text=True).stdout
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", text)
    say(bool(m) and int(m.group(1).split(".")[0]) >= 580, f"driver {m.group(1) if m else '?'} (CUDA 13 needs 580)")
    say(ctypes.util.find_library("cuda") is not None and ctypes.util.find_library("nvidia-ml") is not None,
        "libcuda and libnvidia-ml found")
    import torch

    say((torch.version.cuda or "").split(".")[0] == cuda.split(".")[0], f"torch {torch.__version__} CUDA "
        f"{torch.version.cuda}")
    for path in ("/tmp", "/usr/local", sys.prefix):
        say(shutil.disk_usage(path).free // 2**20 >= 3000, f"free space on {path}")
    for cc in ("gcc", "g++"):
        exe = shutil.which(cc)
        out = subprocess.run([exe, "-dumpfullversion"], capture_output=True, text=True).stdout if exe else ""
        say(bool(exe) and 0 < int(out.split(".")[0] or "0") <= 14, f"{cc} {out.strip()}")
    say(Path(sysconfig.get_paths()["include"], "Python.h").exists(), "Python.h")
    nvcc = subprocess.run([f"{home}/bin/nvcc", "--version"], capture_output=True, text=True).stdout
    say(f"release {cuda}," in nvcc and Path(home, "include", "cuda_runtime.h").exists(), f"nvcc {cuda} at {home}")
    profile = Path("/etc/profile.d/cuda-home.sh")
    say(profile.exists() and f"CUDA_HOME={home}" in profile.read_text(), "CUDA_HOME in /etc/profile.d")
    for name in ("wheel", "setuptools", "packaging", "ninja"):
        say(version(name) is not None, f"{name} {version(name)}")
    say(version("causal-conv1d") == "1.7.0", f"causal-conv1d {version('causal-conv1d')}")
    say(version("fla-core") == "0.6.0", f"fla-core {version('fla-core')}")
    # build-deps' imports, then the two packages' (the gate imports them again: already loaded)
    import causal_conv1d  # noqa: F401
    import fla  # noqa: F401
    import packaging  # noqa: F401
    import setuptools  # noqa: F401
    import wheel  # noqa: F401
    sys.argv = ["fast_path_gate.py"]
    try:
        runpy.run_path(str(REPO / "fleetcuda" / "remote" / "fast_path_gate.py"), run_name="__main__")
    except SystemExit as exc:
        say(exc.code in (0, None), "fast path gate")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "13.0"))
