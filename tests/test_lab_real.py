"""The flagship recipe against the real parts, in the lab's `real` topology (tests/lab/labctl.py up --topology
real; tests/run does it): containers made like Proxmox's Debian 12 template (no compiler, no Python headers)
whose venv holds PyPI's torch 2.11.0 (cu130) and transformers 5.x; NVIDIA's real nvcc 13.0.88 (repackaged from
NVIDIA's PyPI wheels) in the lab's NVIDIA apt stand-in; Debian's real g++ and python3.11-dev from the lab's copy of
the Debian mirror; PyPI's fla-core and causal-conv1d sdist in a wheelhouse. Only running a kernel needs a GPU.

The real causal-conv1d build (sm_90, about five minutes on two cores) runs once, in the module's first apply;
the other container installs that wheel from the control machine's build cache. The containers are reset to
bare at the start.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_fleetcuda

LAB = Path("/var/lib/fleetcuda-lab")
LABCTL = REPO / "tests" / "lab" / "labctl.py"
GDN = "recipes/gdn-fastpath.yaml"
INV = "inventories/lab-real.yaml"
HOST = "real1"
BUILDER, OTHER = "lab-real1/600", "lab-real1/601"
TARGETS = [BUILDER, OTHER]
STANDIN_TORCH_CU128 = LAB / "wheelhouse"  # the default lab's stand-in torch: another CUDA major than the real one
BUILT = re.compile(r"^\S+ (\S+) causal-conv1d: changed \(built here and cached for fingerprint (\w+)", re.M)
INSTALLED = re.compile(r"^\S+ (\S+) causal-conv1d: changed \(installed the wheel built on (\S+) for fingerprint", re.M)
# A compile command line of the real build, as torch's ninja build prints it (pip -v shows it in the step's log).
NVCC_LINE = re.compile(r"/usr/local/cuda-13\.0/bin/nvcc .*causal_conv1d\S*\.cu.*-gencode arch=compute_90,code=sm_90")

pytestmark = pytest.mark.lab


def fail_or_skip(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module", autouse=True)
def real_lab_is_up() -> None:
    if os.geteuid() != 0:
        fail_or_skip("the real lab needs root")
    if not (LAB / "up.real").exists():
        fail_or_skip("the real lab topology is not up: run `sudo tests/lab/labctl.py up --topology real` "
                     "(tests/run does)")


def ct(target: str, script: str, check: bool = True, stdin: bytes | None = None,
       timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run a script inside a container directly (not through fleetcuda), to inspect or break it."""
    vmid = target.split("/")[1]
    proc = subprocess.run(["nsenter", f"--net=/run/netns/fclab-{HOST}", "lxc-attach", "-P",
                           str(LAB / "hosts" / HOST / "lxc"), "-n", vmid, "--clear-env", "--",
                           "/bin/bash", "-c", "export PATH=/usr/sbin:/usr/bin:/sbin:/bin; " + script],
                          input=stdin, capture_output=True, timeout=timeout)
    out = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(errors="replace"),
                                      proc.stderr.decode(errors="replace"))
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def reset(*targets: str) -> None:
    subprocess.run([str(LABCTL), "reset", "--topology", "real", *(t.removeprefix("lab-") for t in targets)],
                   check=True, capture_output=True, timeout=300)


def flat(text: str) -> str:
    """Output with line wrapping undone (the summary wraps long findings)."""
    return " ".join(text.split())


def steps_with(status: str, output: str) -> set[tuple[str, str]]:
    return {(m[1], m[2]) for m in re.finditer(rf"^\S+ (\S+) (\S+): {status} \(", output, re.M)}


def run_log(output: str, target: str) -> str:
    dirs = re.findall(r"logs: (\S+)", output)
    assert dirs, output
    return (Path(dirs[-1]) / (target.replace("/", "_") + ".log")).read_text()


def installed_state(target: str) -> str:
    """What apply is meant to change in a container, as text to compare."""
    return ct(target, """
        dpkg-query -W -f='${Package} ${Version} ${db:Status-Abbrev}\\n' | sort
        cat /etc/profile.d/cuda-home.sh 2>/dev/null
        /root/venv/bin/pip list --format=freeze 2>/dev/null | sort
    """).stdout


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fc-real-state")


@pytest.fixture(scope="module")
def converged(state: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    """A converge of the fleet from bare: the one real build of the run."""
    reset(*TARGETS)
    for target in TARGETS:  # made like a fresh template
        bare = ct(target, "command -v g++ gcc; ls /usr/include/python3.11/Python.h; ls /usr/local/cuda-13.0; "
                          "/root/venv/bin/python -c 'import torch; print(torch.__version__)'", check=False)
        assert "/usr/bin/g" not in bare.stdout and "Python.h" not in bare.stdout, bare.stdout
        assert "2.11.0+cu130" in bare.stdout, bare.stdout + bare.stderr
    start = time.monotonic()
    out = run_fleetcuda("apply", GDN, "-i", INV, "--plain", state=state, timeout=3000)
    took = time.monotonic() - start
    print(f"converge of {len(TARGETS)} containers from bare, with the real build: {took:.0f} s")
    return out, took


def test_apply_builds_the_real_extension_once_and_installs_it_everywhere(
        converged: tuple[subprocess.CompletedProcess[str], float], capsys: pytest.CaptureFixture[str]) -> None:
    out, took = converged
    assert out.returncode == 0, out.stdout + out.stderr
    # cuda_version=auto read 13.0 from the venv's torch: the real nvcc 13.0 from the lab's apt, never 12.8.
    assert re.search(r"^\S+ lab-real1/600 cuda-compiler: changed", out.stdout, re.M), out.stdout
    built = dict(BUILT.findall(out.stdout))
    installed = dict(INSTALLED.findall(out.stdout))
    assert len(built) == 1 and len(installed) == 1, out.stdout
    [builder] = built
    [other] = installed
    assert installed[other] == builder and {builder, other} == set(TARGETS)
    log = run_log(out.stdout, builder)
    assert "# facts: cuda_version=13.0," in log and "python_xy=3.11" in log
    assert "Cuda compilation tools, release 13.0, V13.0.88" in log
    assert NVCC_LINE.search(log), "no nvcc 13.0 compile command line in the builder's log"
    assert "fleetcuda: restricted the build to sm_90" in log
    assert not NVCC_LINE.search(run_log(out.stdout, other))  # the other one compiled nothing
    with capsys.disabled():  # into the CI log, whatever pytest's capture: the real compile, in the container
        print(f"\ntest_lab_real: converge of {len(TARGETS)} containers from bare in {took:.0f} s; {builder} built "
              f"causal-conv1d with the real nvcc:")
        for line in log.splitlines():
            if "Cuda compilation tools" in line or NVCC_LINE.search(line) or "Successfully built causal" in line:
                print(f"  {builder}: {line.strip()}")
    for target in TARGETS:
        pkgs = ct(target, "dpkg-query -W -f='${Package} ${Version}\\n' g++ python3.11-dev cuda-nvcc-13-0").stdout
        assert "cuda-nvcc-13-0 13.0.88-1" in pkgs and "python3.11-dev 3.11" in pkgs and "g++ 4:12" in pkgs, pkgs


def test_verify_proves_the_fast_path_for_real(converged: tuple[subprocess.CompletedProcess[str], float],
                                             state: Path) -> None:
    assert converged[0].returncode == 0
    out = run_fleetcuda("verify", GDN, "-i", INV, "--plain", state=state)
    assert out.returncode == 0, out.stdout + out.stderr
    for target in TARGETS:
        log = run_log(out.stdout, target)
        assert "ok   import causal_conv1d 1.7.0, fla 0.6.0" in log
        assert "skip no GPU visible: kernels not run" in log
        # The real transformers' gate: four functions in each of the three models, all on the fast path.
        gate = re.findall(r"^\| ok   transformers 5\.\S+ (modeling_\w+): (\w+) -> (\S+)$", log, re.M)
        assert {m for m, _, _ in gate} == {"modeling_qwen3_5", "modeling_qwen3_5_moe", "modeling_qwen3_next"}, log
        assert len(gate) == 12 and all(w.startswith(("causal_conv1d.", "fla.")) for _, _, w in gate), gate
        assert "| FAIL" not in log
        # The extension itself loads against the venv's torch (not only the Python package).
        ext = ct(target, "/root/venv/bin/python -c 'import torch, causal_conv1d_cuda as c; print(c.__file__)'")
        assert "causal_conv1d_cuda" in ext.stdout and ext.stdout.strip().endswith(".so")


def test_a_second_apply_changes_nothing(converged: tuple[subprocess.CompletedProcess[str], float],
                                        state: Path) -> None:
    assert converged[0].returncode == 0
    before = {t: installed_state(t) for t in TARGETS}
    again = run_fleetcuda("apply", GDN, "-i", INV, "--plain", state=state)
    assert again.returncode == 0, again.stdout
    assert steps_with("changed", again.stdout) == set()
    assert {t: installed_state(t) for t in TARGETS} == before


def test_max_jobs_auto_is_bounded_by_memory_as_well_as_cores(state: Path) -> None:
    def facts(*var: str) -> str:
        out = run_fleetcuda("apply", GDN, "-i", INV, "--check", "--plain", "--limit", BUILDER, *var, state=state)
        return re.search(r"^# facts: .*$", run_log(out.stdout, BUILDER), re.M)[0]  # type: ignore[index]

    assert f"max_jobs={min(os.cpu_count() or 1, 4)}," in facts() + ","  # this machine's memory allows it
    assert "max_jobs=1" in facts("--var", "build_job_mb=100000000")  # no memory for more than one job
    assert "max_jobs=1" in facts("--var", "build_max_jobs=1")


@pytest.mark.parametrize(("breaks", "finding"), [
    ("apt-get remove -y -q g++", "not installed: g++"),
    ("dpkg -r libpython3.11-dev python3.11-dev", "not installed: python3.11-dev"),
])
def test_a_missing_compiler_or_header_is_drift_and_apply_restores_it(
        converged: tuple[subprocess.CompletedProcess[str], float], state: Path, breaks: str, finding: str) -> None:
    assert converged[0].returncode == 0
    ct(OTHER, breaks)
    out = run_fleetcuda("verify", GDN, "-i", INV, "--plain", "--limit", OTHER, state=state)
    assert out.returncode == 1
    assert steps_with("drift", out.stdout) == {(OTHER, "host-toolchain")}, out.stdout
    assert finding in flat(out.stdout)
    fixed = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", OTHER, state=state)
    assert fixed.returncode == 0, fixed.stdout
    assert steps_with("changed", fixed.stdout) == {(OTHER, "host-toolchain")}
    assert run_fleetcuda("verify", GDN, "-i", INV, "--plain", "--limit", OTHER, state=state).returncode == 0


def test_torch_of_another_cuda_major_is_caught(converged: tuple[subprocess.CompletedProcess[str], float],
                                               state: Path) -> None:
    """On a converged container: verify says what broke. On a fresh one: preflight stops apply before anything is
    installed, and says what to change."""
    assert converged[0].returncode == 0
    wheels = sorted(STANDIN_TORCH_CU128.glob("torch-2.11.0+cu128-*.whl"))
    if not wheels:
        fail_or_skip(f"no stand-in torch cu128 wheel in {STANDIN_TORCH_CU128} (the default lab builds it)")
    swap = (f"cat > /tmp/{wheels[0].name} && /root/venv/bin/pip install -q --no-index --no-deps --force-reinstall "
            f"/tmp/{wheels[0].name}")
    ct(OTHER, swap, stdin=wheels[0].read_bytes())
    drift = run_fleetcuda("verify", GDN, "-i", INV, "--plain", "--limit", OTHER, state=state)
    assert drift.returncode == 1
    assert (OTHER, "causal-conv1d") in steps_with("drift", drift.stdout)
    assert "torch 2.11.0+cu130 -> 2.11.0+cu128; torch_cuda 13.0 -> 12.8" in flat(drift.stdout)
    pinned = run_fleetcuda("verify", GDN, "-i", INV, "--plain", "--limit", OTHER, "--var", "cuda_version=13.0",
                           state=state)
    assert (OTHER, "preflight") in steps_with("drift", pinned.stdout)
    assert "torch 2.11.0+cu128 is built for CUDA 12.8, but cuda_version is 13.0" in flat(pinned.stdout)

    reset(OTHER)
    ct(OTHER, swap, stdin=wheels[0].read_bytes())
    before = installed_state(OTHER)
    out = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", OTHER, "--var", "cuda_version=13.0",
                        state=state)
    assert out.returncode == 1
    assert re.search(rf"^\S+ {OTHER} preflight: failed", out.stdout, re.M), out.stdout
    assert "set cuda_version to auto (or 12.8), or install a torch built for CUDA 13" in flat(out.stdout)
    assert installed_state(OTHER) == before  # nothing installed

    ct(OTHER, "/root/venv/bin/pip uninstall -y -q torch")
    gone = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", OTHER, state=state)
    assert gone.returncode == 1
    assert "torch is not importable in /root/venv" in flat(gone.stdout)
    assert installed_state(OTHER) == before.replace("torch==2.11.0+cu128\n", "")


def test_a_host_compiler_newer_than_nvcc_accepts_fails_preflight(state: Path) -> None:
    """nvcc 12.8 and 13.0 accept gcc up to 14: a gcc 15 first on PATH stops apply before anything is installed."""
    reset(OTHER)
    ct(OTHER, "printf '#!/bin/sh\\necho 15.1.0\\n' > /root/venv/bin/gcc && chmod +x /root/venv/bin/gcc")
    before = installed_state(OTHER)
    out = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", OTHER, state=state)
    assert out.returncode == 1
    assert "gcc 15.1.0 (/root/venv/bin/gcc): nvcc 13.0 accepts gcc up to 14" in flat(out.stdout)
    assert installed_state(OTHER) == before
