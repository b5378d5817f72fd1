#!/usr/bin/env python3
"""Real CUDA 13.0 compiler packages for the lab's NVIDIA apt stand-in, repackaged from NVIDIA's PyPI wheels.

    cuda13_debs.py OUTDIR [--wheels DIR] [--pip CMD] [--force]
    cuda13_debs.py --check OUTDIR      # exit 0 when OUTDIR holds a complete, up-to-date build; changes nothing

The lab's containers are offline and NVIDIA's repository is out of reach, but NVIDIA publishes the CUDA 13.0
compiler on PyPI: nvidia-cuda-nvcc (nvcc, cudafe++, ptxas, nvlink, fatbinary), nvidia-nvvm (cicc, libdevice),
nvidia-cuda-crt (crt/ headers), nvidia-cuda-cccl (CUB/Thrust/libcu++) and nvidia-cuda-runtime (cudart, the
runtime headers).  This script downloads those wheels (`pip download --no-deps --only-binary=:all:`, checked
against the sha256 pinned below; cached in --wheels, default $FLEETCUDA_LAB_ROOT/cuda13-wheels, i.e.
/var/lib/fleetcuda-lab/cuda13-wheels) and lays NVIDIA's own binaries and headers out as NVIDIA's .debs do:

    /usr/local/cuda-13.0/bin/{nvcc,nvcc.profile,cudafe++,ptxas,nvlink,fatbinary,bin2c,crt/*.stub}
    /usr/local/cuda-13.0/nvvm/{bin/cicc,libdevice/libdevice.10.bc,lib64/libnvvm.so*,include/nvvm.h}
    /usr/local/cuda-13.0/targets/x86_64-linux/{include,lib}    (include/cccl/ holds CUB, Thrust, libcu++)
    /usr/local/cuda-13.0/include -> targets/x86_64-linux/include
    /usr/local/cuda-13.0/lib64   -> targets/x86_64-linux/lib

Package names and versions are NVIDIA's (a set seen installed together from NVIDIA's repository: nvcc, crt and
nvvm 13.0.88, cudart and driver-dev 13.0.96, cccl 13.0.85, the config-common packages 13.0.96; the Debian
revision is NVIDIA's "-1").  The Depends modelled reproduce the set that apt installs from NVIDIA's repository
with cuda-nvcc-13-0 and cuda-cudart-dev-13-0, less what the wheels cannot fill (below); NVIDIA's exact Depends
lines were not at hand to copy, and the version bounds are ours, in the style of the 12.8 stand-ins:

    cuda-nvcc-13-0        -> cuda-cudart-13-0, cuda-cccl-13-0, cuda-crt-13-0, libnvvm-13-0
                             (not cuda-cudart-dev-13-0: a compile needs it too, so one installs both, and
                             not gcc/g++/build-essential: without a host compiler nvcc fails when it runs)
    cuda-cudart-dev-13-0  -> cuda-cudart-13-0, cuda-cccl-13-0, cuda-driver-dev-13-0
    cuda-cudart-13-0      -> cuda-toolkit-13-0-config-common, cuda-toolkit-13-config-common,
                             cuda-toolkit-config-common
    cuda-toolkit-13-0-config-common: the /usr/local/cuda and /usr/local/cuda-13 alternatives (priority 130)
    cuda-toolkit-13-config-common, cuda-toolkit-config-common: /etc/ld.so.conf.d entries
    cuda-cccl-13-0, cuda-crt-13-0, libnvvm-13-0, cuda-driver-dev-13-0: no Depends

NVIDIA's CUDA 13.0 repository names the NVVM package libnvvm-13-0, not cuda-nvvm-13-0.  Left out, because the
wheels do not hold them and nvcc compiles without them, though NVIDIA's packages bring them along:
libnvptxcompiler-13-0 (libnvptxcompiler_static.a), cuda-culibos-dev-13-0 (libculibos.a), and the libcuda.so
link stub of cuda-driver-dev-13-0 (lib/stubs/: `-lcuda` does not link here).

The debs are built with dpkg-deb into OUTDIR (swapped in whole), which then holds only them and the stamp
.fleetcuda-cuda13 (what they were built from: this script's sha256 and the wheels'), written last.  A second run
with the same script and wheels does nothing, unless --force.  The signed repository around them is made by
build_repo.sh, given FLEETCUDA_CUDA13_DEBS=OUTDIR.  Stdlib only; needs dpkg-deb and pip (the first run only).
Exit codes: 0 ok (or --check: up to date), 1 failure (or --check: not up to date), 2 usage, 3 a tool is
missing, 4 a wheel could not be fetched or does not match its pinned sha256.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

PROG = "cuda13_debs.py"
LAB = Path(os.environ.get("FLEETCUDA_LAB_ROOT", "/var/lib/fleetcuda-lab"))
STAMP = ".fleetcuda-cuda13"
MAINTAINER = "fleetcuda lab <lab@fleetcuda.invalid>"
PREFIX = "usr/local/cuda-13.0"
TARGET = f"{PREFIX}/targets/x86_64-linux"
WHEEL_ROOT = "nvidia/cu13/"  # where every CUDA 13 wheel keeps the toolkit's tree
NVCC, CUDART, CCCL = "13.0.88", "13.0.96", "13.0.85"


@dataclass(frozen=True)
class Wheel:
    project: str
    version: str
    filename: str
    sha256: str


# Pinned: nvidia-nvvm and nvidia-cuda-crt must be 13.0.88 too (nvcc's unpinned dependencies resolve to 13.5,
# whose cicc writes PTX that ptxas 13.0 rejects).
WHEELS = {
    "nvcc": Wheel("nvidia-cuda-nvcc", NVCC,
                  "nvidia_cuda_nvcc-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
                  "56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03"),
    "nvvm": Wheel("nvidia-nvvm", NVCC,
                  "nvidia_nvvm-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
                  "c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0"),
    "crt": Wheel("nvidia-cuda-crt", NVCC,
                 "nvidia_cuda_crt-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
                 "2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4"),
    "cccl": Wheel("nvidia-cuda-cccl", CCCL,
                  "nvidia_cuda_cccl-13.0.85-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
                  "e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649"),
    "runtime": Wheel("nvidia-cuda-runtime", CUDART,
                     "nvidia_cuda_runtime-13.0.96-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
                     "7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548"),
}

# The runtime wheel's driver-API headers, which NVIDIA's debs put in cuda-driver-dev, not cuda-cudart-dev.
DRIVER_HEADERS = {"cuda.h", "cudaEGL.h", "cudaEGLTypedefs.h", "cudaGL.h", "cudaGLTypedefs.h",
                  "cudaProfilerTypedefs.h", "cudaTypedefs.h", "cudaVDPAU.h", "cudaVDPAUTypedefs.h"}


@dataclass
class Package:
    name: str
    version: str
    summary: str
    depends: str = ""
    arch: str = "amd64"
    section: str = "devel"
    files: list[tuple[str, zipfile.ZipInfo, str]] = field(default_factory=list)  # (wheel key, member, dest)
    symlinks: dict[str, str] = field(default_factory=dict)  # dest -> target
    texts: dict[str, str] = field(default_factory=dict)  # dest -> content (small generated files)
    conffiles: list[str] = field(default_factory=list)
    scripts: dict[str, str] = field(default_factory=dict)  # postinst, prerm, triggers
    wheel: str | None = None  # whose License.txt becomes the copyright file

    @property
    def deb(self) -> str:
        return f"{self.name}_{self.version}_{self.arch}.deb"


ALTERNATIVES_POSTINST = """\
#!/bin/sh
set -e
if [ "$1" = configure ]; then
    update-alternatives --install /usr/local/cuda cuda /usr/local/cuda-13.0 130
    update-alternatives --install /usr/local/cuda-13 cuda-13 /usr/local/cuda-13.0 130
fi
"""
ALTERNATIVES_PRERM = """\
#!/bin/sh
set -e
if [ "$1" = remove ] || [ "$1" = deconfigure ]; then
    update-alternatives --remove cuda /usr/local/cuda-13.0
    update-alternatives --remove cuda-13 /usr/local/cuda-13.0
fi
"""


def packages() -> dict[str, Package]:
    """The packages, empty of files: name -> Package."""
    pkgs = [
        Package("cuda-toolkit-config-common", f"{CUDART}-1", "Common config package for CUDA Toolkit.",
                arch="all", section="misc",
                texts={"etc/ld.so.conf.d/000_cuda.conf": "/usr/local/cuda/targets/x86_64-linux/lib\n"},
                conffiles=["/etc/ld.so.conf.d/000_cuda.conf"], scripts={"triggers": "activate-noawait ldconfig\n"}),
        Package("cuda-toolkit-13-config-common", f"{CUDART}-1", "Common config package for CUDA Toolkit 13.",
                arch="all", section="misc",
                texts={"etc/ld.so.conf.d/988_cuda-13.conf": "/usr/local/cuda-13/targets/x86_64-linux/lib\n"},
                conffiles=["/etc/ld.so.conf.d/988_cuda-13.conf"], scripts={"triggers": "activate-noawait ldconfig\n"}),
        Package("cuda-toolkit-13-0-config-common", f"{CUDART}-1", "Common config package for CUDA Toolkit 13.0.",
                arch="all", section="misc",
                scripts={"postinst": ALTERNATIVES_POSTINST, "prerm": ALTERNATIVES_PRERM}),
        Package("cuda-cudart-13-0", f"{CUDART}-1", "CUDA Runtime native Libraries",
                "cuda-toolkit-13-0-config-common, cuda-toolkit-13-config-common, cuda-toolkit-config-common",
                symlinks={f"{PREFIX}/include": "targets/x86_64-linux/include",
                          f"{PREFIX}/lib64": "targets/x86_64-linux/lib",
                          f"{TARGET}/lib/libcudart.so.13": f"libcudart.so.{CUDART}"},
                scripts={"triggers": "activate-noawait ldconfig\n"}, wheel="runtime"),
        Package("cuda-driver-dev-13-0", f"{CUDART}-1", "CUDA Driver native dev stub library", wheel="runtime"),
        Package("cuda-cudart-dev-13-0", f"{CUDART}-1", "CUDA Runtime native dev links, headers",
                f"cuda-cudart-13-0 (>= {CUDART}), cuda-cccl-13-0 (>= {CCCL}), cuda-driver-dev-13-0 (>= {CUDART})",
                symlinks={f"{TARGET}/lib/libcudart.so": "libcudart.so.13"}, wheel="runtime"),
        Package("cuda-cccl-13-0", f"{CCCL}-1", "CUDA CCCL", wheel="cccl"),
        Package("cuda-crt-13-0", f"{NVCC}-1", "CUDA crt", wheel="crt"),
        Package("libnvvm-13-0", f"{NVCC}-1", "NVVM library and compiler",
                symlinks={f"{PREFIX}/nvvm/lib64/libnvvm.so": "libnvvm.so.4"}, wheel="nvvm"),
        Package("cuda-nvcc-13-0", f"{NVCC}-1", "CUDA nvcc",
                f"cuda-cudart-13-0 (>= {CUDART}), cuda-cccl-13-0 (>= {CCCL}), cuda-crt-13-0 (>= {NVCC}), "
                f"libnvvm-13-0 (>= {NVCC})", wheel="nvcc"),
    ]
    return {p.name: p for p in pkgs}


def place(key: str, rel: str) -> tuple[str, str] | None:
    """Where a wheel member (rel: its path under nvidia/cu13/) goes: (package, path in the package), or None."""
    if key == "nvcc":
        if rel.startswith("bin/"):
            return "cuda-nvcc-13-0", f"{PREFIX}/{rel}"
        if rel.startswith("include/"):
            return "cuda-nvcc-13-0", f"{TARGET}/{rel}"  # fatbinary_section.h
    elif key == "nvvm":
        if rel.startswith("nvvm/"):
            return "libnvvm-13-0", f"{PREFIX}/{rel}"  # bin/cicc, libdevice/
        if rel.startswith("lib/libnvvm.so"):
            return "libnvvm-13-0", f"{PREFIX}/nvvm/lib64/{rel[4:]}"
        if rel == "include/nvvm.h":
            return "libnvvm-13-0", f"{PREFIX}/nvvm/include/nvvm.h"
    elif key == "crt":
        if rel.startswith("include/crt/"):
            return "cuda-crt-13-0", f"{TARGET}/{rel}"
    elif key == "cccl":
        if rel.startswith(("include/", "lib/cmake/")):
            return "cuda-cccl-13-0", f"{TARGET}/{rel}"
    elif key == "runtime":
        if rel == "lib/libcudart.so.13":
            return "cuda-cudart-13-0", f"{TARGET}/lib/libcudart.so.{CUDART}"
        if rel.startswith("lib/"):
            return "cuda-cudart-dev-13-0", f"{TARGET}/{rel}"  # libcudart_static.a, libcudadevrt.a
        if rel.startswith("include/"):
            owner = "cuda-driver-dev-13-0" if rel[len("include/"):] in DRIVER_HEADERS else "cuda-cudart-dev-13-0"
            return owner, f"{TARGET}/{rel}"
    return None


# --- helpers -------------------------------------------------------------------------------------------

def fail(msg: str, code: int = 1) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr)
    raise SystemExit(code)


def digest(path: Path, algo: str = "sha256") -> str:
    h = hashlib.new(algo)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def want_stamp() -> str:
    lines = [f"script_sha256={digest(Path(__file__).resolve())}"]
    lines += [f"wheel={w.filename} sha256={w.sha256}" for w in WHEELS.values()]
    lines += [f"deb={p.deb}" for p in packages().values()]
    return "\n".join(lines) + "\n"


def up_to_date(outdir: Path) -> bool:
    try:
        if (outdir / STAMP).read_text() != want_stamp():
            return False
    except OSError:
        return False
    return all((outdir / p.deb).is_file() and (outdir / p.deb).stat().st_size > 0 for p in packages().values())


def fetch_wheels(cache: Path, pip: list[str]) -> dict[str, Path]:
    """Each pinned wheel, from the cache or downloaded into it, checked against its sha256."""
    cache.mkdir(parents=True, exist_ok=True)
    paths = {key: cache / w.filename for key, w in WHEELS.items()}
    missing = [key for key, path in paths.items() if not path.is_file() or digest(path) != WHEELS[key].sha256]
    if missing:
        with tempfile.TemporaryDirectory(prefix=".download.", dir=cache) as tmp:
            argv = [*pip, "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
                    "-q", "-d", tmp, *[f"{WHEELS[k].project}=={WHEELS[k].version}" for k in missing]]
            print(f"{PROG}: downloading {', '.join(WHEELS[k].project for k in missing)}", flush=True)
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
            except (OSError, subprocess.TimeoutExpired) as err:
                fail(f"{shlex.join(argv)}: {err}", 4)
            if proc.returncode != 0:
                fail(f"{shlex.join(argv)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}", 4)
            for key in missing:
                got = Path(tmp) / WHEELS[key].filename
                if not got.is_file():
                    fail(f"pip did not fetch {WHEELS[key].filename} (it has {sorted(os.listdir(tmp))})", 4)
                if digest(got) != WHEELS[key].sha256:
                    fail(f"{got.name}: sha256 {digest(got)}, expected {WHEELS[key].sha256}", 4)
                got.replace(paths[key])
    return paths


def collect(wheels: dict[str, Path]) -> tuple[dict[str, Package], dict[str, zipfile.ZipFile]]:
    pkgs = packages()
    zips = {key: zipfile.ZipFile(path) for key, path in wheels.items()}
    for key, zf in zips.items():
        for info in zf.infolist():
            if info.is_dir() or not info.filename.startswith(WHEEL_ROOT):
                continue  # dist-info
            rel = info.filename[len(WHEEL_ROOT):]
            if rel.startswith(".metadata/"):
                continue  # the wheel build's own scan logs, not part of the toolkit
            where = place(key, rel)
            if where is None:
                fail(f"{wheels[key].name}: no package for {info.filename}")
            pkgs[where[0]].files.append((key, info, where[1]))
    return pkgs, zips


def control(pkg: Package, size_kb: int) -> str:
    if pkg.wheel:
        wheel = WHEELS[pkg.wheel]
        origin = (f"It holds NVIDIA's own files from the PyPI wheel {wheel.project} {wheel.version}, laid out as "
                  "NVIDIA's package lays them.")
    else:
        origin = "It holds only configuration, modelled on NVIDIA's package."
    body = (f"fleetcuda lab stand-in for NVIDIA's {pkg.name} {pkg.version}, for testing provisioning in offline "
            f"containers; NVIDIA did not build this package (tests/lab/standins/apt/{PROG} did). {origin}")
    lines = [f"Package: {pkg.name}", f"Version: {pkg.version}", f"Architecture: {pkg.arch}",
             f"Maintainer: {MAINTAINER}", f"Installed-Size: {size_kb}"]
    if pkg.depends:
        lines.append(f"Depends: {pkg.depends}")
    lines += [f"Section: {pkg.section}", "Priority: optional",
              f"Description: {pkg.summary} (fleetcuda lab stand-in)"]
    lines += [f" {line}" for line in textwrap.wrap(body, 77, break_on_hyphens=False, break_long_words=False)]
    return "\n".join(lines) + "\n"


def build_deb(pkg: Package, zips: dict[str, zipfile.ZipFile], work: Path, outdir: Path) -> None:
    root = work / pkg.name
    (root / "DEBIAN").mkdir(parents=True)
    for key, info, dest in pkg.files:
        target = root / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        with zips[key].open(info) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        # Wheels mark executables 0744; a system prefix wants them usable by every user.
        target.chmod(0o755 if (info.external_attr >> 16) & stat.S_IXUSR else 0o644)
    for dest, content in pkg.texts.items():
        (root / dest).parent.mkdir(parents=True, exist_ok=True)
        (root / dest).write_text(content)
        (root / dest).chmod(0o644)
    for dest, link in pkg.symlinks.items():
        (root / dest).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(link, root / dest)
    if pkg.wheel:  # NVIDIA's debs carry the CUDA EULA as their copyright file; the wheels carry it too
        wheel = WHEELS[pkg.wheel]
        name = f"{wheel.project.replace('-', '_')}-{wheel.version}.dist-info/licenses/License.txt"
        doc = root / "usr/share/doc" / pkg.name / "copyright"
        doc.parent.mkdir(parents=True)
        doc.write_bytes(zips[pkg.wheel].read(name))
        doc.chmod(0o644)
    for path in root.rglob("*"):
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o755)
    # md5sums as debhelper writes them, so that `dpkg --verify` works.
    sums = []
    size = 0
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel == "DEBIAN" or rel.startswith("DEBIAN/"):
            continue
        if path.is_symlink() or path.is_dir():
            size += 1
        else:
            size += (path.stat().st_size + 1023) // 1024
            sums.append(f"{digest(path, 'md5')}  {rel}\n")
    (root / "DEBIAN/md5sums").write_text("".join(sums))
    (root / "DEBIAN/control").write_text(control(pkg, size))
    if pkg.conffiles:
        (root / "DEBIAN/conffiles").write_text("".join(f"{c}\n" for c in pkg.conffiles))
    for name, text in pkg.scripts.items():
        (root / "DEBIAN" / name).write_text(text)
        (root / "DEBIAN" / name).chmod(0o755 if name != "triggers" else 0o644)
    # gzip, not dpkg's default xz: a few seconds instead of minutes on a small machine; apt reads both.
    proc = subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-z6", "--build", str(root),
                           str(outdir / pkg.deb)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        fail(f"dpkg-deb --build {pkg.name} failed:\n{proc.stdout}{proc.stderr}")
    shutil.rmtree(root)


def build(outdir: Path, wheels: dict[str, Path]) -> None:
    pkgs, zips = collect(wheels)
    parent = outdir.parent
    stage = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.new.", dir=parent))
    old = parent / f".{outdir.name}.old.{os.getpid()}"
    try:
        work = stage / ".work"
        work.mkdir()
        for pkg in pkgs.values():
            build_deb(pkg, zips, work, stage)
        work.rmdir()
        (stage / STAMP).write_text(want_stamp())
        stage.chmod(0o755)
        if outdir.exists():
            outdir.rename(old)
        stage.rename(outdir)
    finally:
        for z in zips.values():
            z.close()
        if not outdir.exists() and old.exists():
            old.rename(outdir)
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    for pkg in pkgs.values():
        print(f"{PROG}: {pkg.deb} {(outdir / pkg.deb).stat().st_size / 1e6:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", type=Path, help="where the .debs go (a directory of their own)")
    parser.add_argument("--check", action="store_true", help="only say whether OUTDIR is up to date (exit 0/1)")
    parser.add_argument("--wheels", type=Path, default=LAB / "cuda13-wheels", help="wheel cache (default %(default)s)")
    parser.add_argument("--pip", default=f"{shlex.quote(sys.executable)} -m pip",
                        help="pip command line to download with (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args()
    outdir = args.outdir.absolute()
    if args.check:
        raise SystemExit(0 if up_to_date(outdir) else 1)
    if shutil.which("dpkg-deb") is None:
        fail("missing tool: dpkg-deb (Debian package dpkg)", 3)
    os.umask(0o022)
    outdir.parent.mkdir(parents=True, exist_ok=True)
    with open(outdir.parent / f".{outdir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two builds at once would race on the swap
        if not args.force and up_to_date(outdir):
            print(f"{PROG}: {outdir} is up to date; nothing to do")
            return
        wheels = fetch_wheels(args.wheels.absolute(), shlex.split(args.pip))
        build(outdir, wheels)
    print(f"{PROG}: built {outdir}")


if __name__ == "__main__":
    main()
