"""The exported Ansible project against the lab, run by a real ansible-playbook (proxmox_pct_remote over the lab
hosts' sshd: lab-a's root-as-labzsh with zsh, lab-b's labops through `sudo -n`): from bare, the containers end
as `fleetcuda apply` leaves them (fleetcuda's own verify passes), a second run changes nothing, `--check`
changes nothing, and a drift made by hand fails the verify playbook on that container only."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ansible_export import ansible_playbook, export, playbook
from tests.conftest import REPO, run_fleetcuda
from tests.test_lab_e2e import GDN, INV, ct, lab_is_up, reset  # noqa: F401  (the fixture skips/fails without a lab)

pytestmark = pytest.mark.lab
TARGETS = ["lab-a/200", "lab-b/300"]
HOSTS = ["lab-a-200", "lab-b-300"]
# The recipe reads python_xy from the venv when it is `auto`; the export carries literal commands.
PINNED = ["--var", "python_xy=3.11"]


def _installed(target: str) -> str:
    return ct(target, """
        dpkg-query -W -f='${Package} ${Version} ${db:Status-Abbrev}\\n' 'cuda-*' | sort
        cat /etc/profile.d/cuda-home.sh
        /root/venv/bin/pip list --format=freeze 2>/dev/null | grep -iE '^(causal|fla|wheel|ninja|packaging)'
        /root/venv/bin/python -c 'import causal_conv1d, fla; print("imports ok")'
        ls -d /tmp/fleetcuda-wheel.* 2>/dev/null || echo "no wheel left in /tmp"
    """).stdout


def test_exported_playbook_converges_from_bare_as_fleetcuda_apply_does(tmp_path: Path) -> None:
    binary = ansible_playbook()
    reset("a/200", "b/300")
    try:
        project = tmp_path / "project"
        done = export(GDN, "-i", INV, "--limit", ",".join(TARGETS), *PINNED, "-o", str(project))
        assert done.returncode == 0, done.stderr

        first = playbook(binary, project, "site.yml")
        assert first.rc == 0, first.output[-4000:]
        for host in HOSTS:
            assert first.recap[host]["failed"] == 0 and first.recap[host]["changed"] >= 6, first.recap
        for target in TARGETS:
            state = _installed(target)
            assert "cuda-nvcc-12-8 12.8.93-1 ii" in state and "export CUDA_HOME=/usr/local/cuda-12.8" in state
            assert "causal_conv1d==1.7.0" in state.replace("-", "_") and "imports ok" in state
            assert "no wheel left in /tmp" in state
        verified = run_fleetcuda("verify", GDN, "-i", INV, "--limit", ",".join(TARGETS), "--plain",
                                 state=tmp_path / "fc-state")
        assert verified.returncode == 0, verified.stdout + verified.stderr

        second = playbook(binary, project, "site.yml")
        assert second.rc == 0, second.output[-4000:]
        assert all(second.recap[h]["changed"] == 0 and second.recap[h]["failed"] == 0 for h in HOSTS), second.recap
        assert playbook(binary, project, "verify.yml").rc == 0

        # Drift by hand on one container: the verify playbook fails it, and only it; --check says it would change.
        ct("lab-b/300", "/root/venv/bin/pip uninstall -q -y fla-core")
        drift = playbook(binary, project, "verify.yml")
        assert drift.rc != 0
        assert drift.recap["lab-b-300"]["failed"] == 1 and drift.recap["lab-a-200"]["failed"] == 0, drift.recap
        assert "drift: fla-core, fast-path" in drift.output
        # As `fleetcuda apply --check`: fla-core would change, and the fast-path assertion after it fails.
        check = playbook(binary, project, "site.yml", "--check")
        assert check.recap["lab-b-300"]["changed"] == 1 and check.recap["lab-b-300"]["failed"] == 1, check.recap
        assert "fla-core: would change" in check.output and "fast-path: verify (assertion)" in check.output
        assert check.recap["lab-a-200"]["changed"] == 0 and check.recap["lab-a-200"]["failed"] == 0, check.recap
        # --check changed nothing.
        assert "fla-core" not in ct("lab-b/300", "/root/venv/bin/pip list 2>/dev/null").stdout
    finally:
        reset("a/200", "b/300")


def test_unreachable_sudo_password_host_fails_that_host_only(tmp_path: Path) -> None:
    """Nothing waits for a password: `sudo -n` as fleetcuda's, on a host whose sudo wants one."""
    binary = ansible_playbook()
    inv = tmp_path / "inv.yaml"
    inv.write_text((REPO / INV).read_text().replace("user: labops", "user: labpw"))
    project = tmp_path / "project"
    done = export(GDN, "-i", str(inv), "--limit", "lab-b/300", *PINNED, "-o", str(project))
    assert done.returncode == 0, done.stderr
    run = playbook(binary, project, "verify.yml", timeout=120)
    assert run.rc != 0
    assert run.recap["lab-b-300"]["failed"] + run.recap["lab-b-300"]["unreachable"] == 1, run.output[-2000:]
