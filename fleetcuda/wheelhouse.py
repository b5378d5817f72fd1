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
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleetcuda.command import HopChain, Invocation, build, join, join_for_paste, quote
from fleetcuda.errors import FleetcudaError
from fleetcuda.inventory import Target
from fleetcuda.planner import SYSTEM_PATH
from fleetcuda.recipe import Recipe
from fleetcuda.templating import render
from fleetcuda.transport import LocalTransport, SshTransport, Transport

DEFAULT_DEST = "/var/cache/fleetcuda/wheelhouse"
SUFFIXES = (".whl", ".tar.gz", ".zip")


@dataclass
class DownloadPlan:
    commands: list[tuple[list[str], dict[str, str]]]  # argv, extra environment


def plan_download(recipe: Recipe, values: dict[str, str], dest: Path, *, python: str, python_version: str | None,
                  platforms: list[str], pip_args: list[str]) -> DownloadPlan:
    spec = recipe.wheelhouse
    if spec is None or not (spec.wheels or spec.sdists):
        raise FleetcudaError(f"{recipe.path}: the recipe has no `wheelhouse:` section listing wheels and sdists")
    pip = [python, "-m", "pip", "download", "--disable-pip-version-check", "--no-input", "-d", str(dest), *pip_args]
    commands = []
    wheels = [render(w, values, shell=False) for w in spec.wheels]
    if wheels:
        target = ["--only-binary=:all:", "--no-deps"]
        if python_version:
            target += ["--python-version", python_version, "--implementation", "cp"]
        for plat in platforms:
            target += ["--platform", plat]
        commands.append(([*pip, *target, *wheels], {}))
    for sdist in spec.sdists:
        env = {k: render(v, values, shell=False) for k, v in spec.sdist_env.items()}
        commands.append(([*pip, "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
                          render(sdist, values, shell=False)], env))
    return DownloadPlan(commands)


def run_download(plan: DownloadPlan, echo: Callable[[str], None]) -> None:
    for argv, env in plan.commands:
        shown = " ".join(f"{k}={quote(v)}" for k, v in env.items())
        echo(f"$ {shown + ' ' if shown else ''}{join_for_paste(argv)}")
        proc = subprocess.run(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise FleetcudaError(f"pip download failed (exit {proc.returncode}); nothing was pushed")


def files_of(directory: Path) -> list[Path]:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(SUFFIXES))
    if not files:
        raise FleetcudaError(f"{directory} holds no wheels or sdists")
    return files


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _host_chain(target: Target) -> HopChain:
    return HopChain(ssh=target.chain.ssh)


def _run(transport: Transport, chain: HopChain, argv: list[str], what: str) -> str:
    """A command on the host itself (not in a container): argv through the login shell, or local."""
    cmd = build(chain, Invocation(join(argv), {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"}))
    res = transport.run(cmd, timeout=600, on_line=lambda line: None)
    if res.rc != 0:
        raise FleetcudaError(f"{what} failed (exit {res.rc}): {res.output.strip()[-500:]}")
    return res.output


def push(target: Target, transport: Transport, files: list[Path], dest: str,
         echo: Callable[[str], None]) -> None:
    """Copy files to `dest` in the target; containers receive them through `pct push`."""
    host = _host_chain(target)
    mkdir = build(target.chain, Invocation(f"umask 022; mkdir -p {quote(dest)}", {"PATH": SYSTEM_PATH}))
    res = transport.run(mkdir, timeout=60, on_line=lambda line: None)
    if res.rc != 0:
        raise FleetcudaError(f"{target.id}: cannot create {dest}: {res.output.strip()[-300:]}")
    if target.container is None:
        if isinstance(transport, LocalTransport):
            for f in files:
                shutil.copyfile(f, Path(dest) / f.name)
                os.chmod(Path(dest) / f.name, 0o644)
        else:
            assert isinstance(transport, SshTransport)
            for f in files:
                transport.put(f, f"{dest}/{f.name}")
        echo(f"{target.id}: {len(files)} file(s) in {dest}")
        return
    staging = None
    try:
        if isinstance(transport, SshTransport):
            staging = _run(transport, host, ["mktemp", "-d", "/tmp/fleetcuda-push.XXXXXX"], "mktemp").strip()
            for f in files:
                transport.put(f, f"{staging}/{f.name}")
        pct = target.chain.pct
        assert pct is not None
        for f in files:
            src = f"{staging}/{f.name}" if staging else str(f)
            argv = (["sudo", "-n", "--"] if pct.sudo else []) + [
                pct.pct, "push", str(pct.vmid), src, f"{dest}/{f.name}", "--perms", "0644"]
            _run(transport, host, argv, f"{target.id}: pct push {f.name}")
        echo(f"{target.id}: {len(files)} file(s) pushed into {dest}")
    finally:
        if staging:
            _run(transport, host, ["rm", "-rf", "--", staging], "cleanup")
