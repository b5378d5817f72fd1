"""The real CUDA 13.0 compiler in the lab's NVIDIA apt stand-in (tests/lab/standins/apt/cuda13_debs.py).

cuda13_debs.py repackages NVIDIA's CUDA 13.0 wheels from PyPI as NVIDIA's .debs (cuda-nvcc-13-0 and what it
needs); build_repo.sh serves them in place of the 13-0 placeholders when FLEETCUDA_CUDA13_DEBS names them.
These tests build both, install cuda-nvcc-13-0 and cuda-cudart-dev-13-0 with apt in a copy of the lab's
Debian 12 base (offline, no host compiler, see test_standin_apt.py), and check what fleetcuda and a
CUDA extension build rely on: nvcc's version, NVIDIA's layout of the headers, and nvcc's own failure when
there is no host compiler (which the 12.8 stand-in nvcc must repeat word for word).

The wheels (about 105 MB) are downloaded once into $FLEETCUDA_LAB_ROOT/cuda13-wheels and the debs built once
into $FLEETCUDA_LAB_ROOT/cuda13-debs (or $FLEETCUDA_CUDA13_DEBS); later runs reuse both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import test_standin_apt
from tests.test_standin_apt import (
    APT,
    KEYRING_DEB,
    NVCC_VERSION,
    SUBDIR,
    Container,
    container,
    ensure_debs,
    need_root,
    run,
    script_needs,
    unavailable,
)

# The Debian 12 base root filesystem of test_standin_apt.py (the lab's, via $FLEETCUDA_TEST_ROOTFS).
base_rootfs = test_standin_apt.base_rootfs

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests/lab/standins/apt/cuda13_debs.py"
BUILD_REPO = ROOT / "tests/lab/standins/apt/build_repo.sh"
LAB = Path(os.environ.get("FLEETCUDA_LAB_ROOT", "/var/lib/fleetcuda-lab"))
DEBS_DIR = Path(os.environ.get("FLEETCUDA_CUDA13_DEBS") or LAB / "cuda13-debs")
WHEELS_DIR = LAB / "cuda13-wheels"
CUDA = "/usr/local/cuda-13.0"
INCLUDE = f"{CUDA}/targets/x86_64-linux/include"

# Package -> (Version, Architecture, Depends), as cuda13_debs.py models NVIDIA's.
PACKAGES = {
    "cuda-nvcc-13-0": ("13.0.88-1", "amd64", "cuda-cudart-13-0 (>= 13.0.96), cuda-cccl-13-0 (>= 13.0.85), "
                       "cuda-crt-13-0 (>= 13.0.88), libnvvm-13-0 (>= 13.0.88)"),
    "cuda-crt-13-0": ("13.0.88-1", "amd64", ""),
    "libnvvm-13-0": ("13.0.88-1", "amd64", ""),
    "cuda-cudart-dev-13-0": ("13.0.96-1", "amd64", "cuda-cudart-13-0 (>= 13.0.96), cuda-cccl-13-0 (>= 13.0.85), "
                             "cuda-driver-dev-13-0 (>= 13.0.96)"),
    "cuda-cudart-13-0": ("13.0.96-1", "amd64", "cuda-toolkit-13-0-config-common, cuda-toolkit-13-config-common, "
                         "cuda-toolkit-config-common"),
    "cuda-driver-dev-13-0": ("13.0.96-1", "amd64", ""),
    "cuda-cccl-13-0": ("13.0.85-1", "amd64", ""),
    "cuda-toolkit-13-0-config-common": ("13.0.96-1", "all", ""),
    "cuda-toolkit-13-config-common": ("13.0.96-1", "all", ""),
    "cuda-toolkit-config-common": ("13.0.96-1", "all", ""),
}
DEBS = {f"{name}_{version}_{arch}.deb": name for name, (version, arch, _) in PACKAGES.items()}

TINY_CU = "__global__ void twice(float *x) { x[threadIdx.x] *= 2.0f; }\nint main() { return 0; }\n"
# What NVIDIA's nvcc 13.0.88 prints on stderr, and nothing else, when its host compiler is not there.
NO_HOST_COMPILER = "{cc}: No such file or directory\nnvcc fatal   : Failed to preprocess host compiler properties.\n"


def build_debs() -> subprocess.CompletedProcess[str]:
    return run([sys.executable, str(SCRIPT), str(DEBS_DIR), "--wheels", str(WHEELS_DIR)], timeout=900)


@pytest.fixture(scope="module")
def debs() -> Path:
    """DEBS_DIR, built (or found up to date) by cuda13_debs.py."""
    need_root("building the CUDA 13.0 debs into the lab's directory")
    ensure_debs(["dpkg", "python3"], "building the CUDA 13.0 debs")
    result = build_debs()
    if result.returncode == 4:  # the wheels could not be had: PyPI out of reach, or a mirror without them
        unavailable(f"cuda13_debs.py could not fetch NVIDIA's CUDA 13.0 wheels:\n{result.stdout[-3000:]}")
    assert result.returncode == 0, result.stdout
    return DEBS_DIR


@pytest.fixture(scope="module")
def repo(debs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The apt stand-in with the real 13-0 packages, for the lab's default URL."""
    ensure_debs(script_needs(), "building the apt stand-in")
    outdir = tmp_path_factory.mktemp("apt-cuda13")
    result = run(["bash", str(BUILD_REPO), str(outdir)], env={**os.environ, "FLEETCUDA_CUDA13_DEBS": str(debs)})
    assert result.returncode == 0, result.stdout
    return outdir


@pytest.fixture(scope="module")
def installed(base_rootfs: Path, repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """One offline container where apt installed cuda-nvcc-13-0 + cuda-cudart-dev-13-0 (and the 12.8 stand-in)."""
    steps: dict[str, subprocess.CompletedProcess[str]] = {}
    with container(base_rootfs, repo, tmp_path_factory.mktemp("cuda13")) as box:
        box.put(repo / SUBDIR / KEYRING_DEB, "/tmp")
        steps["keyring"] = box.sh(f"{APT} install -y /tmp/{KEYRING_DEB} && {APT} update")
        steps["install"] = box.sh(f"{APT} install -y --no-install-recommends cuda-nvcc-13-0 cuda-cudart-dev-13-0")
        steps["install-12.8"] = box.sh(f"{APT} install -y --no-install-recommends cuda-nvcc-12-8")
        (box.root / "tmp/twice.cu").write_text(TINY_CU)
        yield box, steps


def installed_ok(installed) -> Container:
    box, steps = installed
    for step in ("keyring", "install"):
        assert steps[step].returncode == 0, f"{step}:\n{steps[step].stdout}"
    return box


# --- the debs ---------------------------------------------------------------------------------------

def test_debs_names_versions_depends(debs: Path) -> None:
    assert sorted(p.name for p in debs.glob("*.deb")) == sorted(DEBS)
    for filename, name in DEBS.items():
        version, arch, depends = PACKAGES[name]
        fields = run(["dpkg-deb", "-f", str(debs / filename), "Package", "Version", "Architecture", "Depends"]).stdout
        want = f"Package: {name}\nVersion: {version}\nArchitecture: {arch}\n"
        assert fields == want + (f"Depends: {depends}\n" if depends else ""), filename


def test_debs_rebuild_is_a_no_op(debs: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in debs.iterdir()}
    again = build_debs()
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in debs.iterdir()} == before
    assert run([sys.executable, str(SCRIPT), "--check", str(debs)]).returncode == 0


def test_repo_serves_the_real_13_0(repo: Path, debs: Path) -> None:
    index = (repo / SUBDIR / "Packages").read_text()
    for filename in DEBS:
        assert f"Filename: ./{filename}\n" in index, filename
        assert (repo / SUBDIR / filename).read_bytes() == (debs / filename).read_bytes()
    # The 12.8 stand-ins stay as they were.
    assert "Filename: ./cuda-nvcc-12-8_12.8.93-1_amd64.deb\n" in index
    assert f"cuda13={debs.resolve()} sha256=" in (repo / SUBDIR / ".fleetcuda-build").read_text()


# --- installed in the container ---------------------------------------------------------------------

def test_apt_installs_the_dependency_closure(installed) -> None:
    box = installed_ok(installed)
    for name in PACKAGES:
        status = box.sh(f"dpkg-query -W -f='${{db:Status-Abbrev}} ${{Version}}' {name}").stdout
        assert status == f"ii  {PACKAGES[name][0]}", f"{name}: {status}"
    verify = box.sh(f"dpkg --verify {' '.join(PACKAGES)}")
    assert (verify.returncode, verify.stdout) == (0, "")
    # The newest toolkit is /usr/local/cuda, as NVIDIA's alternatives make it; the runtime is on ld.so's path.
    assert box.sh("readlink -f /usr/local/cuda /usr/local/cuda-13").stdout == f"{CUDA}\n{CUDA}\n"
    assert "libcudart.so.13 " in box.sh("ldconfig -p").stdout


def test_nvcc_version(installed) -> None:
    box = installed_ok(installed)
    for nvcc in (f"{CUDA}/bin/nvcc", "/usr/local/cuda/bin/nvcc"):
        result = box.sh(f"{nvcc} --version")
        assert (result.returncode, result.stdout) == (0, NVCC_VERSION["13.0"]), nvcc
    assert "release 13.0, V13.0.88" in NVCC_VERSION["13.0"]
    assert box.sh(f'{CUDA}/bin/nvcc --version | grep -q "release 13.0,"').returncode == 0  # fleetcuda's check
    # The rest of the compiler is NVIDIA's too, and runs in the container.
    assert "V13.0.88" in box.sh(f"{CUDA}/bin/ptxas --version").stdout
    assert box.sh(f"test -x {CUDA}/nvvm/bin/cicc && test -s {CUDA}/nvvm/libdevice/libdevice.10.bc").returncode == 0


def test_no_host_compiler_fails_as_nvcc_does(installed) -> None:
    box = installed_ok(installed)
    present = box.sh("command -v gcc g++ cc c++ || true").stdout
    assert present == "", f"the base root filesystem has a host compiler, the test needs none: {present}"
    compile_it = "cd /tmp && {nvcc} {flags} -c twice.cu -o twice.o 2>err >out; echo $?; cat out; cat err"
    for flags, cc in (("", "gcc"), ("-ccbin g++", "g++"), ("--compiler-bindir=/usr/bin", "/usr/bin/gcc")):
        real = box.sh(compile_it.format(nvcc=f"{CUDA}/bin/nvcc", flags=flags))
        assert real.stdout == "1\n" + NO_HOST_COMPILER.format(cc=cc), (flags, real.stdout)
        assert box.sh("test -e /tmp/twice.o").returncode != 0
        # The 12.8 stand-in's nvcc says the same, word for word.
        assert installed[1]["install-12.8"].returncode == 0, installed[1]["install-12.8"].stdout
        standin = box.sh(compile_it.format(nvcc="/usr/local/cuda-12.8/bin/nvcc", flags=flags))
        assert standin.stdout == real.stdout, (flags, standin.stdout)


def test_headers_where_nvidia_puts_them(installed) -> None:
    box = installed_ok(installed)
    # include and lib64 are links into targets/x86_64-linux, as in NVIDIA's packages.
    links = box.sh(f"readlink {CUDA}/include {CUDA}/lib64").stdout
    assert links == "targets/x86_64-linux/include\ntargets/x86_64-linux/lib\n"
    owners = {
        "cuda_runtime.h": "cuda-cudart-dev-13-0",
        "cuda_runtime_api.h": "cuda-cudart-dev-13-0",
        "cuda.h": "cuda-driver-dev-13-0",
        "crt/host_config.h": "cuda-crt-13-0",
        "fatbinary_section.h": "cuda-nvcc-13-0",
        "cccl/cub/cub.cuh": "cuda-cccl-13-0",
        "cccl/thrust/version.h": "cuda-cccl-13-0",
        "cccl/cuda/std/version": "cuda-cccl-13-0",
        "cccl/nv/target": "cuda-cccl-13-0",
    }
    for header, package in owners.items():
        assert box.sh(f"test -f {INCLUDE}/{header} && test -f {CUDA}/include/{header}").returncode == 0, header
        assert box.sh(f"dpkg -S {INCLUDE}/{header}").stdout == f"{package}: {INCLUDE}/{header}\n", header
    # NVIDIA's headers, not placeholders.
    assert box.sh(f"grep -q '#define CUB_VERSION' {INCLUDE}/cccl/cub/version.cuh").returncode == 0
    assert box.sh(f"grep -q 'CUDART_VERSION  *13000' {INCLUDE}/cuda_runtime_api.h").returncode == 0
    # nvcc's profile adds include/cccl as a system include directory (CUDA 13 moved CCCL there).
    assert "$(TOP)/$(_TARGET_DIR_)/include/cccl" in box.sh(f"cat {CUDA}/bin/nvcc.profile").stdout
    assert box.sh(f"readlink -f {CUDA}/lib64/libcudart.so").stdout == (
        f"{CUDA}/targets/x86_64-linux/lib/libcudart.so.13.0.96\n")
