"""Offline fleets and CUDA from torch, in the lab: a staged wheelhouse pushed over SSH and `pct push`,
then the recipe installing only from it; `cuda_version=auto` following a torch upgrade to CUDA 13."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_fleetcuda
from tests.test_lab_e2e import GDN, INV, PIP, WHEELHOUSE, ct, lab_is_up, reset  # noqa: F401

pytestmark = pytest.mark.lab
LAB_WHEELHOUSE = Path("/var/lib/fleetcuda-lab/wheelhouse")


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("offline")


def test_wheelhouse_build_push_and_install_from_it(state: Path, tmp_path: Path) -> None:
    # A control-machine venv holding the stand-in torch, as `pip download` of an sdist needs (it runs setup.py).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin/pip"), "install", "-q", "--no-index", "--find-links", str(LAB_WHEELHOUSE),
                    "torch==2.11.0+cu128", "wheel", "setuptools", "packaging"], check=True)
    staged = tmp_path / "wh"
    build = run_fleetcuda("wheelhouse", "build", GDN, str(staged), "--python", str(venv / "bin/python"),
                          "--python-version", "3.11", "--platform", "manylinux2014_x86_64",
                          "--pip-arg=--no-index", f"--pip-arg=--find-links={LAB_WHEELHOUSE}", state=state)
    assert build.returncode == 0, build.stdout + build.stderr
    names = sorted(p.name for p in staged.iterdir())
    assert "causal_conv1d-1.7.0.tar.gz" in names and "fla_core-0.6.0-py3-none-any.whl" in names
    assert any(n.startswith("einops-") for n in names)
    sums = {line.split()[1]: line.split()[0] for line in build.stdout.splitlines() if len(line.split()) == 2
            and len(line.split()[0]) == 64}
    assert sums["causal_conv1d-1.7.0.tar.gz"] == hashlib.sha256(
        (staged / "causal_conv1d-1.7.0.tar.gz").read_bytes()).hexdigest()

    dest = "/var/cache/fleetcuda/wheelhouse"
    push = run_fleetcuda("wheelhouse", "push", str(staged), "-i", INV, "--limit", "lab-a/200,lab-b/300",
                         "--dest", dest, state=state)
    assert push.returncode == 0, push.stdout + push.stderr
    assert "lab-b/300: " in push.stdout and "pushed into /var/cache/fleetcuda/wheelhouse" in push.stdout
    for target in ("lab-a/200", "lab-b/300"):
        listing = ct(target, f"cd {dest} && sha256sum causal_conv1d-1.7.0.tar.gz && stat -c '%a' *.tar.gz").stdout
        assert sums["causal_conv1d-1.7.0.tar.gz"] in listing and "644" in listing
    # The hosts keep nothing behind: the staging directory is gone.
    leftovers = subprocess.run(["nsenter", "--net=/run/netns/fclab-b", "sh", "-c", "ls -d /tmp/fleetcuda-push.*"],
                               capture_output=True, text=True)
    assert leftovers.returncode != 0

    # Install from the pushed wheelhouse only (the lab's own wheelhouse not consulted).
    ct("lab-b/300", "/root/venv/bin/pip uninstall -y -q fla-core causal-conv1d || true")
    out = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", "lab-b/300", "--var", f"wheelhouse={dest}",
                        state=state)
    assert out.returncode == 0, out.stdout
    log = Path(out.stdout.split("logs: ")[-1].split()[0]) / "lab-b_300.log"
    text = log.read_text()
    # The sdist and the wheels came from the pushed directory; the lab's own wheelhouse was not consulted.
    assert f"for f in {dest}/causal_conv1d-1.7.0.tar.gz" in text
    assert "fleetcuda: building causal_conv1d-1.7.0.tar.gz" in text
    assert f"--find-links {dest}" in text and WHEELHOUSE not in text


def test_cuda_auto_follows_torch_to_cuda_13(state: Path) -> None:
    target = "lab-b/301"
    converge = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", target, state=state)
    assert converge.returncode == 0, converge.stdout
    same = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", target, "--var", "cuda_version=auto",
                         state=state)
    assert same.returncode == 0 and " changed (" not in same.stdout  # auto = 12.8 here: nothing to do

    ct(target, f"{PIP} --force-reinstall --no-deps torch==2.11.0+cu130")
    try:
        fixed = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", target, "--var", "cuda_version=auto",
                              state=state)
        assert fixed.returncode == 0, fixed.stdout
        for step in ("cuda-compiler", "cuda-home", "causal-conv1d"):
            assert f"{target} {step}: changed" in fixed.stdout
        assert "cuda-13-0" not in ct(target, "cat /etc/profile.d/cuda-home.sh").stdout
        assert "CUDA_HOME=/usr/local/cuda-13.0" in ct(target, "cat /etc/profile.d/cuda-home.sh").stdout
        info = ct(target, "/root/venv/bin/python -c 'from causal_conv1d import _build_info as b; "
                          "print(b.TORCH_VERSION, b.NVCC_RELEASE)'").stdout.split()
        assert info == ["2.11.0+cu130", "13.0"]
        again = run_fleetcuda("verify", GDN, "-i", INV, "--plain", "--limit", target, "--var", "cuda_version=auto",
                              state=state)
        assert again.returncode == 0, again.stdout
    finally:
        reset("b/301")
