"""Offline installs: stage a wheelhouse on the control machine, then put it on the targets.

`build` runs pip download for the target's Python and platform: binary wheels for the recipe's
`wheelhouse.wheels`, and sdists for `wheelhouse.sdists` (built later on each target, against its
own torch). Note that pip prepares an sdist's metadata by running its setup.py, so the Python that
downloads causal-conv1d needs torch, wheel, setuptools and packaging; `sdist_env` (for example
CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE) keeps it from looking for CUDA.

`push` copies the files to each target over the host's one SSH connection (SFTP to a private
temporary directory on the host, then `pct push` into each container), or locally.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fleetcuda.errors import FleetcudaError, InputError

# Light at import (what runs, renders or connects is imported by the function that does it): the parser,
# for `fleetcuda --help` too, reads DEFAULT_DEST, and the wheel cache reads sha256.
if TYPE_CHECKING:
    from fleetcuda.connectors.base import Transport
    from fleetcuda.plan.inventory import Target
    from fleetcuda.plan.recipe import Recipe

DEFAULT_DEST = "/var/cache/fleetcuda/wheelhouse"
SUFFIXES = (".whl", ".tar.gz", ".zip")


@dataclass
class DownloadPlan:
    commands: list[tuple[list[str], dict[str, str]]]  # argv, extra environment


def plan_download(recipe: Recipe, values: dict[str, str], dest: Path, *, python: str, python_version: str | None,
                  platforms: list[str], pip_args: list[str]) -> DownloadPlan:
    from fleetcuda.plan.templating import render

    spec = recipe.wheelhouse
    if spec is None or not (spec.wheels or spec.sdists):
        raise FleetcudaError(f"{recipe.path}: the recipe has no `wheelhouse:` section listing wheels and sdists")
    pip = [python, "-m", "pip", "download", "--disable-pip-version-check", "--no-input", "-d", str(dest), *pip_args]
    commands = []
    wheels = [render(w, values) for w in spec.wheels]
    if wheels:
        target = ["--only-binary=:all:", "--no-deps"]
        if python_version:
            target += ["--python-version", python_version, "--implementation", "cp"]
        for plat in platforms:
            target += ["--platform", plat]
        commands.append(([*pip, *target, *wheels], {}))
    for sdist in spec.sdists:
        env = {k: render(v, values) for k, v in spec.sdist_env.items()}
        commands.append(([*pip, "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
                          render(sdist, values)], env))
    return DownloadPlan(commands)


def run_download(plan: DownloadPlan, echo: Callable[[str], None]) -> None:
    import subprocess

    from fleetcuda.plan.command import join_for_paste, quote

    for argv, env in plan.commands:
        shown = " ".join(f"{k}={quote(v)}" for k, v in env.items())
        echo(f"$ {shown + ' ' if shown else ''}{join_for_paste(argv)}")
        try:
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace")
        except OSError as exc:
            raise FleetcudaError(f"wheelhouse build: cannot run {argv[0]} on this machine (the control machine): "
                                 f"{exc.strerror or exc}; give --python an interpreter that exists") from None
        output = []
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line.rstrip("\n"))
            echo(output[-1])
        if proc.wait() != 0:
            raise FleetcudaError(_download_failure(argv, proc.returncode, output))


def _download_failure(argv: list[str], rc: int, output: list[str]) -> str:
    """What the control machine lacks, when pip says so: its Python without pip, or without a module that an
    sdist's setup.py imports (pip runs it to read the metadata, with --no-build-isolation in this Python)."""
    import re

    python, what = argv[0], argv[-1]
    missing = [m for ln in output for m in re.findall(r"No module named '?([\w.]+)'?", ln)]
    if "pip" in missing:
        return (f"wheelhouse build: the control machine's Python ({python}) has no pip: install pip into it, or "
                "give --python an interpreter that has it")
    sdist = "--no-binary" in argv
    if missing:
        module = missing[-1].split(".")[0]
        why = (f"preparing the sdist {what} runs its setup.py in this Python (--no-build-isolation), and it "
               f"imports {module}" if sdist else f"pip needs {module}")
        return (f"wheelhouse build: the control machine's Python ({python}) lacks {module}: {why}; install "
                f"{module} into it (pip install {module}), or give --python an interpreter that has it")
    last = next((ln.strip() for ln in reversed(output) if ln.strip()), "")
    return (f"wheelhouse build: pip download of {what if sdist else 'the wheels'} failed on the control machine "
            f"(exit {rc})" + (f": {last}" if last else ""))


def files_of(directory: Path) -> list[Path]:
    """The wheels and sdists in DIR; a DIR that is missing, not a directory or unreadable is bad input."""
    shown = str(directory) if str(directory).isprintable() else ascii(str(directory))
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        raise InputError("wheelhouse push", None, "DIR", f"{shown}: no such directory") from None
    except NotADirectoryError:
        raise InputError("wheelhouse push", None, "DIR", f"{shown} is not a directory") from None
    except (OSError, ValueError) as exc:
        raise InputError("wheelhouse push", None, "DIR",
                         f"{shown}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    files = sorted(p for p in entries if p.is_file() and p.name.endswith(SUFFIXES))
    if not files:
        raise FleetcudaError(f"{directory} holds no wheels or sdists")
    return files


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def push(target: Target, transport: Transport, files: list[Path], dest: str,
         echo: Callable[[str], None]) -> None:
    """Copy files to `dest` in the target; containers receive them through `pct push`."""
    from fleetcuda.connectors.transfer import host_staging_dir, in_target, into_container, remove_on_host, to_host
    from fleetcuda.plan.command import quote

    in_target(transport, target, f"umask 022; mkdir -p {quote(dest)}", f"creating {dest}", timeout=60)
    if target.container is None:
        for f in files:
            to_host(transport, f, f"{dest}/{f.name}")
            if transport.local:
                os.chmod(Path(dest) / f.name, 0o644)
        echo(f"{target.id}: {len(files)} file(s) in {dest}")
        return
    # Locally pct reads the files where they are; over SSH they go to a private directory on the host first.
    staging = host_staging_dir(transport, target) if not transport.local else None
    try:
        for f in files:
            if staging:
                to_host(transport, f, f"{staging}/{f.name}")
            into_container(transport, target, f"{staging}/{f.name}" if staging else str(f), f"{dest}/{f.name}")
        echo(f"{target.id}: {len(files)} file(s) pushed into {dest}")
    finally:
        if staging:
            remove_on_host(transport, target, staging)
