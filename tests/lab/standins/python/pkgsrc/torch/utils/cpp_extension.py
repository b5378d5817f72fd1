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
  PATH; being importable is not enough), checks the CUDA version before compiling, then pretends to compile: it
  prints ninja/nvcc-like lines for the -gencode archs it was given, sleeps ``standin_compile_seconds`` (three times as
  long without ninja) and writes a placeholder file where the shared object would be.  It never runs a compiler, but
  fails as the real compile does where one would not start: no ``c++`` (``CXX``) on PATH for .cpp sources and the
  link, no ``gcc`` on PATH for nvcc's host compiler, no ``Python.h`` in the interpreter's include directory (torch's
  headers include it); with ninja torch then raises "Error compiling objects for extension", without it
  setuptools' "command ... failed".
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
from setuptools.errors import CompileError

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
    paths = [os.path.join(_TORCH_PATH, "include")]
    if device_type == "cuda" and CUDA_HOME:
        paths.append(os.path.join(CUDA_HOME, "include"))
    return paths


def library_paths(device_type: str = "cpu") -> list[str]:
    paths = [os.path.join(_TORCH_PATH, "lib")]
    if device_type == "cuda" and CUDA_HOME:
        paths.append(os.path.join(CUDA_HOME, "lib64"))
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


def check_compiler_ok_for_platform(compiler: str) -> bool:
    # The stand-in stops at "is it on PATH"; torch goes on to check that it is gcc/clang and its version bounds.
    return shutil.which(compiler) is not None


def CppExtension(name: str, sources: list[str], *args: Any, **kwargs: Any) -> Extension:  # noqa: N802 (torch's name)
    kwargs["language"] = "c++"
    return Extension(name, sources, *args, **kwargs)


def CUDAExtension(name: str, sources: list[str], *args: Any, **kwargs: Any) -> Extension:  # noqa: N802 (torch's name)
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
        compiler = get_cxx_compiler()
        if not check_compiler_ok_for_platform(compiler):
            logger.warning(WRONG_COMPILER_WARNING, compiler, "g++", sys.platform, "g++", compiler, compiler)
        return compiler, "0.0.0"

    def build_extensions(self) -> None:
        compiler_name, compiler_version = self._check_abi()
        cuda_ext = any(os.path.splitext(src)[1] == ".cu" for ext in self.extensions for src in ext.sources)
        if cuda_ext:
            _check_cuda_version(compiler_name, compiler_version)
        for ext in self.extensions:
            self.build_extension(ext)

    def build_extension(self, ext: Extension) -> None:
        sources = list(ext.sources)
        nvcc_args = ext.extra_compile_args.get("nvcc", []) if isinstance(ext.extra_compile_args, dict) else []
        archs = [a.split("code=")[-1] for a in nvcc_args if isinstance(a, str) and a.startswith("arch=")]
        temp = os.path.join(self.build_temp, "csrc")
        nvcc = os.path.join(CUDA_HOME or "/usr/local/cuda", "bin", "nvcc")
        max_jobs = os.environ.get("MAX_JOBS")
        if max_jobs is not None:
            # torch only logs this at debug level; the stand-in always echoes it so tests and logs can see it.
            how = f"ninja -j {max_jobs}" if self.use_ninja else "ignored: distutils builds one file at a time"
            print(f"[fleetcuda stand-in] MAX_JOBS={max_jobs} ({how})", flush=True)
        gencode = " ".join(f"-gencode arch=compute_{a.split('_')[-1]},code={a}" for a in archs)
        total = len(sources) + 1
        seconds = float(self.standin_compile_seconds) * (1 if self.use_ninja else 3)
        step = seconds / max(len(sources), 1)
        failed = False
        for i, src in enumerate(sources, 1):
            obj = os.path.join(temp, os.path.splitext(os.path.basename(src))[0] + ".o")
            if src.endswith(".cu"):
                cmd = f"{nvcc} -c {src} -o {obj} -O3 --use_fast_math --ptxas-options=-v -lineinfo {gencode} --threads 4"
            else:
                cmd = f"{get_cxx_compiler()} -c {src} -o {obj} -O3 -fPIC -std=c++17"
            print(f"[{i}/{total}] {cmd}" if self.use_ninja else cmd, flush=True)
            error = _compile_error(src)
            if error is not None:
                exe, text = error
                if not self.use_ninja:
                    print(text, flush=True)
                    raise CompileError(f"command '{exe}' failed with exit code 1")
                print(f"FAILED: {obj}\n{cmd}\n{text}", flush=True)
                failed = True
                continue
            if src.endswith(".cu"):
                for arch in archs:
                    print(f"ptxas info    : Compiling entry function for '{arch}' (fleetcuda stand-in)", flush=True)
            time.sleep(step)
        if failed:
            print("ninja: build stopped: subcommand failed.", flush=True)
            raise RuntimeError("Error compiling objects for extension")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        link = f"{get_cxx_compiler()} -shared -o {target}"
        print(f"[{total}/{total}] {link}" if self.use_ninja else link, flush=True)
        if shutil.which(get_cxx_compiler()) is None:
            print(f"/bin/sh: 1: {get_cxx_compiler()}: not found", flush=True)
            raise RuntimeError("Error building extension") if self.use_ninja else CompileError(
                f"command '{get_cxx_compiler()}' failed: No such file or directory")
        with open(target, "w", encoding="utf-8") as fh:
            # Not ELF: importing it fails loudly instead of pretending to be a kernel library.
            fh.write("fleetcuda lab stand-in: placeholder for a compiled extension, not a shared object\n")


def _compile_error(src: str) -> tuple[str, str] | None:
    """(the compiler, what it prints) where the real compile of ``src`` could not start, else None."""
    if src.endswith(".cu"):
        # nvcc runs the host compiler (gcc on PATH) before it compiles anything.
        if shutil.which("gcc") is None:
            return "nvcc", ("gcc: No such file or directory\n"
                            "nvcc fatal   : Failed to preprocess host compiler properties.")
        return None
    cxx = get_cxx_compiler()
    if shutil.which(cxx) is None:
        return cxx, f"/bin/sh: 1: {cxx}: not found"
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        header = os.path.join(_TORCH_PATH, "include", "torch", "csrc", "python_headers.h")
        return cxx, (f"{header}:12:10: fatal error: Python.h: No such file or directory\n"
                     "   12 | #include <Python.h>\n      |          ^~~~~~~~~~\ncompilation terminated.")
    return None
