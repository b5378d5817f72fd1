"""fleetcuda lab stand-in for torch.utils.cpp_extension (torch 2.11): NOT the real module.

What it reproduces, with torch's own messages:
- ``CUDA_HOME`` is found at import as torch does: env CUDA_HOME, then CUDA_PATH, then the directory above ``nvcc``
  found on PATH, then /usr/local/cuda if it exists, else None (silently).  When one is found while no GPU is visible,
  torch logs "No CUDA runtime is found, using CUDA_HOME='...'".  FLEETCUDA_STANDIN_NO_DEFAULT_CUDA=1 skips the
  /usr/local/cuda guess, for tests on machines that have one.
- ``_check_cuda_version``: nvcc's major must equal torch.version.cuda's major (RuntimeError), a minor difference only
  warns.  torch 2.11 raises ``RuntimeError(CUDA_MISMATCH_MESSAGE, nvcc_version, torch_cuda)``: logger-style arguments
  that are never %-formatted, so str() of the error is a tuple and reads "...used to compilePyTorch (%s)..." (sic).
- ``BuildExtension``: falls back to "the slow distutils backend" when ``ninja --version`` cannot run (ninja must be on
  PATH; being importable is not enough).  Before compiling it makes torch's checks, in torch's order: the C++ compiler
  setuptools would use (``$CXX``, else Python's sysconfig CXX, e.g. x86_64-linux-gnu-g++; not ``c++``) must be on PATH
  and be gcc/clang (by its resolved path, else by what ``-v``/``--version`` prints), else the wrong-compiler warning
  and version 0.0.0; its ``-dumpfullversion -dumpversion`` gives the version; then nvcc's major must match torch's
  and the compiler's version must lie within torch's bounds for that nvcc release ("The current installed version of
  g++ (14.2.0) is greater than the maximum required version by CUDA 12.8..."; 0.0.0 is "less than the minimum"), unless
  TORCH_DONT_CHECK_COMPILER_ABI is set.  Those version questions (and nvcc's --version) are the only times it runs
  a compiler.
- ``CUDAExtension`` and ``include_paths``/``library_paths("cuda")`` raise torch's OSError without a CUDA_HOME.
  Arch flags: an nvcc flag naming an arch (causal-conv1d's -gencode) makes torch ignore TORCH_CUDA_ARCH_LIST; else
  the list is expanded and checked ("Unknown CUDA arch (9.1) or GPU not supported"), and unset or "native" with no
  GPU raises torch's IndexError (list index out of range).
- Then it pretends to compile: it creates the object directory as setuptools does (its "could not create" error);
  with ninja it writes a build.ninja without compile edges and runs ``ninja -v [-j MAX_JOBS]`` on it as torch runs
  its own (a ninja that answers --version but cannot build fails with torch's "Error compiling objects for
  extension"; MAX_JOBS is passed only when all digits); it prints ninja/nvcc-like lines for the -gencode archs, sleeps
  ``standin_compile_seconds`` (three times as long without ninja), writes placeholder objects and a placeholder file
  where the shared object would be.  It never compiles, but fails as the real compile does where one could not get
  going: no ``c++`` (``CXX``) on PATH for the ninja .cpp rule (setuptools' compiler_so_cxx / compiler_so without
  ninja); for .cu sources, what nvcc refuses, in its order: an arch its release does not know ("nvcc fatal   :
  Unsupported gpu architecture 'compute_121'" from 12.8), no host compiler (``$CC``, passed as -ccbin, else ``gcc``),
  no ``cuda_runtime.h`` in ``$CUDA_HOME/include``, a gcc newer than its crt/host_config.h allows (asked with
  ``-dumpversion``; 12.8 takes up to 14, 13.0 up to 15; torch's own bounds are stricter for 12.8); for a .cpp that
  includes a c10/cuda or ATen/cuda header, no cudart headers (real message: cuda_runtime_api.h; tested by
  cuda_runtime.h, all the lab's apt stand-in of cuda-cudart-dev ships); no ``Python.h`` in the interpreter's include
  directory (torch's headers include it); no C++ linker; no libcudart.so for ld in the CUDA library directory.  With
  ninja torch then raises "Error compiling objects for extension", without it setuptools' "command ... failed".
"""

import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from typing import Any

from setuptools import Extension
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError, LinkError

import torch

logger = logging.getLogger(__name__)

IS_WINDOWS = False
SUBPROCESS_DECODE_ARGS: tuple[str, ...] = ()

WRONG_COMPILER_WARNING = (
    "                               !! WARNING !!"
    "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
    "Your compiler (%s) is not compatible with the compiler Pytorch was"
    "built with for this platform, which is %s on %s. Please"
    "use %s to compile your extension. Alternatively, you may"
    "compile PyTorch from source using %s, and then you can also use"
    "%s to compile your extension."
    "See https://github.com/pytorch/pytorch/blob/master/CONTRIBUTING.md for help"
    "with compiling PyTorch from source."
    "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
    "                              !! WARNING !!"
)
ABI_INCOMPATIBILITY_WARNING = (
    "                               !! WARNING !!"
    "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
    "Your compiler (%s) may be ABI-incompatible with PyTorch!"
    "Please use a compiler that is ABI-compatible with GCC 5.0 and above."
    "See https://gcc.gnu.org/onlinedocs/libstdc++/manual/abi.html."
    "See https://gist.github.com/goldsborough/d466f43e8ffc948ff92de7486c5216d6"
    "for instructions on how to install GCC 5 or higher."
    "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
    "                              !! WARNING !!"
)
# Verbatim from torch 2.11, including the missing space between "compile" and "PyTorch".
CUDA_MISMATCH_MESSAGE = (
    "The detected CUDA version (%s) mismatches the version that was used to compile"
    "PyTorch (%s). Please make sure to use the same CUDA versions."
)
CUDA_MISMATCH_WARN = (
    "The detected CUDA version (%s) has a minor version mismatch with the version that was used to compile "
    "PyTorch (%s). Most likely this shouldn't be a problem."
)
CUDA_NOT_FOUND_MESSAGE = (
    "CUDA was not found on the system, please set the CUDA_HOME or the CUDA_PATH"
    "environment variable or add NVCC to your system PATH. The extension compilation will fail."
)


_YES = ("ON", "1", "YES", "TRUE", "Y")
BUILT_FROM_SOURCE_VERSION_PATTERN = re.compile(r"\d+\.\d+\.\d+\w+\+\w+")
MINIMUM_GCC_VERSION = (5, 0, 0)
# torch 2.11's host compiler bounds per nvcc release: min <= version < max (exclusive).
_GCC_6, _CLANG_MIN = (6, 0, 0), (3, 3, 0)
CUDA_GCC_VERSIONS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "11.0": (MINIMUM_GCC_VERSION, (10, 0)), "11.1": (MINIMUM_GCC_VERSION, (11, 0)),
    "11.2": (MINIMUM_GCC_VERSION, (11, 0)), "11.3": (MINIMUM_GCC_VERSION, (11, 0)),
    **{v: (_GCC_6, (12, 0)) for v in ("11.4", "11.5", "11.6", "11.7")},
    **{v: (_GCC_6, (13, 0)) for v in ("12.0", "12.1", "12.2")},
    **{v: (_GCC_6, (14, 0)) for v in ("12.3", "12.4", "12.5", "12.6", "12.7", "12.8", "12.9")},
    "13.0": (_GCC_6, (16, 0)),
}
CUDA_CLANG_VERSIONS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "11.1": (_CLANG_MIN, (11, 0)), "11.2": (_CLANG_MIN, (12, 0)), "11.3": (_CLANG_MIN, (12, 0)),
    "11.4": (_CLANG_MIN, (13, 0)), "11.5": (_CLANG_MIN, (13, 0)), "11.6": (_CLANG_MIN, (14, 0)),
    "11.7": (_CLANG_MIN, (14, 0)), "12.0": ((7, 0), (15, 0)), "12.1": ((7, 0), (15, 0)), "12.2": ((7, 0), (16, 0)),
    "12.3": ((7, 0), (16, 0)), "12.4": ((7, 0), (17, 0)), "12.5": ((7, 0), (18, 0)), "12.6": ((7, 0), (18, 0)),
    "12.7": ((7, 0), (19, 0)), "12.8": ((7, 0), (19, 0)), "12.9": ((7, 0), (19, 0)), "13.0": ((7, 0), (21, 0)),
}


def _find_cuda_home() -> str | None:
    """Find the CUDA install path, in torch 2.11's order."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home is None:
        nvcc_path = shutil.which("nvcc")
        if nvcc_path is not None:
            cuda_home = os.path.dirname(os.path.dirname(nvcc_path))
        elif os.environ.get("FLEETCUDA_STANDIN_NO_DEFAULT_CUDA") == "1":
            # Stand-in only: lets tests ignore a /usr/local/cuda that the test machine happens to have.
            cuda_home = None
        else:
            cuda_home = "/usr/local/cuda"
            if not os.path.exists(cuda_home):
                cuda_home = None
    if cuda_home and not torch.cuda.is_available():
        logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", cuda_home)
    return cuda_home


ROCM_HOME: str | None = None
HIP_HOME: str | None = None
IS_HIP_EXTENSION = False
ROCM_VERSION = None
CUDA_HOME = _find_cuda_home() if (torch.cuda._is_compiled() and torch.version.cuda) else None
CUDNN_HOME = os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH")

_TORCH_PATH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def include_paths(device_type: str = "cpu") -> list[str]:
    paths = [os.path.join(_TORCH_PATH, "include"), os.path.join(_TORCH_PATH, "include", "torch", "csrc", "api",
                                                                 "include")]
    if device_type == "cuda":
        paths.append(_join_cuda_home("include"))  # OSError without CUDA_HOME, as in torch
    return paths


def library_paths(device_type: str = "cpu") -> list[str]:
    paths = [os.path.join(_TORCH_PATH, "lib")]
    if device_type == "cuda":
        lib_dir = "lib64"
        if not os.path.exists(_join_cuda_home(lib_dir)) and os.path.exists(_join_cuda_home("lib")):
            lib_dir = "lib"
        paths.append(_join_cuda_home(lib_dir))
    return paths


def get_cxx_compiler() -> str:
    return os.environ.get("CXX", "c++")


def is_ninja_available() -> bool:
    """True if ``ninja --version`` runs, exactly torch's test: a ninja that is importable but not on PATH is unused."""
    try:
        subprocess.check_output(["ninja", "--version"])
    except Exception:
        return False
    return True


def verify_ninja_availability() -> None:
    if not is_ninja_available():
        raise RuntimeError("Ninja is required to load C++ extensions (pip install ninja to get it)")


def _nvcc_release(cuda_home: str) -> tuple[str, str]:
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    if not os.path.exists(nvcc):
        raise FileNotFoundError(f"nvcc not found at '{nvcc}'. Ensure CUDA path '{cuda_home}' is correct.")
    out = subprocess.check_output([nvcc, "--version"]).strip().decode(*SUBPROCESS_DECODE_ARGS)
    return nvcc, out


def _major_minor(version: str) -> tuple[int, int]:
    major, _, minor = version.partition(".")
    return int(major), int(minor.split(".")[0] or 0)


def _check_cuda_version(compiler_name: str, compiler_version: str) -> None:
    """torch 2.11's check before compiling .cu sources: nvcc's major must match torch.version.cuda's major."""
    if not CUDA_HOME:
        raise RuntimeError(CUDA_NOT_FOUND_MESSAGE)
    _, cuda_version_str = _nvcc_release(CUDA_HOME)
    cuda_version = re.search(r"release (\d+[.]\d+)", cuda_version_str)
    if cuda_version is None:
        return
    cuda_str_version = cuda_version.group(1)
    if torch.version.cuda is None:
        return
    nvcc_mm, torch_mm = _major_minor(cuda_str_version), _major_minor(torch.version.cuda)
    if nvcc_mm != torch_mm:
        if nvcc_mm[0] != torch_mm[0]:
            # Same call shape as torch 2.11 (logger-style args, never formatted): str(err) shows a tuple.
            raise RuntimeError(CUDA_MISMATCH_MESSAGE, cuda_str_version, torch.version.cuda)
        logger.warning(CUDA_MISMATCH_WARN, cuda_str_version, torch.version.cuda)
    _check_compiler_bounds(compiler_name, compiler_version, cuda_str_version, cuda_version_str)


def _accepted_compilers_for_platform() -> list[str]:
    return ["g++", "gcc", "gnu-c++", "gnu-cc", "clang++", "clang"]


def _is_binary_build() -> bool:
    return not BUILT_FROM_SOURCE_VERSION_PATTERN.match(torch.version.__version__)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = tuple(int(p) for p in re.findall(r"\d+", version))
    return parts + (0,) * (3 - len(parts))


def check_compiler_ok_for_platform(compiler: str) -> bool:
    """torch 2.11's test: on PATH, and gcc/clang by its resolved path, else by what ``compiler -v`` prints.

    Like torch, it runs the compiler only to ask (``-v``, then ``--version``; a failure of both propagates).
    """
    compiler_path = shutil.which(compiler)
    if compiler_path is None:
        return False
    compiler_path = os.path.realpath(compiler_path)
    if any(name in compiler_path for name in _accepted_compilers_for_platform()):
        return True
    env = {**os.environ, "LC_ALL": "C"}
    try:
        version_string = subprocess.check_output([compiler, "-v"], stderr=subprocess.STDOUT, env=env).decode()
    except subprocess.CalledProcessError:
        version_string = subprocess.check_output([compiler, "--version"], stderr=subprocess.STDOUT, env=env).decode()
    results = re.findall(r"^COLLECT_GCC=(.*)$", version_string, re.MULTILINE)
    if len(results) != 1:
        return "clang version" in version_string
    compiler_path = os.path.realpath(results[0].strip())
    if os.path.basename(compiler_path) == "c++" and "gcc version" in version_string:
        return True
    return any(name in compiler_path for name in _accepted_compilers_for_platform())


def get_compiler_abi_compatibility_and_version(compiler: str) -> tuple[bool, str]:
    """torch 2.11's: the platform check, then ``compiler -dumpfullversion -dumpversion`` (its only other question)."""
    if not _is_binary_build() or os.environ.get("TORCH_DONT_CHECK_COMPILER_ABI") in _YES:
        return True, "0.0.0"
    if not check_compiler_ok_for_platform(compiler):
        logger.warning(WRONG_COMPILER_WARNING, compiler, "g++", sys.platform, "g++", compiler, compiler)
        return False, "0.0.0"
    try:
        info = subprocess.check_output([compiler, "-dumpfullversion", "-dumpversion"])
        match = re.search(r"(\d+)\.(\d+)\.(\d+)", info.decode().strip())
        version = ["0", "0", "0"] if match is None else list(match.groups())
    except (subprocess.CalledProcessError, OSError):
        logger.warning("Error checking compiler version for %s", compiler, exc_info=True)
        return False, "0.0.0"
    numeric = ".".join(re.sub(r"\D", "", v) for v in version)
    if _version_tuple(numeric) >= MINIMUM_GCC_VERSION:
        return True, numeric
    logger.warning(ABI_INCOMPATIBILITY_WARNING, f"{compiler} {numeric}")
    return False, numeric


def _check_compiler_bounds(compiler_name: str, compiler_version: str, cuda_str_version: str,
                           cuda_version_str: str) -> None:
    """The end of torch 2.11's _check_cuda_version: the host C++ compiler's version must suit nvcc's release."""
    if os.environ.get("TORCH_DONT_CHECK_COMPILER_ABI") in _YES or not _is_binary_build():
        return
    bounds = CUDA_CLANG_VERSIONS if compiler_name.startswith("clang") else CUDA_GCC_VERSIONS
    if cuda_str_version not in bounds:
        logger.warning("There are no %s version bounds defined for CUDA version %s", compiler_name, cuda_str_version)
        return
    low, high = bounds[cuda_str_version]
    if "V11.4.48" in cuda_version_str and bounds is CUDA_GCC_VERSIONS:
        high = (11, 0)
    low_str, high_str = ".".join(map(str, low)), ".".join(map(str, high))
    bound_str = f">={low_str}, <{high_str}"
    if _version_tuple(compiler_version) < _version_tuple(low_str):
        raise RuntimeError(
            f"The current installed version of {compiler_name} ({compiler_version}) is less "
            f"than the minimum required version by CUDA {cuda_str_version} ({low_str}). "
            f"Please make sure to use an adequate version of {compiler_name} ({bound_str})."
        )
    if _version_tuple(compiler_version) >= _version_tuple(high_str):
        raise RuntimeError(
            f"The current installed version of {compiler_name} ({compiler_version}) is greater "
            f"than the maximum required version by CUDA {cuda_str_version}. "
            f"Please make sure to use an adequate version of {compiler_name} ({bound_str})."
        )


def _join_cuda_home(*paths: str) -> str:
    if CUDA_HOME is None:
        raise OSError("CUDA_HOME environment variable is not set. Please set it to your CUDA install root.")
    return os.path.join(CUDA_HOME, *paths)


_NAMED_ARCHES = [
    ("Kepler+Tesla", "3.7"), ("Kepler", "3.5+PTX"), ("Maxwell+Tegra", "5.3"), ("Maxwell", "5.0;5.2+PTX"),
    ("Pascal", "6.0;6.1+PTX"), ("Volta+Tegra", "7.2"), ("Volta", "7.0+PTX"), ("Turing", "7.5+PTX"),
    ("Ampere+Tegra", "8.7"), ("Ampere", "8.0;8.6+PTX"), ("Ada", "8.9+PTX"), ("Hopper", "9.0+PTX"),
    ("Blackwell+Tegra", "11.0"), ("Blackwell", "10.0;10.3;12.0;12.1+PTX"),
]
_SUPPORTED_ARCHES = ["3.5", "3.7", "5.0", "5.2", "5.3", "6.0", "6.1", "6.2", "7.0", "7.2", "7.5", "8.0", "8.6", "8.7",
                     "8.9", "9.0", "9.0a", "10.0", "10.0a", "11.0", "11.0a", "10.3", "10.3a", "12.0", "12.0a", "12.1",
                     "12.1a"]


def _get_cuda_arch_flags(cflags: list[str] | None = None) -> list[str]:
    """torch 2.11's: any flag naming an arch wins (TORCH_CUDA_ARCH_LIST is then ignored); else the env list, checked;
    else the visible GPUs, and with none (the lab) ``arch_list[-1]`` raises IndexError, as in torch."""
    for flag in cflags or []:
        if "TORCH_EXTENSION_NAME" not in flag and "arch" in flag:
            return []
    env_list = os.environ.get("TORCH_CUDA_ARCH_LIST", None)
    if not env_list or env_list == "native":
        arch_list: list[str] = []  # torch.cuda.device_count() is 0 here: no GPU to ask
        arch_list[-1] += "+PTX"  # IndexError: list index out of range, exactly where torch 2.11 raises it
    env_list = env_list.replace(" ", ";")
    for named, arches in _NAMED_ARCHES:
        env_list = env_list.replace(named, arches)
    flags = []
    for arch in env_list.split(";"):
        if arch not in _SUPPORTED_ARCHES + [a + "+PTX" for a in _SUPPORTED_ARCHES]:
            raise ValueError(f"Unknown CUDA arch ({arch}) or GPU not supported")
        num = arch.split("+")[0].replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return sorted(set(flags))


def CppExtension(name: str, sources: list[str], *args: Any, **kwargs: Any) -> Extension:  # noqa: N802 (torch's name)
    kwargs["language"] = "c++"
    return Extension(name, sources, *args, **kwargs)


def CUDAExtension(name: str, sources: list[str], *args: Any, **kwargs: Any) -> Extension:  # noqa: N802 (torch's name)
    # As torch: library then include paths of CUDA_HOME (OSError without one), the libraries it links.
    kwargs["library_dirs"] = list(kwargs.get("library_dirs", [])) + library_paths(device_type="cuda")
    kwargs["libraries"] = list(kwargs.get("libraries", [])) + ["c10", "torch", "torch_cpu", "torch_python", "cudart",
                                                               "c10_cuda", "torch_cuda"]
    kwargs["include_dirs"] = list(kwargs.get("include_dirs", [])) + include_paths(device_type="cuda")
    kwargs["language"] = "c++"
    return Extension(name, sources, *args, **kwargs)


class BuildExtension(build_ext):
    """Stand-in for torch's BuildExtension: the same checks and warnings, then a pretend compile (no compiler runs).

    ``standin_compile_seconds`` (a class or instance attribute; 0 by default) is how long the pretend compile takes
    with ninja; without ninja it takes three times as long, the way the serial distutils backend is slower.
    """

    standin_compile_seconds: float = 0.0

    @classmethod
    def with_options(cls, **options: Any) -> type["BuildExtension"]:
        class cls_with_options(cls):  # type: ignore[misc, valid-type]  # noqa: N801 (torch's name)
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.update(options)
                super().__init__(*args, **kwargs)

        return cls_with_options

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        use_ninja = kwargs.pop("use_ninja", True)
        kwargs.pop("no_python_abi_suffix", None)
        super().__init__(*args, **kwargs)
        self.use_ninja = use_ninja
        if self.use_ninja:
            msg = (
                "Attempted to use ninja as the BuildExtension backend but "
                "%s. Falling back to using the slow distutils backend."
            )
            if not is_ninja_available():
                logger.warning(msg, "we could not find ninja.")
                self.use_ninja = False

    def _check_abi(self) -> tuple[str, str]:
        # torch asks setuptools' C++ compiler (CXX, else Python's sysconfig CXX: x86_64-linux-gnu-g++ on Debian),
        # not get_cxx_compiler()'s c++.
        compiler = self.compiler.compiler_cxx[0] if hasattr(self.compiler, "compiler_cxx") else get_cxx_compiler()
        _, version = get_compiler_abi_compatibility_and_version(compiler)
        return compiler, version

    def build_extensions(self) -> None:
        compiler_name, compiler_version = self._check_abi()
        cuda_ext = any(os.path.splitext(src)[1] == ".cu" for ext in self.extensions for src in ext.sources)
        if cuda_ext:
            _check_cuda_version(compiler_name, compiler_version)
        for ext in self.extensions:
            self.build_extension(ext)

    def build_extension(self, ext: Extension) -> None:
        sources = list(ext.sources)
        with_cuda = any(os.path.splitext(src)[1] in (".cu", ".cuh") for src in sources)
        nvcc_args = ext.extra_compile_args.get("nvcc", []) if isinstance(ext.extra_compile_args, dict) else []
        # torch adds its own -gencode flags unless the extension names an arch (causal-conv1d does).
        if with_cuda:
            nvcc_args = list(nvcc_args) + _get_cuda_arch_flags(nvcc_args)
        flat = " ".join(a for a in nvcc_args if isinstance(a, str))
        archs = sorted(set(re.findall(r"arch=compute_\w+,code=(sm_\w+)", flat)), key=lambda a: (len(a), a))
        archs = [a.split("code=")[-1] for a in nvcc_args if isinstance(a, str) and a.startswith("arch=")] or archs
        max_jobs = os.environ.get("MAX_JOBS")
        if max_jobs is not None:
            # torch only logs this at debug level; the stand-in always echoes it so tests and logs can see it.
            if not max_jobs.isdigit():
                how = "not a number: torch ignores it and ninja picks its default"
            elif self.use_ninja:
                how = f"ninja -j {max_jobs}"
            else:
                how = "ignored: distutils builds one file at a time"
            print(f"[fleetcuda stand-in] MAX_JOBS={max_jobs} ({how})", flush=True)
        # torch's ninja path makes the build directory absolute; setuptools alone keeps it as given.
        temp = os.path.join(os.path.abspath(self.build_temp) if self.use_ninja else self.build_temp, "csrc")
        # As setuptools' _setup_compile: the object directory first ("could not create ...: Permission denied").
        self.mkpath(temp)
        if self.use_ninja:
            self._standin_run_ninja(os.path.abspath(self.build_temp))
        nvcc = (os.getenv("PYTORCH_NVCC") if self.use_ninja else None) or _join_cuda_home("bin", "nvcc")
        gencode = " ".join(f"-gencode arch=compute_{a.split('_')[-1]},code={a}" for a in archs)
        total = len(sources) + 1
        seconds = float(self.standin_compile_seconds) * (1 if self.use_ninja else 3)
        step = seconds / max(len(sources), 1)
        failed = False
        for i, src in enumerate(sources, 1):
            obj = os.path.join(temp, os.path.splitext(os.path.basename(src))[0] + ".o")
            if src.endswith(".cu"):
                exe = nvcc
                cmd = f"{nvcc} -c {src} -o {obj} -O3 --use_fast_math --ptxas-options=-v -lineinfo {gencode} --threads 4"
            else:
                exe = get_cxx_compiler() if self.use_ninja else self._distutils_cxx(src)
                cmd = f"{exe} -c {src} -o {obj} -O3 -fPIC -std=c++17"
            print(f"[{i}/{total}] {cmd}" if self.use_ninja else cmd, flush=True)
            text = _compile_error(src, exe, nvcc_args)
            if text is not None:
                if not self.use_ninja:
                    # setuptools' spawn runs the compiler itself (no shell): the path shutil.which finds, else
                    # the name as given, which Python cannot start.
                    if shutil.which(exe) is None:
                        raise CompileError(f"command '{exe}' failed: No such file or directory")
                    print(text, flush=True)
                    raise CompileError(f"command '{shutil.which(exe)}' failed with exit code 1")
                print(f"FAILED: {obj}\n{cmd}\n{text}", flush=True)
                failed = True
                continue
            if src.endswith(".cu"):
                for arch in archs:
                    print(f"ptxas info    : Compiling entry function for '{arch}' (fleetcuda stand-in)", flush=True)
            with open(obj, "w", encoding="utf-8") as fh:
                fh.write("fleetcuda lab stand-in: placeholder object\n")
            time.sleep(step)
        if failed:
            print("ninja: build stopped: subcommand failed.", flush=True)
            raise RuntimeError("Error compiling objects for extension")
        target = self.get_ext_fullpath(ext.name)
        self.mkpath(os.path.dirname(target))
        # setuptools links (after ninja too) with the C++ linker: linker_so_cxx, or older setuptools' compiler_cxx.
        linker = (getattr(self.compiler, "linker_so_cxx", None) or self.compiler.compiler_cxx)[0]
        link = f"{linker} -shared -o {target}"
        print(f"[{total}/{total}] {link}" if self.use_ninja else link, flush=True)
        if shutil.which(linker) is None:
            raise LinkError(f"command '{linker}' failed: No such file or directory")
        # ld needs libcudart.so (cuda-cudart-dev's link-time name) in the CUDA library directory CUDAExtension added;
        # torch's own libraries are not checked (the stand-in wheel has none).
        for lib in (name for name in ext.libraries if name == "cudart"):
            if not any(os.path.exists(os.path.join(d, f"lib{lib}{suffix}")) for d in ext.library_dirs
                       for suffix in (".so", ".a")):
                print(f"/usr/bin/ld: cannot find -l{lib}: No such file or directory\n"
                      "collect2: error: ld returned 1 exit status", flush=True)
                raise LinkError(f"command '{shutil.which(linker)}' failed with exit code 1")
        with open(target, "w", encoding="utf-8") as fh:
            # Not ELF: importing it fails loudly instead of pretending to be a kernel library.
            fh.write("fleetcuda lab stand-in: placeholder for a compiled extension, not a shared object\n")

    @staticmethod
    def _standin_run_ninja(build_dir: str) -> None:
        """torch writes build.ninja and runs ``ninja -v [-j MAX_JOBS]`` there (check=True).  The stand-in runs the
        same ninja on a file without compile edges, so a ninja that answers --version but cannot build fails here
        with torch's error, and MAX_JOBS reaches it as torch passes it (only when it is all digits)."""
        # _write_ninja_file_and_compile_objects' own checks first: ninja again (now an error), and get_cxx_compiler()
        # (c++, the compiler of the ninja rule), whose warnings it prints but whose answer it ignores.
        verify_ninja_availability()
        get_compiler_abi_compatibility_and_version(get_cxx_compiler())
        with open(os.path.join(build_dir, "build.ninja"), "w", encoding="utf-8") as fh:
            fh.write("# fleetcuda lab stand-in: no compile edges, the compile is pretended\n"
                     "ninja_required_version = 1.3\n\nbuild standin: phony\n")
        command = ["ninja", "-v"]
        max_jobs = os.environ.get("MAX_JOBS")
        if max_jobs is not None and max_jobs.isdigit():
            command += ["-j", max_jobs]
        sys.stdout.flush()
        try:
            subprocess.run(command, cwd=build_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=True)
        except subprocess.CalledProcessError as err:
            # torch runs ninja with its output on stdout, and the error is the bare prefix.
            print(err.output.decode(errors="replace"), end="", flush=True)
            raise RuntimeError("Error compiling objects for extension") from err

    def _distutils_cxx(self, src: str) -> str:
        """What setuptools compiles a .cpp with: compiler_so_cxx (setuptools >= 73), else compiler_so (CC)."""
        cxx_so = getattr(self.compiler, "compiler_so_cxx", None)
        if cxx_so and self.compiler.detect_language(src) == "c++":
            return cxx_so[0]
        return self.compiler.compiler_so[0]


# What nvcc itself refuses (torch does not check either).  `nvcc --list-gpu-arch` of the real 13.0.88; 12.8 and 12.9
# per NVIDIA's release notes (12.9 added 103 and 121; 13.0 dropped 50-72 and renamed 101 to 110).
_NVCC_12_8 = {"50", "52", "53", "60", "61", "62", "70", "72", "75", "80", "86", "87", "89", "90", "100", "101", "120"}
NVCC_ARCHS = {
    "12.8": _NVCC_12_8,
    "12.9": _NVCC_12_8 | {"103", "121"},
    "13.0": {"75", "80", "86", "87", "88", "89", "90", "100", "103", "110", "120", "121"},
}
# crt/host_config.h's "#if __GNUC__ > N" and the line of its #error, read in NVIDIA's 12.8.93 and 13.0.88 headers.
NVCC_GCC_MAX = {"12.8": (14, 143), "13.0": (15, 137)}
_NVCC_RELEASES: dict[str, str | None] = {}


def _nvcc_release_of(nvcc: str) -> str | None:
    if nvcc not in _NVCC_RELEASES:
        try:
            out = subprocess.check_output([nvcc, "--version"]).decode()
        except (OSError, subprocess.CalledProcessError):
            out = ""
        found = re.search(r"release (\d+[.]\d+)", out)
        _NVCC_RELEASES[nvcc] = found.group(1) if found else None
    return _NVCC_RELEASES[nvcc]


def _nvcc_error(nvcc: str, nvcc_args: list[str]) -> str | None:
    """What nvcc prints where it stops before compiling a .cu, in its order: an arch it does not know, no host
    compiler, no cuda_runtime.h (it force-includes it), a gcc newer than its crt/host_config.h accepts."""
    release = _nvcc_release_of(nvcc)
    flat = " ".join(a for a in nvcc_args if isinstance(a, str))
    for arch in re.findall(r"(?:compute|sm)_(\d+)[af]?", flat):
        if release in NVCC_ARCHS and arch not in NVCC_ARCHS[release]:
            kind = "compute" if f"compute_{arch}" in flat else "sm"
            return f"nvcc fatal   : Unsupported gpu architecture '{kind}_{arch}'"
    # nvcc runs the host compiler (-ccbin $CC, which torch adds when CC is set, else gcc on PATH) first.
    host = os.getenv("CC") or "gcc"
    if shutil.which(host) is None:
        return (f"{host}: No such file or directory\n"
                "nvcc fatal   : Failed to preprocess host compiler properties.")
    if not os.path.exists(os.path.join(_join_cuda_home("include"), "cuda_runtime.h")):
        return "<command-line>: fatal error: cuda_runtime.h: No such file or directory\ncompilation terminated."
    if release in NVCC_GCC_MAX and "-allow-unsupported-compiler" not in flat:
        try:
            major = int(subprocess.check_output([host, "-dumpversion"]).decode().strip().split(".")[0])
        except (OSError, subprocess.CalledProcessError, ValueError):
            return None
        limit, line = NVCC_GCC_MAX[release]
        if major > limit:
            header = os.path.join(os.path.dirname(nvcc), "..", "targets", "x86_64-linux", "include", "crt",
                                  "host_config.h")
            return (f"{header}:{line}:2: error: #error -- unsupported GNU version! gcc versions later than {limit} "
                    "are not supported! The nvcc flag '-allow-unsupported-compiler' can be used to override this "
                    "version check; however, using an unsupported host compiler may cause compilation failure or "
                    "incorrect run time execution. Use at your own risk.")
    return None


_CUDA_HEADER = re.compile(r"^\s*#\s*include\s*<(c10/cuda/|ATen/cuda/|cuda_runtime|cuda\.h)", re.MULTILINE)


def _compile_error(src: str, exe: str, nvcc_args: list[str]) -> str | None:
    """What the compile of ``src`` by ``exe`` prints where the real one could not get going, else None."""
    if src.endswith(".cu"):
        return _nvcc_error(exe, nvcc_args)
    if shutil.which(exe) is None:
        return f"/bin/sh: 1: {exe}: not found"
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        header = os.path.join(_TORCH_PATH, "include", "torch", "csrc", "python_headers.h")
        # Line 13 in torch 2.11's header (read), reached through torch/extension.h -> torch/python.h -> Device.h.
        return (f"{header}:13:10: fatal error: Python.h: No such file or directory\n"
                "   13 | #include <Python.h>\n      |          ^~~~~~~~~~\ncompilation terminated.")
    try:
        with open(src, encoding="utf-8", errors="replace") as fh:
            uses_cuda = _CUDA_HEADER.search(fh.read()) is not None
    except OSError:
        uses_cuda = False
    # cuda-cudart-dev ships cuda_runtime.h and cuda_runtime_api.h together; the lab's apt stand-in of it ships only
    # the former, so that one stands for both.  The message is the real one: the first CUDA header torch's own
    # headers pull in (c10/cuda/CUDAStream.h:4 in torch 2.11, read).
    if uses_cuda and CUDA_HOME and not os.path.exists(os.path.join(CUDA_HOME, "include", "cuda_runtime.h")):
        header = os.path.join(_TORCH_PATH, "include", "c10", "cuda", "CUDAStream.h")
        return (f"{header}:4:10: fatal error: cuda_runtime_api.h: No such file or directory\n"
                "    4 | #include <cuda_runtime_api.h>\n      |          ^~~~~~~~~~~~~~~~~~~~\ncompilation terminated.")
    return None
