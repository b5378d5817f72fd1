"""End to end against the lab: the real CLI, real sshd in network namespaces, real LXC containers,
the pct stand-in, and the stand-ins for NVIDIA's apt repository and the CUDA Python packages.

The lab must be up (`tests/lab/labctl.py up`; tests/run does it). Containers are reset to bare at
the start of this module.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, run_fleetcuda

LAB = Path("/var/lib/fleetcuda-lab")
LABCTL = REPO / "tests" / "lab" / "labctl.py"
GDN = "recipes/gdn-fastpath.yaml"
INV = "inventories/lab.yaml"
TARGETS = ["lab-a/200", "lab-a/201", "lab-b/300", "lab-b/301"]
WHEELHOUSE = "/srv/fleetcuda-lab/wheelhouse"
PIP = f"/root/venv/bin/pip install -q --disable-pip-version-check --no-index --find-links {WHEELHOUSE}"

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module", autouse=True)
def lab_is_up() -> None:
    if not (LAB / "up").exists():
        reason = "the lab is not up: run `sudo tests/lab/labctl.py up` (tests/run does)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


def ct(target: str, script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a script inside a container directly (not through fleetcuda), to inspect or break it."""
    host, vmid = target.split("/")
    name = host.removeprefix("lab-")
    proc = subprocess.run(["nsenter", f"--net=/run/netns/fclab-{name}", "lxc-attach", "-P",
                           str(LAB / "hosts" / name / "lxc"), "-n", vmid, "--clear-env", "--", "/bin/bash", "-c",
                           script], capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def reset(*targets: str) -> None:
    subprocess.run([str(LABCTL), "reset", *targets], check=True, capture_output=True, timeout=120)


def fingerprint(target: str) -> str:
    """What apply is meant to change in a container, as text to compare."""
    return ct(target, """
        dpkg-query -W -f='${Package} ${Version} ${db:Status-Abbrev}\\n' 'cuda-*' | sort
        cat /etc/profile.d/cuda-home.sh
        /usr/local/cuda-12.8/bin/nvcc --version | grep release
        /root/venv/bin/pip list --format=freeze 2>/dev/null | grep -iE '^(causal|fla|torch|wheel|ninja|packaging)'
        /root/venv/bin/python -c 'import causal_conv1d, fla; print("imports ok")'
    """).stdout


def steps_with(status: str, output: str) -> set[tuple[str, str]]:
    """(target, step) pairs reported with `status` in plain output lines like `12:00:00 lab-a/200 step: drift (...)`."""
    return {(m[1], m[2]) for m in re.finditer(rf"^\S+ (\S+) (\S+): {status} \(", output, re.M)}


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fc-state")


def test_naive_install_fails_in_the_seeds_order() -> None:
    """Without the recipe's order a bare container fails exactly as the seeds did, one error at a time."""
    reset("b/301")
    target = "lab-b/301"
    build = f"{PIP} --no-build-isolation --no-binary causal-conv1d causal-conv1d==1.7.0"
    first = ct(target, build, check=False)
    assert first.returncode != 0 and "No module named 'wheel'" in first.stdout + first.stderr
    ct(target, f"{PIP} wheel packaging")
    second = ct(target, build, check=False)
    assert "NameError: name 'bare_metal_version' is not defined" in second.stdout + second.stderr
    third = ct(target, "CUDA_HOME=/usr/local/cuda-12.8 " + build, check=False)
    assert "FileNotFoundError" in third.stdout + third.stderr
    nvcc = ct(target, "apt-get install -y cuda-nvcc-12-8", check=False)
    assert nvcc.returncode != 0 and "Unable to locate package cuda-nvcc-12-8" in nvcc.stdout + nvcc.stderr


@pytest.fixture(scope="module")
def converged(state: Path) -> subprocess.CompletedProcess[str]:
    reset()
    return run_fleetcuda("apply", GDN, "-i", INV, "--plain", state=state)


def test_apply_converges_every_container_from_bare(converged: subprocess.CompletedProcess[str]) -> None:
    assert converged.returncode == 0, converged.stdout + converged.stderr
    changed = steps_with("changed", converged.stdout)
    for target in TARGETS:
        assert {(target, s) for s in ("cuda-keyring", "cuda-compiler", "cuda-home", "build-deps", "causal-conv1d",
                                      "fla-core")} <= changed
        fp = fingerprint(target)
        assert "release 12.8, V12.8.93" in fp
        assert "export CUDA_HOME=/usr/local/cuda-12.8" in fp
        assert "causal-conv1d==1.7.0" in fp.lower().replace("_", "-")
        assert "imports ok" in fp
    # The build step ran with the recipe's environment, through the stand-in's real setup.py.
    logs = list(Path(converged.stdout.split("logs: ")[-1].strip()).glob("*.log"))
    assert len(logs) == len(TARGETS)
    assert all("CAUSAL_CONV1D_FORCE_BUILD=TRUE" in log.read_text() for log in logs)


def test_second_apply_changes_nothing_and_runs_no_apply_script(converged: subprocess.CompletedProcess[str],
                                                               state: Path) -> None:
    again = run_fleetcuda("apply", GDN, "-i", INV, "--plain", state=state, check=True)
    assert steps_with("changed", again.stdout) == set()
    run_dir = Path(again.stdout.split("logs: ")[-1].strip())
    for log in run_dir.glob("*.log"):
        text = log.read_text()
        assert not re.search(r"^## \S+ \S+ apply$", text, re.M), log
    check = run_fleetcuda("apply", GDN, "-i", INV, "--check", "--plain", state=state, check=True)
    assert "would-change" not in check.stdout


def test_verify_passes_then_names_each_drift(converged: subprocess.CompletedProcess[str], state: Path) -> None:
    ok = run_fleetcuda("verify", GDN, "-i", INV, "--plain", state=state)
    assert ok.returncode == 0, ok.stdout
    assert steps_with("drift", ok.stdout) == set()

    # 1. nvcc removed from one container
    ct("lab-a/200", "rm /usr/local/cuda-12.8/bin/nvcc")
    out = run_fleetcuda("verify", GDN, "-i", INV, "--plain", state=state)
    assert out.returncode == 1
    drift = steps_with("drift", out.stdout)
    assert ("lab-a/200", "cuda-compiler") in drift
    assert {t for t, _ in drift} == {"lab-a/200"}

    # apply repairs it: dpkg still says installed, so the step's own verify condition is what notices
    fixed = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", "lab-a/200", state=state)
    assert fixed.returncode == 0, fixed.stdout
    assert ("lab-a/200", "cuda-compiler") in steps_with("changed", fixed.stdout)

    # 2. causal-conv1d uninstalled from another
    ct("lab-b/300", "/root/venv/bin/pip uninstall -y -q causal-conv1d")
    out = run_fleetcuda("verify", GDN, "-i", INV, "--plain", state=state)
    assert out.returncode == 1
    drift = steps_with("drift", out.stdout)
    assert ("lab-b/300", "causal-conv1d") in drift and ("lab-b/300", "fast-path") in drift
    assert {t for t, _ in drift} == {"lab-b/300"}
    assert "causal-conv1d: not installed (want 1.7.0)" in out.stdout

    # 3. torch swapped for another CUDA major: the built extension no longer loads, and nvcc mismatches
    ct("lab-a/201", f"{PIP} --force-reinstall --no-deps torch==2.11.0+cu130")
    out = run_fleetcuda("verify", GDN, "-i", INV, "--plain", state=state)
    assert out.returncode == 1
    drift = steps_with("drift", out.stdout)
    assert {("lab-a/201", "torch-matches-nvcc"), ("lab-a/201", "causal-conv1d")} <= drift
    assert ("lab-b/300", "causal-conv1d") in drift  # still broken: verify repaired nothing
    assert "undefined symbol" in out.stdout
    assert "torch.version.cuda=13.0 nvcc=12.8" in out.stdout

    # Put both back; the next apply rebuilds causal-conv1d where it is missing.
    ct("lab-a/201", f"{PIP} --force-reinstall --no-deps torch==2.11.0+cu128")
    again = run_fleetcuda("apply", GDN, "-i", INV, "--plain", state=state)
    assert again.returncode == 0, again.stdout
    assert steps_with("changed", again.stdout) == {("lab-b/300", "causal-conv1d")}
    assert run_fleetcuda("verify", GDN, "-i", INV, "--plain", state=state).returncode == 0


@pytest.mark.parametrize(("shell", "target", "reference"), [("bash", "lab-a/201", "lab-a/200"),
                                                            ("zsh", "lab-b/301", "lab-b/300")])
def test_dry_run_lines_run_by_hand_do_what_apply_does(converged: subprocess.CompletedProcess[str], state: Path,
                                                      shell: str, target: str, reference: str) -> None:
    assert converged.returncode == 0
    reset(target.removeprefix("lab-"))
    dry = run_fleetcuda("apply", GDN, "-i", INV, "--dry-run", "--format", "shell", "--limit", target, state=state,
                        check=True)
    lines = dry.stdout.splitlines()
    steps: list[dict[str, str]] = []
    for i, line in enumerate(lines):
        m = re.match(r"# step \d+/\d+ \S+ \(\S+\): (check|apply|verify) ", line)
        if m:
            if m[1] == "check" or not steps or m[1] in steps[-1]:
                steps.append({})
            steps[-1][m[1]] = lines[i + 1]
    # host-toolchain's check passes: this lab's image has g++ and Python.h; lab-b/301 has no GPU check.
    assert len(steps) == (10 if target == "lab-b/301" else 11)
    for step in steps:
        def sh(line: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([shell, "-c", line], capture_output=True, text=True, timeout=600)

        if "check" in step and sh(step["check"]).returncode == 0:
            continue
        if "apply" in step:
            res = sh(step["apply"])
            assert res.returncode == 0, res.stdout + res.stderr
        if "verify" in step:
            res = sh(step["verify"])
            assert res.returncode == 0, res.stdout + res.stderr
    assert fingerprint(target) == fingerprint(reference)


def test_stopped_unknown_and_unreachable_targets_are_clear_errors(converged: subprocess.CompletedProcess[str],
                                                                   state: Path, tmp_path: Path) -> None:
    text = (REPO / INV).read_text()
    text = text.replace("      201:\n", "      202:\n        venv: /root/venv\n      299:\n        venv: /root/venv\n"
                        "      201:\n")
    text += ("  lab-down:\n    address: 10.250.2.2\n    port: 2222\n    user: labops\n    sudo: true\n"
             "    connect_timeout: 3\n    identity_file: /var/lib/fleetcuda-lab/id_ed25519\n"
             "    known_hosts: /var/lib/fleetcuda-lab/known_hosts\n    containers:\n      500:\n"
             "        venv: /root/venv\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(text)
    out = run_fleetcuda("verify", GDN, "-i", str(inv), "--plain", state=state)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "lab-a/202 done: unreachable: lab-a/202: container '202' not running!" in out.stdout
    assert "lab-a/299 done: unreachable: lab-a/299: Configuration file 'nodes/a/lxc/299.conf' does not exist" \
        in out.stdout
    assert re.search(r"lab-down/500 done: unreachable: labops@\[10\.250\.2\.2\]:2222: cannot connect", out.stdout)
    for target in TARGETS:
        assert f"{target} done: ok" in out.stdout


def test_sudo_wanting_a_password_is_a_clear_error_not_a_hang(state: Path, tmp_path: Path) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text((REPO / INV).read_text().replace("user: labops ", "user: labpw  "))
    out = run_fleetcuda("verify", GDN, "-i", str(inv), "--plain", "--limit", "lab-b", state=state, timeout=60)
    assert out.returncode == 3
    assert "`sudo -n` refused (sudo: a password is required)" in out.stdout


def test_unknown_or_changed_host_key_is_refused(state: Path, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    inv = tmp_path / "inv.yaml"
    inv.write_text((REPO / INV).read_text().replace("/var/lib/fleetcuda-lab/known_hosts", str(empty)))
    out = run_fleetcuda("verify", GDN, "-i", str(inv), "--plain", "--limit", "lab-a", state=state)
    assert out.returncode == 3
    assert f"host key of 10.250.1.2 is not in {empty}: ssh-ed25519 SHA256:" in out.stdout
    assert f"fleetcuda trust -i {inv} lab-a --fingerprint SHA256:" in out.stdout  # the exact command
    assert empty.read_text() == ""

    wrong = tmp_path / "wrong_known_hosts"
    b_key = (LAB / "hosts" / "b" / "ssh_host_ed25519_key.pub").read_text().split()
    wrong.write_text(f"10.250.1.2 {b_key[0]} {b_key[1]}\n")  # lab-b's key for lab-a's address
    inv.write_text((REPO / INV).read_text().replace("/var/lib/fleetcuda-lab/known_hosts", str(wrong)))
    out = run_fleetcuda("verify", GDN, "-i", str(inv), "--plain", "--limit", "lab-a", state=state)
    assert out.returncode == 3
    assert "HOST KEY CHANGED for labzsh@10.250.1.2" in out.stdout


@pytest.mark.parametrize(("limit", "expected"), [
    ("lab-a", ["lab-a/200", "lab-a/201"]),
    ("sudo-hosts", ["lab-b/300", "lab-b/301"]),
    ("lab-b/301", ["lab-b/301"]),
    ("train-a1", ["lab-a/201"]),
    ("*/30?,!lab-b/300", ["lab-b/301"]),
    ("lab-b,lab-a/200", ["lab-a/200", "lab-b/300", "lab-b/301"]),
])
def test_limit_selects_exactly(state: Path, limit: str, expected: list[str]) -> None:
    out = run_fleetcuda("apply", GDN, "-i", INV, "--dry-run", "--format", "shell", "--limit", limit, state=state,
                        check=True)
    assert re.findall(r"^# target (\S+)", out.stdout, re.M) == expected


def test_build_only_for_the_gpus_asked_for(converged: subprocess.CompletedProcess[str], state: Path) -> None:
    target = "lab-b/301"
    archs = "/root/venv/bin/python -c 'from causal_conv1d import _build_info as b; print(b.ARCHS)'"
    assert ct(target, archs).stdout.strip() == "['sm_75', 'sm_80', 'sm_87', 'sm_90', 'sm_100', 'sm_120']"

    ct(target, "/root/venv/bin/pip uninstall -y -q causal-conv1d")
    out = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", target, "--var", "cuda_archs=90",
                        "--show-output", state=state)
    assert out.returncode == 0, out.stdout
    assert "fleetcuda: restricted the build to sm_90 (setup.py offers sm_100, sm_103, sm_110, sm_120" in out.stdout
    assert ct(target, archs).stdout.strip() == "['sm_90']"

    ct(target, "/root/venv/bin/pip uninstall -y -q causal-conv1d")
    auto = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", target, "--var", "cuda_archs=auto",
                         state=state)
    assert auto.returncode == 1
    assert "cuda_archs=auto, but no GPU is visible here" in auto.stdout
    absent = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", target, "--var", "cuda_archs=89",
                           state=state)
    assert absent.returncode == 1
    assert "setup.py does not build for sm_89" in absent.stdout
    assert run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", target, state=state).returncode == 0


def flat(text: str) -> str:
    """Output with line wrapping undone (the summary wraps long findings)."""
    return " ".join(text.split())


@pytest.mark.parametrize(("hide", "preflight_says", "host_toolchain_says"), [
    ("mv /usr/bin/g++ /usr/bin/g++.hidden", "no g++ on PATH: host_toolchain is false, so nothing installs one",
     "no g++ on PATH although apt has g++: its files were removed; apt-get install --reinstall g++ gcc"),
    ("mv /usr/include/python3.11/Python.h /root/Python.h.hidden",
     "/usr/include/python3.11/Python.h is missing and host_toolchain is false, so nothing installs it: put "
     "python3.11-dev in the image",
     "no /usr/include/python3.11/Python.h: the headers of the venv's Python are missing (apt-get install --reinstall "
     "python3.11-dev)"),
])
def test_an_image_without_its_toolchain_is_caught_before_anything_is_installed(
        state: Path, hide: str, preflight_says: str, host_toolchain_says: str) -> None:
    """This lab's image brings g++ and Python.h; without one of them the build would fail (the stand-in torch fails
    as the real one does), so preflight (host_toolchain false) or host-toolchain's verify stops apply first."""
    target = "lab-b/301"
    reset("b/301")
    ct(target, hide)
    no_cuda = "dpkg-query -W -f='${Package}\\n' 'cuda-*' 2>/dev/null || true"
    off = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", target, "--var", "host_toolchain=false",
                        state=state)
    assert off.returncode == 1, off.stdout
    assert preflight_says in flat(off.stdout), off.stdout
    assert steps_with("failed", off.stdout) == {(target, "preflight")}
    assert ct(target, no_cuda).stdout == ""
    on = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", target, state=state)
    assert on.returncode == 1, on.stdout
    assert steps_with("failed", on.stdout) == {(target, "host-toolchain")}
    assert host_toolchain_says in flat(on.stdout), on.stdout
    assert ct(target, no_cuda).stdout == ""
    reset("b/301")
