"""The lab wheelhouse (tests/lab/standins/python/build_wheelhouse.py): its stand-ins, and the failure chain a
container walks when it builds causal-conv1d from the sdist, step by step, in a fresh Python 3.11 venv.

Every pip run in a venv is offline (--no-index, pip config files ignored) and goes through a socket guard that fails
the test if anything, pip or a stand-in, tries to open a network connection.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "lab" / "standins" / "python" / "build_wheelhouse.py"
STANDINS = {
    "torch-2.11.0+cu128-py3-none-any.whl",
    "torch-2.11.0+cu130-py3-none-any.whl",
    "fla_core-0.6.0-py3-none-any.whl",
    "causal_conv1d-1.7.0.tar.gz",
}
DOWNLOADED = ("wheel", "setuptools", "packaging", "ninja", "einops")
NO_DRIVER = "Found no NVIDIA driver on your system"
NVCC_WARNING = (
    "nvcc was not found.  Are you sure your environment has nvcc available?  If you're installing within a container "
    "from https://hub.docker.com/r/pytorch/pytorch, only images whose names contain 'devel' will provide nvcc."
)
ABI_BREAK = "causal_conv1d_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEab"
NINJA_FALLBACK = "Falling back to using the slow distutils backend."

# Loaded through PYTHONPATH into every Python the chain starts (pip, its build backend, the stand-ins).
NETGUARD = '''\
import os
import socket


def _blocked(*args, **kwargs):
    with open(os.environ["STANDIN_NETGUARD_LOG"], "a") as fh:
        fh.write(f"{os.getpid()} {args[1:3]!r}\\n")
    raise OSError("network access blocked by tests/test_standin_wheelhouse.py")


socket.socket.connect = _blocked
socket.socket.connect_ex = _blocked
socket.getaddrinfo = _blocked
socket.create_connection = _blocked
'''


def fail_or_skip(reason: str) -> NoReturn:
    """Skip when something outside the repo is missing, except under CI, where that would hide lost coverage."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def build(outdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(outdir), *args], capture_output=True, text=True, timeout=600
    )


def fake_cuda_home(root: Path, release: str, build: str, headers: bool = True, cudart: bool = True) -> Path:
    """A CUDA_HOME whose bin/nvcc only answers -V / --version, as the real one prints it; with headers, cudart's
    cuda_runtime.h only, as the lab's apt stand-in of cuda-cudart-dev ships it (the real one has cuda_runtime_api.h
    and the rest too); with cudart, lib64/libcudart.so for the link."""
    nvcc = root / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    if headers:
        (root / "include").mkdir()
        (root / "include" / "cuda_runtime.h").write_text("/* test double */\n")
    if cudart:
        (root / "lib64").mkdir()
        (root / "lib64" / "libcudart.so.12.8.90").write_text("test double, not a library\n")
        (root / "lib64" / "libcudart.so").symlink_to("libcudart.so.12.8.90")
    nvcc.write_text(
        "#!/bin/sh\n"
        "echo 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        "echo 'Copyright (c) 2005-2025 NVIDIA Corporation'\n"
        f"echo 'Cuda compilation tools, release {release}, {build}'\n"
        f"echo 'Build cuda_{release}.r{release}/compiler.00000000_0'\n"
    )
    nvcc.chmod(0o755)
    return root


def host_toolchain(root: Path, version: str = "12.2.0") -> Path:
    """gcc/g++/c++ (and Debian's x86_64-linux-gnu- names) that answer only the questions torch asks (-dumpfullversion
    -dumpversion, -v) and fail with 99 if anything runs them to compile: the stand-in must never compile."""
    root.mkdir()
    (root / "g++").write_text(
        "#!/bin/sh\n"
        f'case "$1" in -dumpfullversion|-dumpversion) echo {version}; exit 0;;\n'
        f'  -v) echo "COLLECT_GCC=$0" >&2; echo "gcc version {version} (Debian {version}-14)" >&2; exit 0;; esac\n'
        "echo 'test double: the stand-in must not run a compiler' >&2\nexit 99\n"
    )
    (root / "g++").chmod(0o755)
    # As on Debian, c++ resolves to g++ (through /etc/alternatives), so torch's realpath test accepts it.
    for name in ("gcc", "c++", "x86_64-linux-gnu-g++", "x86_64-linux-gnu-gcc"):
        (root / name).symlink_to("g++")
    return root


def fake_tool(root: Path, name: str, script: str) -> Path:
    root.mkdir(exist_ok=True)
    (root / name).write_text("#!/bin/sh\n" + script)
    (root / name).chmod(0o755)
    return root


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The full wheelhouse, downloads included (PyPI must be reachable through the machine's pip configuration)."""
    outdir = tmp_path_factory.mktemp("wheelhouse")
    first = build(outdir)
    if first.returncode != 0:
        tail = "\n".join(first.stderr.strip().splitlines()[-4:])
        fail_or_skip(f"build_wheelhouse.py could not pip download {', '.join(DOWNLOADED)} (PyPI unreachable?); "
                     f"with CI set this fails instead:\n{tail}")
    # Idempotent: the second run reuses the downloads without asking pip.
    again = build(outdir)
    assert again.returncode == 0, again.stderr
    assert "not downloading" in again.stdout
    return outdir


@pytest.fixture(scope="module")
def python311() -> str:
    for candidate in (shutil.which("python3.11"), sys.executable):
        if candidate:
            out = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                 text=True)
            if out.stdout.strip() == "(3, 11)":
                return candidate
    fail_or_skip("the container chain is written for Python 3.11 (Debian 12's), and no python3.11 was found")


@dataclass
class Venv:
    root: Path
    home: Path
    guard_log: Path

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    def env(self, path: list[Path], **extra: str) -> dict[str, str]:
        # A controlled environment: no CUDA_HOME/CUDA_PATH, PATH without nvcc (this machine may have one), no pip
        # configuration (it may add find-links or indexes), no /usr/local/cuda guess, and the socket guard.
        env = {
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "PATH": os.pathsep.join(str(p) for p in path),
            "PIP_CONFIG_FILE": os.devnull,
            "PIP_CACHE_DIR": str(self.home / "pip-cache"),
            "PYTHONPATH": str(self.guard_log.parent),
            "STANDIN_NETGUARD_LOG": str(self.guard_log),
            "FLEETCUDA_STANDIN_NO_DEFAULT_CUDA": "1",
        }
        env.update(extra)
        return env

    def pip(self, wheelhouse: Path, *args: str, path: list[Path] | None = None, verbose: bool = False,
            cache: bool = False, **extra: str) -> subprocess.CompletedProcess[str]:
        # Without cache=True nothing is cached: a wheel built earlier in the chain must not leak into a later step.
        argv = [self.python, "-m", "pip", "install", "--disable-pip-version-check", "-v" if verbose else "-q",
                *([] if cache else ["--no-cache-dir"]), "--no-index", "--find-links", str(wheelhouse), *args]
        return subprocess.run(argv, env=self.env(path or [self.root / "empty-path"], **extra),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)

    def py(self, code: str, path: list[Path] | None = None, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.python, "-c", code], env=self.env(path or [self.root / "empty-path"], **extra),
                              capture_output=True, text=True, timeout=60)


def make_venv(python: str, where: Path) -> Venv:
    # ensurepip runs pip: keep this machine's pip configuration (find-links, constraints) out of it too.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    subprocess.run([python, "-m", "venv", str(where / "venv")], env=env, check=True, timeout=120)
    guard = where / "netguard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(NETGUARD)
    home = where / "home"
    home.mkdir()
    return Venv(where / "venv", home, guard / "connections.log")


def no_network(venv: Venv) -> None:
    attempts = venv.guard_log.read_text() if venv.guard_log.exists() else ""
    assert attempts == "", f"something tried to open a network connection:\n{attempts}"


def install_chain(venv: Venv, wheelhouse: Path, *args: str, path: list[Path] | None = None, verbose: bool = False,
                  cache: bool = False, **extra: str) -> subprocess.CompletedProcess[str]:
    """The command under test, as the seeds run it (args: more pip options)."""
    return venv.pip(wheelhouse, "--no-build-isolation", "--no-binary", "causal-conv1d", *args, "causal-conv1d==1.7.0",
                    path=path, verbose=verbose, cache=cache, **extra)


def failed_with(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0, result.stdout
    for needle in needles:
        assert needle in result.stdout, f"{needle!r} not in pip's output:\n{result.stdout}"


# ---------------------------------------------------------------------------------------------------------------
# The stand-ins themselves: no downloads needed.


def test_no_download_writes_exactly_the_standins_reproducibly(tmp_path: Path) -> None:
    first = build(tmp_path, "--no-download")
    assert first.returncode == 0, first.stderr
    assert {p.name for p in tmp_path.iterdir()} == STANDINS
    digests = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    again = build(tmp_path, "--no-download")
    assert again.returncode == 0, again.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == digests


def test_every_standin_says_so_and_wheels_have_valid_records(tmp_path: Path) -> None:
    assert build(tmp_path, "--no-download").returncode == 0
    for whl in tmp_path.glob("*.whl"):
        with zipfile.ZipFile(whl) as zf:
            names = zf.namelist()
            [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
            [record] = [n for n in names if n.endswith(".dist-info/RECORD")]
            [wheel_meta] = [n for n in names if n.endswith(".dist-info/WHEEL")]
            summary = next(line for line in zf.read(metadata).decode().splitlines() if line.startswith("Summary:"))
            assert "fleetcuda lab stand-in" in summary and "NOT the real" in summary, summary
            assert "Tag: py3-none-any" in zf.read(wheel_meta).decode()
            rows = list(csv.reader(io.StringIO(zf.read(record).decode())))
            assert sorted(r[0] for r in rows) == sorted(names)
            for arc, digest, size in rows:
                if arc == record:
                    continue
                data = zf.read(arc)
                expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert (digest, size) == (f"sha256={expected}", str(len(data))), arc
            for name in names:
                if name.endswith(".py"):
                    assert "fleetcuda lab stand-in" in zf.read(name).decode(), f"{whl.name}:{name} does not say so"
    with tarfile.open(tmp_path / "causal_conv1d-1.7.0.tar.gz") as tar:
        pkg_info = tar.extractfile("causal_conv1d-1.7.0/PKG-INFO").read().decode()  # type: ignore[union-attr]
        pyproject = tar.extractfile("causal_conv1d-1.7.0/pyproject.toml").read().decode()  # type: ignore[union-attr]
        assert "Summary: fleetcuda lab stand-in for causal-conv1d 1.7.0, NOT the real package" in pkg_info
        assert 'requires = ["setuptools", "wheel", "torch"]' in pyproject
        assert {m.name for m in tar.getmembers() if m.isfile()} >= {
            "causal_conv1d-1.7.0/setup.py", "causal_conv1d-1.7.0/causal_conv1d/__init__.py",
        }


@pytest.fixture(scope="module")
def torch_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cu128 torch stand-in unpacked, to run it with the test's own Python (which has setuptools)."""
    outdir = tmp_path_factory.mktemp("standins")
    assert build(outdir, "--no-download").returncode == 0
    site = tmp_path_factory.mktemp("torch-site")
    with zipfile.ZipFile(outdir / "torch-2.11.0+cu128-py3-none-any.whl") as zf:
        zf.extractall(site)
    return site


def run_torch(site: Path, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    # No nvcc on PATH and no /usr/local/cuda guess, unless a test's env says otherwise.
    base = {"PATH": "/nonexistent", "PYTHONPATH": str(site), "FLEETCUDA_STANDIN_NO_DEFAULT_CUDA": "1"}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=60)


def test_torch_standin_looks_like_a_cuda_build_without_a_gpu(torch_site: Path) -> None:
    code = """
import time
t = time.perf_counter()
import torch
took = time.perf_counter() - t
print(torch.__version__, torch.version.__version__, torch.version.cuda, torch.cuda.is_available(),
      torch.cuda.get_arch_list(), torch.cuda.device_count())
import os
assert os.path.isdir(torch.utils.cmake_prefix_path), torch.utils.cmake_prefix_path
assert took < 0.5, took
try:
    torch.cuda.get_device_capability()
except RuntimeError as err:
    print(err)
"""
    out = run_torch(torch_site, code)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first == "2.11.0+cu128 2.11.0+cu128 12.8 False [] 0"
    assert second.startswith(NO_DRIVER)
    assert out.stderr == ""


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"CUDA_HOME": "/opt/a", "CUDA_PATH": "/opt/b"}, "/opt/a"),
        ({"CUDA_PATH": "/opt/b"}, "/opt/b"),
        ({"PATH": "{nvcc_dir}"}, "{nvcc_home}"),
        ({}, None),
    ],
    ids=["CUDA_HOME", "CUDA_PATH", "nvcc-on-PATH", "none"],
)
def test_cuda_home_is_found_like_torch(torch_site: Path, tmp_path: Path, env: dict[str, str],
                                       expected: str | None) -> None:
    home = fake_cuda_home(tmp_path / "cuda-12.8", "12.8", "V12.8.93")
    env = {k: v.format(nvcc_dir=home / "bin") for k, v in env.items()}
    expected = expected.format(nvcc_home=home) if expected else None
    out = run_torch(torch_site, "import torch.utils.cpp_extension as ce; print(ce.CUDA_HOME)", **env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(expected)
    if expected is None:
        assert out.stderr == ""  # torch says nothing when it finds no CUDA
    else:
        assert f"No CUDA runtime is found, using CUDA_HOME='{expected}'" in out.stderr


def test_nvcc_torch_cuda_check(torch_site: Path, tmp_path: Path) -> None:
    check = "import torch.utils.cpp_extension as ce; ce._check_cuda_version('c++', '12.2.0'); print('ok')"
    minor = run_torch(torch_site, check, CUDA_HOME=str(fake_cuda_home(tmp_path / "c129", "12.9", "V12.9.41")))
    assert minor.returncode == 0 and minor.stdout.strip() == "ok", minor.stderr
    assert "The detected CUDA version (12.9) has a minor version mismatch" in minor.stderr
    major = run_torch(torch_site, check, CUDA_HOME=str(fake_cuda_home(tmp_path / "c130", "13.0", "V13.0.88")))
    assert major.returncode != 0
    # torch 2.11 raises RuntimeError(format, nvcc, torch_cuda) without formatting it: str() is a tuple.
    assert "RuntimeError: ('The detected CUDA version (%s) mismatches the version that was used to compile" in (
        major.stderr
    )
    assert "'13.0', '12.8')" in major.stderr


# The stand-in BuildExtension against real torch 2.11's checks (torch/utils/cpp_extension.py), with this Python's
# setuptools: the C++ compiler torch checks is setuptools' (sysconfig CXX, else $CXX), not c++.
CXX = (sysconfig.get_config_var("CXX") or "c++").split()[0]
EXT_SETUP = """
import os
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension
nvcc = os.environ["TEST_NVCC_FLAGS"].split()
setup(name="ext", ext_modules=[CUDAExtension("ext_cuda", ["a.cpp", "b.cu"],
                                             extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc})],
      cmdclass={"build_ext": BuildExtension})
"""
ARCH_FLAGS = "-O3 -gencode arch=compute_90,code=sm_90"


def standin_build_ext(site: Path, where: Path, path: list[Path], nvcc_flags: str = ARCH_FLAGS,
                      args: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess[str]:
    """``setup.py build_ext`` of a CUDAExtension (a.cpp including a c10/cuda header, b.cu) with the stand-in torch."""
    where.mkdir(exist_ok=True)
    (where / "setup.py").write_text(EXT_SETUP)
    (where / "a.cpp").write_text("#include <torch/extension.h>\n#include <c10/cuda/CUDAStream.h>\n")
    (where / "b.cu").write_text("__global__ void k() {}\n")
    base = {"PATH": os.pathsep.join(map(str, path)), "PYTHONPATH": str(site), "FLEETCUDA_STANDIN_NO_DEFAULT_CUDA": "1",
            "TEST_NVCC_FLAGS": nvcc_flags, "HOME": str(where)}
    return subprocess.run([sys.executable, "setup.py", "build_ext", *args], cwd=where, env={**base, **env},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)


def built(result: subprocess.CompletedProcess[str], where: Path) -> bool:
    return result.returncode == 0 and any(where.glob("build/lib*/ext_cuda*.so"))


def test_no_cxx_compiler_fails_torchs_version_check_before_compiling(torch_site: Path, tmp_path: Path) -> None:
    # torch: get_compiler_abi_compatibility_and_version -> (False, 0.0.0) with the wrong-compiler warning, then
    # _check_cuda_version's bounds raise (cpp_extension.py:488-490, 567-572).  No compile is attempted.
    cuda = fake_cuda_home(tmp_path / "cuda", "12.8", "V12.8.93")
    tools = fake_tool(tmp_path / "tools", "ninja", 'echo 1.13.1\n')
    result = standin_build_ext(torch_site, tmp_path / "src", [tools], CUDA_HOME=str(cuda))
    assert result.returncode != 0
    assert f"Your compiler ({CXX}) is not compatible with the compiler Pytorch was" in result.stdout
    assert (f"RuntimeError: The current installed version of {CXX} (0.0.0) is less than the minimum required version "
            f"by CUDA 12.8 (6.0.0). Please make sure to use an adequate version of {CXX} (>=6.0.0, <14.0)."
            ) in result.stdout, result.stdout
    assert "not found" not in result.stdout and "[1/3]" not in result.stdout


def test_compiler_of_another_family_is_refused(torch_site: Path, tmp_path: Path) -> None:
    # torch's check_compiler_ok_for_platform: neither the resolved path nor `icpx -v` says gcc/clang.  (Its test is
    # a substring of the whole path: a directory named after gcc would pass, so this test's name avoids one.)
    cuda = fake_cuda_home(tmp_path / "cuda", "12.8", "V12.8.93")
    tools = host_toolchain(tmp_path / "tools")
    fake_tool(tools, "icpx", 'echo "Intel(R) oneAPI DPC++/C++ Compiler 2025.0.4"\n')
    result = standin_build_ext(torch_site, tmp_path / "src", [tools], CUDA_HOME=str(cuda), CXX="icpx")
    assert result.returncode != 0
    assert "Your compiler (icpx) is not compatible with the compiler Pytorch was" in result.stdout
    assert "RuntimeError: The current installed version of icpx (0.0.0) is less than the minimum" in result.stdout


@pytest.mark.parametrize(("release", "gcc", "error"), [
    ("12.8", "14.2.0", "RuntimeError: The current installed version of {cxx} (14.2.0) is greater than the maximum "
                       "required version by CUDA 12.8. Please make sure to use an adequate version of {cxx} "
                       "(>=6.0.0, <14.0)."),
    ("12.8", "5.4.0", "RuntimeError: The current installed version of {cxx} (5.4.0) is less than the minimum "
                      "required version by CUDA 12.8 (6.0.0)."),
    ("12.8", "13.3.0", None),
], ids=["gcc14-too-new-for-12.8", "gcc5-too-old", "gcc13-ok"])
def test_host_compiler_version_bounds(torch_site: Path, tmp_path: Path, release: str, gcc: str,
                                      error: str | None) -> None:
    cuda = fake_cuda_home(tmp_path / "cuda", release, f"V{release}.93")
    tools = host_toolchain(tmp_path / "tools", gcc)
    result = standin_build_ext(torch_site, tmp_path / "src", [tools], CUDA_HOME=str(cuda))
    if error is None:
        assert built(result, tmp_path / "src"), result.stdout
    else:
        assert result.returncode != 0
        assert error.format(cxx=CXX) in result.stdout, result.stdout
    #    TORCH_DONT_CHECK_COMPILER_ABI skips torch's checks, as in torch.
    skipped = standin_build_ext(torch_site, tmp_path / "src2", [tools], CUDA_HOME=str(cuda),
                                TORCH_DONT_CHECK_COMPILER_ABI="1")
    assert built(skipped, tmp_path / "src2"), skipped.stdout


def test_compiler_that_cannot_say_its_version(torch_site: Path, tmp_path: Path) -> None:
    cuda = fake_cuda_home(tmp_path / "cuda", "12.8", "V12.8.93")
    tools = fake_tool(tmp_path / "tools", CXX, "exit 1\n")
    result = standin_build_ext(torch_site, tmp_path / "src", [tools], CUDA_HOME=str(cuda))
    assert result.returncode != 0
    assert f"Error checking compiler version for {CXX}" in result.stdout
    assert f"The current installed version of {CXX} (0.0.0) is less than the minimum" in result.stdout


@pytest.mark.parametrize("ninja", [True, False], ids=["ninja", "distutils"])
def test_cuda_home_without_headers_fails_the_compile(torch_site: Path, tmp_path: Path, ninja: bool) -> None:
    cuda = fake_cuda_home(tmp_path / "cuda", "12.8", "V12.8.93", headers=False)
    tools = host_toolchain(tmp_path / "tools")
    if ninja:
        fake_tool(tools, "ninja", "echo 1.13.1\n")
    result = standin_build_ext(torch_site, tmp_path / "src", [tools], CUDA_HOME=str(cuda))
    assert result.returncode != 0
    assert "fatal error: cuda_runtime_api.h: No such file or directory" in result.stdout  # a.cpp, via c10/cuda
    if ninja:
        assert "<command-line>: fatal error: cuda_runtime.h: No such file or directory" in result.stdout  # b.cu
        assert "RuntimeError: Error compiling objects for extension" in result.stdout
    else:
        # setuptools stops at the first source; what it compiles a .cpp with depends on its version.
        assert "failed with exit code 1" in result.stdout and "cuda_runtime.h:" not in result.stdout


@pytest.mark.parametrize(("arch_list", "error"), [
    (None, "IndexError: list index out of range"),
    ("native", "IndexError: list index out of range"),
    ("8.0;9.1", "ValueError: Unknown CUDA arch (9.1) or GPU not supported"),
    ("Hopper 12.0", None),
], ids=["unset-no-gpu", "native-no-gpu", "unknown-arch", "named"])
def test_torch_cuda_arch_list_without_arch_flags(torch_site: Path, tmp_path: Path, arch_list: str | None,
                                                 error: str | None) -> None:
    cuda = fake_cuda_home(tmp_path / "cuda", "12.8", "V12.8.93")
    tools = host_toolchain(tmp_path / "tools")
    env = {"CUDA_HOME": str(cuda)} | ({"TORCH_CUDA_ARCH_LIST": arch_list} if arch_list else {})
    result = standin_build_ext(torch_site, tmp_path / "src", [tools], nvcc_flags="-O3", **env)
    if error is None:
        assert built(result, tmp_path / "src"), result.stdout
        assert "-gencode arch=compute_90,code=sm_90" in result.stdout
        assert "-gencode arch=compute_120,code=sm_120" in result.stdout
    else:
        assert result.returncode != 0 and error in result.stdout, result.stdout
    #    With an arch flag of its own (causal-conv1d's case), torch ignores TORCH_CUDA_ARCH_LIST, even a wrong one.
    own = standin_build_ext(torch_site, tmp_path / "own", [tools], CUDA_HOME=str(cuda), TORCH_CUDA_ARCH_LIST="9.1")
    assert built(own, tmp_path / "own"), own.stdout


@pytest.mark.parametrize(("release", "arch_list", "error"), [
    ("12.8", "12.1", "nvcc fatal   : Unsupported gpu architecture 'compute_121'"),
    ("12.9", "12.1", None),
    ("12.8", "10.0;12.0", None),
], ids=["sm121-unknown-to-12.8", "sm121-with-12.9", "blackwell-with-12.8"])
def test_nvcc_refuses_archs_it_does_not_know(torch_site: Path, tmp_path: Path, release: str, arch_list: str,
                                             error: str | None) -> None:
    # torch accepts 12.1 (its list has it); nvcc 12.8 does not know sm_121 (12.9 added it).
    cuda = fake_cuda_home(tmp_path / "cuda", release, f"V{release}.93")
    tools = host_toolchain(tmp_path / "tools")
    result = standin_build_ext(torch_site, tmp_path / "src", [tools], nvcc_flags="-O3", CUDA_HOME=str(cuda),
                               TORCH_CUDA_ARCH_LIST=arch_list)
    if error is None:
        assert built(result, tmp_path / "src"), result.stdout
    else:
        assert result.returncode != 0 and error in result.stdout, result.stdout
        assert "failed with exit code 1" in result.stdout  # no ninja here: setuptools runs nvcc itself


def test_gcc_newer_than_nvccs_host_config_when_torch_does_not_check(torch_site: Path, tmp_path: Path) -> None:
    # TORCH_DONT_CHECK_COMPILER_ABI skips torch's bounds; nvcc 12.8's crt/host_config.h still refuses gcc 15.
    cuda = fake_cuda_home(tmp_path / "cuda", "12.8", "V12.8.93")
    tools = host_toolchain(tmp_path / "tools", "15.2.0")
    result = standin_build_ext(torch_site, tmp_path / "src", [tools], CUDA_HOME=str(cuda),
                               TORCH_DONT_CHECK_COMPILER_ABI="1")
    assert result.returncode != 0
    assert (f"{cuda}/bin/../targets/x86_64-linux/include/crt/host_config.h:143:2: error: #error -- unsupported GNU "
            "version! gcc versions later than 14 are not supported!") in result.stdout, result.stdout
    allowed = standin_build_ext(torch_site, tmp_path / "src2", [tools], CUDA_HOME=str(cuda),
                                TORCH_DONT_CHECK_COMPILER_ABI="1", TEST_NVCC_FLAGS=f"{ARCH_FLAGS} "
                                "-allow-unsupported-compiler")
    assert built(allowed, tmp_path / "src2"), allowed.stdout


def test_ninja_that_answers_its_version_but_cannot_build(torch_site: Path, tmp_path: Path) -> None:
    # torch only falls back when `ninja --version` fails; `ninja -v` then runs with check=True
    # (cpp_extension.py:2774-2791): its failure is "Error compiling objects for extension".
    cuda = fake_cuda_home(tmp_path / "cuda", "12.8", "V12.8.93")
    tools = host_toolchain(tmp_path / "tools")
    fake_tool(tools, "ninja", 'case "$1" in --version) echo 1.13.1; exit 0;; esac\n'
                              "echo \"ninja: error: test double for a broken ninja ($*)\"; exit 1\n")
    result = standin_build_ext(torch_site, tmp_path / "src", [tools], CUDA_HOME=str(cuda), MAX_JOBS="3")
    assert result.returncode != 0
    assert "ninja: error: test double for a broken ninja (-v -j 3)" in result.stdout, result.stdout
    assert "RuntimeError: Error compiling objects for extension" in result.stdout
    assert NINJA_FALLBACK not in result.stdout
    #    MAX_JOBS that is not all digits is not passed (torch's _get_num_workers).
    odd = standin_build_ext(torch_site, tmp_path / "src2", [tools], CUDA_HOME=str(cuda), MAX_JOBS="4x")
    assert "broken ninja (-v)" in odd.stdout and "MAX_JOBS=4x (not a number" in odd.stdout, odd.stdout


def test_cxx_compiler_there_but_no_cpp_for_ninjas_rule(torch_site: Path, tmp_path: Path) -> None:
    # torch checks setuptools' compiler (found), then warns about c++ (the ninja rule's, missing) and ninja's compile
    # of the .cpp fails: with Debian's g++ hidden, /etc/alternatives/c++ dangles while x86_64-linux-gnu-g++ stays.
    cuda = fake_cuda_home(tmp_path / "cuda", "12.8", "V12.8.93")
    tools = host_toolchain(tmp_path / "tools")
    (tools / "c++").unlink()
    fake_tool(tools, "ninja", "echo 1.13.1\n")
    result = standin_build_ext(torch_site, tmp_path / "src", [tools], CUDA_HOME=str(cuda))
    assert result.returncode != 0
    assert f"Your compiler ({CXX}) is not compatible" not in result.stdout
    assert "Your compiler (c++) is not compatible with the compiler Pytorch was" in result.stdout
    assert "/bin/sh: 1: c++: not found" in result.stdout
    assert "RuntimeError: Error compiling objects for extension" in result.stdout


@pytest.mark.parametrize("ninja", [True, False], ids=["ninja", "distutils"])
def test_build_directory_that_cannot_be_created(torch_site: Path, tmp_path: Path, ninja: bool) -> None:
    # setuptools' mkpath of the object directory (the tests run as root, so a file stands in the way instead of a
    # permission): DistutilsFileError "could not create ...".
    cuda = fake_cuda_home(tmp_path / "cuda", "12.8", "V12.8.93")
    tools = host_toolchain(tmp_path / "tools")
    if ninja:
        fake_tool(tools, "ninja", "echo 1.13.1\n")
    (tmp_path / "blocker").write_text("")
    result = standin_build_ext(torch_site, tmp_path / "src", [tools], args=("--build-temp", str(tmp_path / "blocker")),
                               CUDA_HOME=str(cuda))
    assert result.returncode != 0
    assert f"error: could not create '{tmp_path / 'blocker'}': File exists" in result.stdout, result.stdout


def test_no_python_headers_fails_the_cpp_compile(torch_site: Path, tmp_path: Path) -> None:
    # This Python has Python.h; a sitecustomize points its include directory at an empty one instead.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import sysconfig\n_paths = sysconfig.get_paths\n"
        f"sysconfig.get_paths = lambda *a, **k: {{**_paths(*a, **k), 'include': {str(tmp_path / 'empty')!r}}}\n")
    cuda = fake_cuda_home(tmp_path / "cuda", "12.8", "V12.8.93")
    tools = host_toolchain(tmp_path / "tools")
    result = standin_build_ext(torch_site, tmp_path / "src", [tools], CUDA_HOME=str(cuda),
                               PYTHONPATH=f"{hook}{os.pathsep}{torch_site}")
    assert result.returncode != 0
    assert ("torch/include/torch/csrc/python_headers.h:13:10: fatal error: Python.h: No such file or directory"
            in result.stdout), result.stdout
    assert "failed with exit code 1" in result.stdout


def test_no_libcudart_fails_the_link(torch_site: Path, tmp_path: Path) -> None:
    # CUDAExtension links -lcudart from $CUDA_HOME/lib64; without cuda-cudart-dev's libcudart.so, ld fails.
    cuda = fake_cuda_home(tmp_path / "cuda", "12.8", "V12.8.93", cudart=False)
    tools = host_toolchain(tmp_path / "tools")
    result = standin_build_ext(torch_site, tmp_path / "src", [tools], CUDA_HOME=str(cuda))
    assert result.returncode != 0
    assert "/usr/bin/ld: cannot find -lcudart: No such file or directory" in result.stdout, result.stdout
    assert f"error: command '{tools}/" in result.stdout and "failed with exit code 1" in result.stdout


def test_cuda_extension_without_cuda_home(torch_site: Path, tmp_path: Path) -> None:
    result = standin_build_ext(torch_site, tmp_path / "src", [host_toolchain(tmp_path / "tools")])
    assert result.returncode != 0
    assert ("OSError: CUDA_HOME environment variable is not set. Please set it to your CUDA install root."
            in result.stdout), result.stdout


# ---------------------------------------------------------------------------------------------------------------
# In a fresh venv, offline, with the downloaded tools.


def test_fla_needs_torch_then_imports_with_einops(wheelhouse: Path, python311: str, tmp_path: Path) -> None:
    venv = make_venv(python311, tmp_path)
    assert venv.pip(wheelhouse, "--no-deps", "fla-core==0.6.0").returncode == 0
    no_torch = venv.py("import fla")
    assert "ModuleNotFoundError: No module named 'torch'" in no_torch.stderr
    result = venv.pip(wheelhouse, "torch==2.11.0+cu128", "fla-core==0.6.0")  # einops comes as fla-core's requirement
    assert result.returncode == 0, result.stdout
    code = """
import einops, fla
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
print(fla.__version__)
for op in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
    try:
        op(None, None, None, None, None)
    except RuntimeError as err:
        print(err)
"""
    out = venv.py(code)
    assert out.returncode == 0, out.stderr
    version, chunk, fused = out.stdout.splitlines()
    assert version == "0.6.0"
    assert chunk.startswith("chunk_gated_delta_rule: no CUDA GPU is available") and NO_DRIVER in chunk
    assert fused.startswith("fused_recurrent_gated_delta_rule: no CUDA GPU is available")
    no_network(venv)


def test_causal_conv1d_failure_chain(wheelhouse: Path, python311: str, tmp_path: Path) -> None:
    venv = make_venv(python311, tmp_path)
    bin_dir = venv.root / "bin"
    cuda128 = fake_cuda_home(tmp_path / "cuda-12.8", "12.8", "V12.8.93")
    cuda130 = fake_cuda_home(tmp_path / "cuda-13.0", "13.0", "V13.0.88")
    no_nvcc = tmp_path / "cuda-without-nvcc"
    (no_nvcc / "bin").mkdir(parents=True)
    assert venv.pip(wheelhouse, "torch==2.11.0+cu128").returncode == 0

    # 0. A 3.11 venv has pip and setuptools only.  The real setup.py imports packaging before wheel, so packaging is
    #    what a venv with nothing but torch reports first.
    failed_with(install_chain(venv, wheelhouse), "ModuleNotFoundError: No module named 'packaging'")

    # 1. With packaging: wheel.
    assert venv.pip(wheelhouse, "packaging").returncode == 0
    failed_with(install_chain(venv, wheelhouse), "ModuleNotFoundError: No module named 'wheel'")

    # 2. With wheel and packaging but no CUDA anywhere: a warning, then the NameError (during metadata preparation).
    assert venv.pip(wheelhouse, "wheel", "packaging").returncode == 0
    result = install_chain(venv, wheelhouse)
    failed_with(result, NVCC_WARNING, "NameError: name 'bare_metal_version' is not defined", "metadata")

    # 3. CUDA_HOME without bin/nvcc.
    failed_with(install_chain(venv, wheelhouse, CUDA_HOME=str(no_nvcc)),
                f"FileNotFoundError: [Errno 2] No such file or directory: '{no_nvcc}/bin/nvcc'")

    #    nvcc there but not executable: the same subprocess call in setup.py, PermissionError.
    not_exec = fake_cuda_home(tmp_path / "cuda-not-executable", "12.8", "V12.8.93")
    (not_exec / "bin" / "nvcc").chmod(0o644)
    failed_with(install_chain(venv, wheelhouse, CUDA_HOME=str(not_exec)),
                f"PermissionError: [Errno 13] Permission denied: '{not_exec}/bin/nvcc'")

    # 4. nvcc 12.8 but no CAUSAL_CONV1D_FORCE_BUILD=TRUE (only that exact string counts): the prebuilt-wheel download
    #    fails offline, and a URLError is not an HTTPError, so there is no fallback to a source build.
    for force in (None, "true"):
        extra = {"CUDA_HOME": str(cuda128)} | ({"CAUSAL_CONV1D_FORCE_BUILD": force} if force else {})
        failed_with(install_chain(venv, wheelhouse, **extra),
                    "Guessing wheel URL:  https://github.com/Dao-AILab/causal-conv1d/releases/download/v1.7.0/"
                    "causal_conv1d-1.7.0+cu12torch2.11cxx11abiTRUE-cp311-cp311-linux_x86_64.whl",
                    "<urlopen error [Errno -3] Temporary failure in name resolution>")

    # 5. FORCE_BUILD=TRUE with the build tools from the wheelhouse and ninja on PATH, but no host compiler (a fresh
    #    Proxmox template has none): torch refuses before compiling anything.  It asks setuptools' C++ compiler (this
    #    Python's sysconfig CXX: x86_64-linux-gnu-g++ for Debian's), finds none, warns, takes its version for 0.0.0
    #    and _check_cuda_version's host compiler bounds raise (torch/utils/cpp_extension.py:488-490, 567-572).
    #    Nothing is installed.
    cxx = venv.py("import sysconfig; print(sysconfig.get_config_var('CXX').split()[0])").stdout.strip()
    no_compiler = (f"Your compiler ({cxx}) is not compatible with the compiler Pytorch was",
                   f"RuntimeError: The current installed version of {cxx} (0.0.0) is less than the minimum required "
                   f"version by CUDA 12.8 (6.0.0). Please make sure to use an adequate version of {cxx} (>=6.0.0, "
                   "<14.0).")
    assert venv.pip(wheelhouse, "setuptools<76", "ninja").returncode == 0
    result = install_chain(venv, wheelhouse, path=[bin_dir], CUDA_HOME=str(cuda128), CAUSAL_CONV1D_FORCE_BUILD="TRUE",
                           CAUSAL_CONV1D_STANDIN_SECONDS="0")
    failed_with(result, *no_compiler)
    assert "not found" not in result.stdout and NINJA_FALLBACK not in result.stdout
    assert "causal_conv1d" not in venv.py("import importlib.metadata as m; print([d.name for d in m.distributions()])",
                                          ).stdout.replace("-", "_")
    #    Without ninja: the same refusal, after the fallback warning.
    failed_with(install_chain(venv, wheelhouse, CUDA_HOME=str(cuda128), CAUSAL_CONV1D_FORCE_BUILD="TRUE"),
                NINJA_FALLBACK, *no_compiler)
    #    The stand-in never compiles: these answer only torch's version questions and fail with 99 otherwise.
    tools = host_toolchain(tmp_path / "host-toolchain")
    #    g++ but no gcc: torch's checks pass, then nvcc cannot run its host compiler for the .cu sources.
    cxx_only = host_toolchain(tmp_path / "cxx-only")
    for name in ("gcc", "x86_64-linux-gnu-gcc"):
        (cxx_only / name).unlink()
    failed_with(install_chain(venv, wheelhouse, path=[bin_dir, cxx_only], CUDA_HOME=str(cuda128),
                              CAUSAL_CONV1D_FORCE_BUILD="TRUE", CAUSAL_CONV1D_STANDIN_SECONDS="0"),
                "gcc: No such file or directory", "nvcc fatal   : Failed to preprocess host compiler properties.",
                "ninja: build stopped: subcommand failed.", "RuntimeError: Error compiling objects for extension")

    # 6. With a host compiler too: it builds and installs.
    result = install_chain(venv, wheelhouse, path=[bin_dir, tools], verbose=True, cache=True, CUDA_HOME=str(cuda128),
                           CAUSAL_CONV1D_FORCE_BUILD="TRUE", CAUSAL_CONV1D_STANDIN_SECONDS="0.5", MAX_JOBS="2")
    assert result.returncode == 0, result.stdout
    assert "MAX_JOBS=2 (ninja -j 2)" in result.stdout and NINJA_FALLBACK not in result.stdout
    assert "-gencode arch=compute_120,code=sm_120" in result.stdout and "sm_121" not in result.stdout
    code = """
import importlib.metadata, pathlib, causal_conv1d
from causal_conv1d import _build_info as b
dist = importlib.metadata.distribution("causal-conv1d")
print(causal_conv1d.__version__, dist.version, b.TORCH_VERSION, b.TORCH_CUDA, b.NVCC_RELEASE, ",".join(b.ARCHS))
print([line for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag:")][0])
try:
    causal_conv1d.causal_conv1d_fn(None, None)
except RuntimeError as err:
    print(err)
"""
    out = venv.py(code)
    assert out.returncode == 0, out.stderr
    versions, tag, call = out.stdout.splitlines()
    assert versions == "1.7.0 1.7.0 2.11.0+cu128 12.8 12.8 sm_75,sm_80,sm_87,sm_90,sm_100,sm_120"
    assert tag == "Tag: cp311-cp311-linux_x86_64"
    assert call.startswith("causal_conv1d_fn: no CUDA GPU is available") and NO_DRIVER in call

    # 7. A torch upgrade under the built extension: the real ABI-break ImportError.
    assert venv.pip(wheelhouse, "torch==2.11.0+cu130").returncode == 0
    broken = venv.py("import causal_conv1d")
    assert broken.returncode != 0
    assert f"ImportError: {venv.root}/lib/python3.11/site-packages/{ABI_BREAK}" in broken.stderr
    #    pip's wheel cache is keyed by the sdist, not by torch: a plain reinstall brings the stale binary back.
    result = install_chain(venv, wheelhouse, "--force-reinstall", "--no-deps", path=[tools], cache=True,
                           CUDA_HOME=str(cuda130), CAUSAL_CONV1D_FORCE_BUILD="TRUE")
    assert result.returncode == 0, result.stdout
    assert ABI_BREAK in venv.py("import causal_conv1d").stderr

    # 8. nvcc 13.0 against torch cu128: torch refuses to compile (after the ninja check, before any compile).
    assert venv.pip(wheelhouse, "torch==2.11.0+cu128").returncode == 0
    result = install_chain(venv, wheelhouse, "--force-reinstall", "--no-deps", CUDA_HOME=str(cuda130),
                           CAUSAL_CONV1D_FORCE_BUILD="TRUE", CAUSAL_CONV1D_STANDIN_SECONDS="0")
    failed_with(result, "RuntimeError: ('The detected CUDA version (%s) mismatches the version that was used to "
                "compile", "'13.0', '12.8')", NINJA_FALLBACK)

    # 9. Without ninja on PATH the pretend compile takes three times as long; CAUSAL_CONV1D_LOCAL_VERSION stamps
    #    the version (from the sdist's path: by name, pip rejects the metadata's 1.7.0+X against the file's 1.7.0).
    started = time.monotonic()
    result = venv.pip(wheelhouse, "--no-build-isolation", "--force-reinstall", "--no-deps",
                      str(wheelhouse / "causal_conv1d-1.7.0.tar.gz"), path=[tools], verbose=True,
                      CUDA_HOME=str(cuda128),
                      CAUSAL_CONV1D_FORCE_BUILD="TRUE", CAUSAL_CONV1D_STANDIN_SECONDS="0.4",
                      CAUSAL_CONV1D_LOCAL_VERSION="cu128torch2.11")
    assert result.returncode == 0, result.stdout
    assert time.monotonic() - started >= 1.2
    assert NINJA_FALLBACK in result.stdout
    out = venv.py("import importlib.metadata as m, causal_conv1d; print(m.version('causal-conv1d'))")
    assert out.stdout.strip() == "1.7.0+cu128torch2.11", out.stderr
    no_network(venv)
