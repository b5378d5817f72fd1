#!/usr/bin/env python3
"""Build fleetcuda's lab wheelhouse: offline stand-ins for the CUDA Python stack, plus real build tools from PyPI.

Usage: build_wheelhouse.py OUTDIR [--no-download]

Containers (Debian 12, Python 3.11, x86_64, offline, no GPU) install from OUTDIR with
``pip install --no-index --find-links OUTDIR ...``.  Written by this script, with no network access:

- torch-2.11.0+cu128-py3-none-any.whl, torch-2.11.0+cu130-py3-none-any.whl: stand-ins for the CUDA 12.8 / 13.0
  builds of torch 2.11 (version attributes, torch.cuda without a GPU, torch.utils.cpp_extension);
- fla_core-0.6.0-py3-none-any.whl: stand-in for fla-core (package ``fla``), requires einops;
- causal_conv1d-1.7.0.tar.gz: stand-in sdist whose setup.py fails like the real one at each missing piece, and
  builds a platform wheel (cp311-cp311-linux_x86_64 on Python 3.11) when everything is there.

Downloaded with ``python3 -m pip download`` for cp311 manylinux x86_64, unless --no-download: wheel, setuptools<76,
packaging, ninja, einops.  Re-running is safe: the stand-ins come out byte-identical, and the download step is skipped
when OUTDIR already holds a wheel for each of them.  The sources of the stand-ins live in pkgsrc/ next to this file;
every one says in its docstrings and metadata Summary that it is a fleetcuda lab stand-in, not the real package.

Exit status: 0; 1 when pip download failed (the stand-ins are written first, so they are there either way);
2 for usage errors.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PKGSRC = HERE / "pkgsrc"

# Fixed timestamps make every rebuild byte-identical (idempotent, and diffable between runs).
ZIP_DATE = (2026, 1, 1, 0, 0, 0)
TAR_MTIME = 1767225600  # 2026-01-01T00:00:00Z

TORCH_VERSION = "2.11.0"
TORCH_FLAVOURS = {"cu128": "12.8", "cu130": "13.0"}
FLA_VERSION = "0.6.0"
CAUSAL_CONV1D_VERSION = "1.7.0"

# The real wheels the stand-ins need in an offline container, as (requirement, canonical name, exclusive max major).
DOWNLOADS: list[tuple[str, str, int | None]] = [
    ("wheel", "wheel", None),
    ("setuptools<76", "setuptools", 76),
    ("packaging", "packaging", None),
    ("ninja", "ninja", None),
    ("einops", "einops", None),
]
PIP_TARGET = [
    "--only-binary=:all:",
    "--python-version", "3.11",
    "--implementation", "cp",
    "--abi", "cp311",
    "--platform", "manylinux2014_x86_64",
    "--platform", "manylinux_2_17_x86_64",
    "--platform", "any",
]  # fmt: skip

STANDIN = "fleetcuda lab stand-in"


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _atomic_write(target: Path, data: bytes) -> None:
    # Containers may read the wheelhouse over a shared mount while it is rebuilt: never show a half-written file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tree_files(src: Path, prefix: str) -> dict[str, bytes]:
    """Files under src keyed by archive path prefix/relative, skipping bytecode caches."""
    files: dict[str, bytes] = {}
    for path in sorted(src.rglob("*")):
        if path.is_dir() or "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        files[f"{prefix}/{path.relative_to(src).as_posix()}"] = path.read_bytes()
    return files


def write_wheel(outdir: Path, name: str, version: str, files: dict[str, bytes], metadata: str) -> Path:
    """Write a pure-Python wheel (tag py3-none-any) with METADATA, WHEEL and RECORD, deterministically."""
    dist = re.sub(r"[-_.]+", "_", name).lower()
    dist_info = f"{dist}-{version}.dist-info"
    wheel_meta = (
        "Wheel-Version: 1.0\nGenerator: fleetcuda build_wheelhouse.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    top_level = sorted({arc.split("/", 1)[0] for arc in files})
    contents = dict(sorted(files.items()))
    contents[f"{dist_info}/METADATA"] = metadata.encode()
    contents[f"{dist_info}/WHEEL"] = wheel_meta.encode()
    contents[f"{dist_info}/top_level.txt"] = ("\n".join(top_level) + "\n").encode()
    record = "".join(f"{arc},{_record_hash(data)},{len(data)}\n" for arc, data in contents.items())
    contents[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for arc, data in contents.items():
            info = zipfile.ZipInfo(arc, date_time=ZIP_DATE)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    target = outdir / f"{dist}-{version}-py3-none-any.whl"
    _atomic_write(target, buf.getvalue())
    return target


def _metadata(name: str, version: str, summary: str, body: str, requires: list[str], python: str) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        f"Summary: {summary}",
        "Author: fleetcuda test lab",
        f"Requires-Python: {python}",
        "Description-Content-Type: text/markdown",
        *[f"Requires-Dist: {req}" for req in requires],
    ]
    return "\n".join(lines) + "\n\n" + body


def build_torch(outdir: Path, flavour: str, cuda: str) -> Path:
    version = f"{TORCH_VERSION}+{flavour}"
    files = tree_files(PKGSRC / "torch", "torch")
    files["torch/version.py"] = (
        f'"""{STANDIN} for torch {version}: NOT the real torch.version (written by build_wheelhouse.py)."""\n'
        "\n"
        "__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']\n"
        f"__version__ = {version!r}\n"
        "debug = False\n"
        f"cuda: str | None = {cuda!r}\n"
        "git_version = 'fleetcuda-lab-standin'\n"
        "hip: str | None = None\n"
        "rocm: str | None = None\n"
        "xpu: str | None = None\n"
    ).encode()
    summary = f"{STANDIN} for torch {version} (CUDA {cuda}), NOT the real PyTorch: no tensors, no GPU code"
    body = (
        f"# torch {version}: {STANDIN}\n\n"
        "**Not PyTorch.** Built by fleetcuda's `tests/lab/standins/python/build_wheelhouse.py` for offline, GPU-less "
        "test containers: version attributes, `torch.cuda` without a GPU, `torch.utils.cpp_extension` "
        "(CUDA_HOME discovery, the nvcc version check, a BuildExtension that pretends to compile).\n"
    )
    return write_wheel(outdir, "torch", version, files, _metadata("torch", version, summary, body, [], ">=3.10"))


def build_fla(outdir: Path) -> Path:
    summary = f"{STANDIN} for fla-core {FLA_VERSION} (package fla), NOT the real flash-linear-attention: no kernels"
    body = (
        f"# fla-core {FLA_VERSION}: {STANDIN}\n\n"
        "**Not fla-core.** Imports torch and einops like the real one; `fla.ops.gated_delta_rule` exports "
        "`chunk_gated_delta_rule` and `fused_recurrent_gated_delta_rule`, which raise RuntimeError (no GPU).\n"
    )
    meta = _metadata("fla-core", FLA_VERSION, summary, body, ["einops"], ">=3.10")
    return write_wheel(outdir, "fla-core", FLA_VERSION, tree_files(PKGSRC / "fla", "fla"), meta)


def build_causal_conv1d_sdist(outdir: Path) -> Path:
    src = PKGSRC / "causal_conv1d"
    root = f"causal_conv1d-{CAUSAL_CONV1D_VERSION}"
    summary = f"{STANDIN} for causal-conv1d {CAUSAL_CONV1D_VERSION}, NOT the real package (no CUDA kernels)"
    pkg_info = _metadata(
        "causal_conv1d",
        CAUSAL_CONV1D_VERSION,
        summary,
        (src / "README.md").read_text(encoding="utf-8"),
        ["torch", "packaging", "ninja"],
        ">=3.9",
    )
    files = tree_files(src, root)
    files[f"{root}/PKG-INFO"] = pkg_info.encode()

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({str(Path(arc).parent) for arc in files} | {root})
        for arc in [*dirs, *sorted(files)]:
            info = tarfile.TarInfo(arc)
            info.mtime = TAR_MTIME
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if arc in files:
                info.size = len(files[arc])
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(files[arc]))
            else:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
    gz = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=gz, mtime=0) as fh:
        fh.write(raw.getvalue())
    target = outdir / f"{root}.tar.gz"
    _atomic_write(target, gz.getvalue())
    return target


def build_standins(outdir: Path) -> list[Path]:
    built = [build_torch(outdir, flavour, cuda) for flavour, cuda in TORCH_FLAVOURS.items()]
    built.append(build_fla(outdir))
    built.append(build_causal_conv1d_sdist(outdir))
    return built


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_downloads(outdir: Path) -> list[str]:
    """Requirements in DOWNLOADS with no matching wheel in outdir yet."""
    have: dict[str, list[str]] = {}
    for whl in outdir.glob("*.whl"):
        parts = whl.name.split("-")
        if len(parts) >= 5:
            have.setdefault(_canonical(parts[0]), []).append(parts[1])
    missing = []
    for requirement, name, below_major in DOWNLOADS:
        versions = have.get(name, [])
        if below_major is not None:
            versions = [v for v in versions if v.split(".")[0].isdigit() and int(v.split(".")[0]) < below_major]
        if not versions:
            missing.append(requirement)
    return missing


def download_tools(outdir: Path) -> int:
    missing = missing_downloads(outdir)
    if not missing:
        print(f"build_wheelhouse: {', '.join(r for r, _, _ in DOWNLOADS)} already in {outdir}; not downloading")
        return 0
    # All five in one resolve, so that their own requirements (wheel needs packaging>=24) come out consistent.
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", *PIP_TARGET, "-d", str(outdir)]
    cmd += [requirement for requirement, _, _ in DOWNLOADS]
    print("build_wheelhouse: " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path, help="wheelhouse directory (created if missing)")
    parser.add_argument(
        "--no-download", action="store_true", help="only write the stand-ins; skip pip download of the real tools"
    )
    args = parser.parse_args(argv)
    outdir: Path = args.outdir.resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    for path in build_standins(outdir):
        print(f"build_wheelhouse: wrote {path}")
    if args.no_download:
        return 0
    rc = download_tools(outdir)
    if rc != 0:
        print(f"build_wheelhouse: pip download failed (exit {rc}); the stand-ins are in {outdir}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
