# fleetcuda lab stand-in for causal-conv1d 1.7.0's setup.py: NOT the real package.
#
# The module-level statements follow the real setup.py in the same order, so each missing piece fails with the real
# error, while pip prepares metadata:
#   - `packaging`, then `wheel` missing (pip --no-build-isolation): ModuleNotFoundError from the imports below;
#   - no CUDA found (torch's CUDA_HOME is None): the "nvcc was not found" warning, then
#     NameError: name 'bare_metal_version' is not defined (the real code reads a variable it never assigned);
#   - CUDA_HOME without bin/nvcc: FileNotFoundError from subprocess.check_output.
# Then, building the wheel (CachedWheelsCommand.run): without CAUSAL_CONV1D_FORCE_BUILD=TRUE the real one tries to
# download a prebuilt wheel from GitHub; here the same URLError is raised without any network access.  With it,
# torch's BuildExtension checks nvcc against torch.version.cuda and the host C++ compiler against nvcc's release, then
# "compiles" (the stand-in torch's pretend compile).
# Stand-in additions: CAUSAL_CONV1D_STANDIN_SECONDS (pretend compile time, default 4), CAUSAL_CONV1D_STANDIN_CPU_SECONDS
# (CPU work spread over MAX_JOBS processes, default 0) and causal_conv1d/_build_info.py.

# Same order as the real imports: which missing module is reported first depends on it.
import ast  # noqa: I001
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request  # noqa: F401  (imported by the real setup.py; the stand-in never uses it)
import warnings
from pathlib import Path

from packaging.version import Version, parse
from setuptools import find_packages, setup
from wheel.bdist_wheel import bdist_wheel as _bdist_wheel

import torch
from torch.utils.cpp_extension import (
    CUDA_HOME,
    HIP_HOME,  # noqa: F401  (imported by the real setup.py)
    BuildExtension,
    CUDAExtension,
)

with open("README.md", encoding="utf-8") as fh:
    long_description = fh.read()

this_dir = os.path.dirname(os.path.abspath(__file__))

PACKAGE_NAME = "causal_conv1d"
BASE_WHEEL_URL = "https://github.com/Dao-AILab/causal-conv1d/releases/download/{tag_name}/{wheel_name}"
STANDIN_SUMMARY = "fleetcuda lab stand-in for causal-conv1d 1.7.0, NOT the real package (no CUDA kernels)"

# Only the exact string TRUE counts, as in the real setup.py.
FORCE_BUILD = os.getenv("CAUSAL_CONV1D_FORCE_BUILD", "FALSE") == "TRUE"
SKIP_CUDA_BUILD = os.getenv("CAUSAL_CONV1D_SKIP_CUDA_BUILD", "FALSE") == "TRUE"


def get_platform() -> str:
    if sys.platform.startswith("linux"):
        return "linux_x86_64"
    raise ValueError(f"Unsupported platform: {sys.platform}")


def get_cuda_bare_metal_version(cuda_dir: str) -> tuple[str, Version]:
    raw_output = subprocess.check_output([cuda_dir + "/bin/nvcc", "-V"], universal_newlines=True)
    output = raw_output.split()
    release_idx = output.index("release") + 1
    bare_metal_version = parse(output[release_idx].split(",")[0])
    return raw_output, bare_metal_version


def check_if_cuda_home_none(global_option: str) -> None:
    if CUDA_HOME is not None:
        return
    # The real one only warns: a prebuilt wheel would not need nvcc.
    warnings.warn(
        f"{global_option} was requested, but nvcc was not found.  Are you sure your environment has nvcc available?  "
        "If you're installing within a container from https://hub.docker.com/r/pytorch/pytorch, "
        "only images whose names contain 'devel' will provide nvcc.",
        stacklevel=1,
    )


def append_nvcc_threads(nvcc_extra_args: list[str]) -> list[str]:
    return nvcc_extra_args + ["--threads", "4"]


cmdclass = {}
ext_modules = []
cc_flag: list[str] = []

if not SKIP_CUDA_BUILD:
    print(f"\n\ntorch.__version__  = {torch.__version__}\n\n")
    check_if_cuda_home_none(PACKAGE_NAME)
    if CUDA_HOME is not None:
        _, bare_metal_version = get_cuda_bare_metal_version(CUDA_HOME)
        if bare_metal_version < Version("11.6"):
            raise RuntimeError(
                f"{PACKAGE_NAME} is only supported on CUDA 11.6 and above.  "
                "Note: make sure nvcc has a supported version by running nvcc -V."
            )

    # Hard-coded archs, as in 1.6.2.post1 and 1.7.0 (TORCH_CUDA_ARCH_LIST is not consulted).  With no CUDA found,
    # bare_metal_version was never assigned and the comparison below raises NameError, exactly like the real one.
    cc_flag += ["-gencode", "arch=compute_75,code=sm_75"]
    cc_flag += ["-gencode", "arch=compute_80,code=sm_80"]
    cc_flag += ["-gencode", "arch=compute_87,code=sm_87"]
    if bare_metal_version >= Version("11.8"):
        cc_flag += ["-gencode", "arch=compute_90,code=sm_90"]
    if bare_metal_version >= Version("12.8"):
        cc_flag += ["-gencode", "arch=compute_100,code=sm_100"]
        cc_flag += ["-gencode", "arch=compute_120,code=sm_120"]
    if bare_metal_version >= Version("13.0"):
        cc_flag += ["-gencode", "arch=compute_103,code=sm_103"]
        cc_flag += ["-gencode", "arch=compute_110,code=sm_110"]
        cc_flag += ["-gencode", "arch=compute_121,code=sm_121"]

    extra_compile_args = {
        "cxx": ["-O3"],
        "nvcc": append_nvcc_threads(
            [
                "-O3",
                "-U__CUDA_NO_HALF_OPERATORS__",
                "-U__CUDA_NO_HALF_CONVERSIONS__",
                "-U__CUDA_NO_BFLOAT16_OPERATORS__",
                "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                "-U__CUDA_NO_BFLOAT162_OPERATORS__",
                "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
                "--expt-relaxed-constexpr",
                "--expt-extended-lambda",
                "--use_fast_math",
                "--ptxas-options=-v",
                "-lineinfo",
            ]
            + cc_flag
        ),
    }
    ext_modules.append(
        CUDAExtension(
            name="causal_conv1d_cuda",
            sources=[
                "csrc/causal_conv1d.cpp",
                "csrc/causal_conv1d_fwd.cu",
                "csrc/causal_conv1d_bwd.cu",
                "csrc/causal_conv1d_update.cu",
            ],
            extra_compile_args=extra_compile_args,
            include_dirs=[str(Path(this_dir) / "csrc")],
        )
    )


def get_package_version() -> str:
    with open(Path(this_dir) / "causal_conv1d" / "__init__.py") as f:
        version_match = re.search(r"^__version__\s*=\s*(.*)$", f.read(), re.MULTILINE)
    assert version_match is not None
    public_version = ast.literal_eval(version_match.group(1))
    local_version = os.environ.get("CAUSAL_CONV1D_LOCAL_VERSION")
    if local_version:
        return f"{public_version}+{local_version}"
    return str(public_version)


def get_wheel_url() -> tuple[str, str]:
    torch_version_raw = parse(torch.__version__)
    # The real one uses the CUDA version torch was built with, not nvcc's, and maps each major to one build.
    torch_cuda_version = parse(torch.version.cuda)
    if torch_cuda_version.major == 11:
        torch_cuda_version = parse("11.8")
    elif torch_cuda_version.major == 12:
        torch_cuda_version = parse("12.3")
    elif torch_cuda_version.major == 13:
        torch_cuda_version = parse("13.0")
    else:
        raise ValueError(f"CUDA version {torch_cuda_version} not supported")
    cuda_version = f"{torch_cuda_version.major}"
    python_version = f"cp{sys.version_info.major}{sys.version_info.minor}"
    torch_version = f"{torch_version_raw.major}.{torch_version_raw.minor}"
    cxx11_abi = str(torch._C._GLIBCXX_USE_CXX11_ABI).upper()
    wheel_filename = (
        f"{PACKAGE_NAME}-{get_package_version()}+cu{cuda_version}torch{torch_version}cxx11abi{cxx11_abi}"
        f"-{python_version}-{python_version}-{get_platform()}.whl"
    )
    wheel_url = BASE_WHEEL_URL.format(tag_name=f"v{get_package_version()}", wheel_name=wheel_filename)
    return wheel_url, wheel_filename


def _standin_urlretrieve(url: str, filename: str) -> None:
    """Where the real setup.py calls urllib.request.urlretrieve(url, filename).

    The lab is offline, and the stand-in must never open a connection (not even one that would fail), so it raises
    what the real call raises in an offline container: a URLError wrapping the resolver's EAI_AGAIN.  That is not an
    HTTPError, so, as in the real package, there is no fallback to a source build.
    """
    raise urllib.error.URLError(socket.gaierror(-3, "Temporary failure in name resolution"))


class CachedWheelsCommand(_bdist_wheel):
    """The real command tries a prebuilt wheel from GitHub unless CAUSAL_CONV1D_FORCE_BUILD=TRUE."""

    def run(self) -> None:
        if FORCE_BUILD:
            return super().run()
        wheel_url, wheel_filename = get_wheel_url()
        print("Guessing wheel URL: ", wheel_url)
        try:
            _standin_urlretrieve(wheel_url, wheel_filename)
        except urllib.error.HTTPError:
            print("Precompiled wheel not found. Building from source...")
            super().run()


_BURN = "import sys, time\nend = float(sys.argv[1])\nwhile time.process_time() < end:\n    sum(range(10000))\n"


def _standin_burn_cpu(cpu_seconds: float) -> None:
    """Stand-in addition: CAUSAL_CONV1D_STANDIN_CPU_SECONDS of CPU work over MAX_JOBS processes (default: one per
    core), so that builds side by side compete for the cores as nvcc's jobs do; a sleep would not."""
    if cpu_seconds <= 0:
        return
    jobs = os.environ.get("MAX_JOBS", "")
    jobs_n = int(jobs) if jobs.isdigit() and int(jobs) > 0 else (os.cpu_count() or 1)
    print(f"[fleetcuda stand-in] compiling: {cpu_seconds:g} CPU-seconds over {jobs_n} jobs", flush=True)
    workers = [subprocess.Popen([sys.executable, "-c", _BURN, str(cpu_seconds / jobs_n)]) for _ in range(jobs_n)]
    for w in workers:
        w.wait()


class StandinBuildExt(BuildExtension):
    """Stand-in addition: torch's BuildExtension plus the pretend compile time and causal_conv1d/_build_info.py."""

    def build_extensions(self) -> None:
        self.standin_compile_seconds = float(os.environ.get("CAUSAL_CONV1D_STANDIN_SECONDS", "4"))
        _standin_burn_cpu(float(os.environ.get("CAUSAL_CONV1D_STANDIN_CPU_SECONDS", "0")))
        super().build_extensions()
        release = re.search(r"release (\d+\.\d+), (V[\d.]+)", get_cuda_bare_metal_version(CUDA_HOME)[0])
        # What the compile really gets: the extension's nvcc flags (an arch restriction edits those).
        nvcc_flags = self.extensions[0].extra_compile_args["nvcc"] if self.extensions else cc_flag
        archs = [flag.split("code=")[-1] for flag in nvcc_flags if flag.startswith("arch=")]
        so_name = os.path.basename(self.get_ext_fullpath("causal_conv1d_cuda"))
        info = (
            '"""Written by the fleetcuda lab stand-in of causal-conv1d at build time: what it was built against."""\n'
            "\n"
            f"TORCH_VERSION = {torch.__version__!r}\n"
            f"TORCH_CUDA = {torch.version.cuda!r}\n"
            f"NVCC_RELEASE = {release.group(1) if release else None!r}\n"
            f"NVCC_BUILD = {release.group(2) if release else None!r}\n"
            f"CUDA_HOME = {CUDA_HOME!r}\n"
            f"ARCHS = {archs!r}\n"
            f"EXTENSION_FILENAME = {so_name!r}\n"
        )
        target = Path(self.build_lib) / "causal_conv1d" / "_build_info.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(info, encoding="utf-8")
        print(f"[fleetcuda stand-in] built for {', '.join(archs)} against torch {torch.__version__}", flush=True)


setup(
    name=PACKAGE_NAME,
    version=get_package_version(),
    packages=find_packages(exclude=("build", "csrc", "include", "tests", "dist", "docs", "benchmarks")),
    author="Tri Dao (real package); fleetcuda lab (this stand-in)",
    description=STANDIN_SUMMARY,
    long_description=long_description,
    long_description_content_type="text/markdown",
    url="https://github.com/Dao-AILab/causal-conv1d",
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: BSD License",
        "Operating System :: Unix",
    ],
    ext_modules=ext_modules,
    cmdclass={"bdist_wheel": CachedWheelsCommand, "build_ext": StandinBuildExt}
    if ext_modules
    else {"bdist_wheel": CachedWheelsCommand},
    python_requires=">=3.9",
    install_requires=["torch", "packaging", "ninja"],
)
