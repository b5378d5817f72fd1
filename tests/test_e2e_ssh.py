"""The real CLI against a real OpenSSH server on loopback, through the pct stand-in, with login
shells bash (root), zsh and dash (non-root users reaching pct through `sudo -n`)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, run_fleetcuda
from tests.lab.sshd import LoopbackSshd

MARKER = REPO / "tests" / "data" / "marker.yaml"
# vmid -> (inventory host, login shell user)
CONTAINERS = {300: "bashhost", 301: "bashhost", 310: "zshhost", 320: "dashhost"}


def write_inventory(lab: LoopbackSshd, path: Path, *, known_hosts: Path | None = None,
                    extra_hosts: str = "") -> Path:
    kh = known_hosts or lab.known_hosts

    def host(name: str, user: str, vmids: list[int], sudo: bool) -> str:
        cts = "".join(f"      {v}:\n        name: c{v}\n" for v in vmids)
        return (f"  {name}:\n    address: 127.0.0.1\n    port: {lab.port}\n    user: {user}\n"
                f"    identity_file: {lab.identity}\n    known_hosts: {kh}\n    pct: {lab.pct_path}\n"
                f"    sudo: {'true' if sudo else 'false'}\n    containers:\n{cts}")

    text = "groups:\n  zshdash:\n    members: [zshhost, dashhost]\nhosts:\n"
    text += host("bashhost", "root", [300, 301], False)
    text += host("zshhost", lab.users["zsh"], [310], True)
    text += host("dashhost", lab.users["dash"], [320], True)
    text += extra_hosts.replace("@HOST@", host("", "", [], False))
    path.write_text(text)
    return path


def fleetcuda(*args: str, state: Path, check: bool = False) -> subprocess.CompletedProcess[str]:
    return run_fleetcuda(*args, state=state, check=check, timeout=300)


@pytest.fixture
def lab(sshd_lab: LoopbackSshd) -> LoopbackSshd:
    for vmid in CONTAINERS:
        sshd_lab.add_container(vmid, name=f"c{vmid}")
    sshd_lab.add_container(399, running=False, name="stopped")
    return sshd_lab


@pytest.fixture
def env(lab: LoopbackSshd, tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "state"
    root.mkdir()
    os.chmod(tmp_path, 0o755)
    return {"inv": write_inventory(lab, tmp_path / "inv.yaml"), "root": root, "state": tmp_path / "fc"}


def greeting(root: Path, vmid: int) -> str:
    return (root / f"ct{vmid}" / "greeting").read_text()


def applies(root: Path, vmid: int) -> int:
    return len((root / f"ct{vmid}" / "applies").read_text().splitlines())


def test_apply_converges_then_second_apply_changes_nothing(lab: LoopbackSshd, env: dict[str, Path]) -> None:
    args = ["apply", str(MARKER), "-i", str(env["inv"]), "--var", f"root={env['root']}", "--plain"]
    first = fleetcuda(*args, state=env["state"], check=True)
    for vmid in CONTAINERS:
        assert greeting(env["root"], vmid) == "hello"
        assert applies(env["root"], vmid) == 1
    assert first.stdout.count("write-greeting: changed") == len(CONTAINERS)

    lab.clear_calls()
    second = fleetcuda(*args, state=env["state"], check=True)
    assert "changed" not in second.stdout.split("summary")[0].replace("done: ok", "")
    for vmid in CONTAINERS:
        assert applies(env["root"], vmid) == 1
    scripts = [c["argv"][-2] for c in lab.calls() if c["argv"][:1] == ["exec"]]  # [-1] is the label
    assert scripts and not any("echo applied" in s for s in scripts)
    # A converged target costs one pct exec: its three checks (make-dir, write-greeting, env-is-clean)
    # travel in one batch; may-fail is skipped by its `when`.
    assert len(scripts) == len(CONTAINERS)
    assert all(len(re.findall(r"@@fleetcuda:\$\{fcn\} begin", s)) == 3 for s in scripts)  # (the nonce: on stdin)


def test_non_root_users_reach_pct_through_sudo_n(lab: LoopbackSshd, env: dict[str, Path]) -> None:
    fleetcuda("apply", str(MARKER), "-i", str(env["inv"]), "--var", f"root={env['root']}", "--limit", "zshdash",
              "--plain", state=env["state"], check=True)
    calls = [c for c in lab.calls() if c["argv"][:2] in (["exec", "310"], ["exec", "320"])]
    assert calls and all(c["uid"] == 0 for c in calls)  # pct ran as root, through sudo
    assert all("SUDO_USER" in c["env"] for c in calls)  # ... which pct would pass on, but env -i stops


def test_check_mode_reports_and_changes_nothing(lab: LoopbackSshd, env: dict[str, Path]) -> None:
    proc = fleetcuda("apply", str(MARKER), "-i", str(env["inv"]), "--var", f"root={env['root']}", "--check",
                     "--limit", "bashhost/300", "--plain", state=env["state"])
    assert proc.returncode == 0, proc.stderr
    assert "make-dir: would-change" in proc.stdout
    assert "step make-dir would change: shell: check `test -d " in proc.stdout and "apply `mkdir -p " in proc.stdout
    assert not (env["root"] / "ct300").exists()
    fleetcuda("apply", str(MARKER), "-i", str(env["inv"]), "--var", f"root={env['root']}",
              "--limit", "bashhost/300", "--plain", state=env["state"], check=True)
    again = fleetcuda("apply", str(MARKER), "-i", str(env["inv"]), "--var", f"root={env['root']}", "--check",
                      "--limit", "bashhost/300", "--plain", state=env["state"], check=True)
    assert "would-change" not in again.stdout


def test_failing_step_stops_only_its_target(lab: LoopbackSshd, env: dict[str, Path]) -> None:
    inv = env["inv"]
    inv.write_text(inv.read_text().replace("      310:\n        name: c310\n",
                                           "      310:\n        name: c310\n        vars:\n          fail: true\n"))
    proc = fleetcuda("apply", str(MARKER), "-i", str(inv), "--var", f"root={env['root']}", "--plain",
                     state=env["state"])
    assert proc.returncode == 1
    out = proc.stdout
    assert "zshhost/310: step may-fail failed: apply: apply failed (exit 7)" in out
    assert "about to fail" in out
    assert "full log:" in out
    log = Path(out.split("full log:")[1].split()[0])
    assert log.stat().st_mode & 0o777 == 0o600
    assert log.parent.stat().st_mode & 0o777 == 0o700
    assert "about to fail" in log.read_text()
    for vmid in (300, 301, 320):
        assert greeting(env["root"], vmid) == "hello"
    assert "bashhost/300 done: ok" in out or "bashhost/300 done: changed" in out


def test_stopped_container_and_sudo_password_are_clear_errors(lab: LoopbackSshd, env: dict[str, Path],
                                                               tmp_path: Path) -> None:
    inv = write_inventory(lab, tmp_path / "inv2.yaml")
    text = (inv.read_text() + (
        f"  pwhost:\n    address: 127.0.0.1\n    port: {lab.port}\n    user: {lab.users['sudo_password']}\n"
        f"    identity_file: {lab.identity}\n    known_hosts: {lab.known_hosts}\n    pct: {lab.pct_path}\n"
        f"    sudo: true\n    containers:\n      300: {{}}\n"
    )).replace("      301:\n", "      399:\n        name: stopped\n      301:\n")
    inv.write_text(text)
    proc = fleetcuda("apply", str(MARKER), "-i", str(inv), "--var", f"root={env['root']}", "--plain",
                     "--limit", "pwhost,bashhost", state=env["state"])
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "bashhost/399: unreachable: bashhost/399: container '399' not running!" in proc.stdout
    assert "sudo -n` refused" in proc.stdout and "password is required" in proc.stdout
    assert greeting(env["root"], 300) == "hello"  # the other targets finished


def test_unknown_host_key_is_refused_with_how_to_trust(lab: LoopbackSshd, env: dict[str, Path],
                                                       tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    inv = write_inventory(lab, tmp_path / "inv3.yaml", known_hosts=empty)
    proc = fleetcuda("apply", str(MARKER), "-i", str(inv), "--var", f"root={env['root']}", "--plain",
                     "--limit", "bashhost/300", state=env["state"])
    assert proc.returncode == 3
    assert f"host key of [127.0.0.1]:{lab.port} is not in {empty}" in proc.stdout
    assert f"fleetcuda trust -i {inv} bashhost --fingerprint SHA256:" in proc.stdout  # the exact command
    assert empty.read_text() == ""  # nothing was added
    assert not (env["root"] / "ct300").exists()

    changed = tmp_path / "changed_known_hosts"
    other = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    assert other.returncode == 0
    pub = (tmp_path / "k.pub").read_text().split()
    changed.write_text(f"[127.0.0.1]:{lab.port} {pub[0]} {pub[1]}\n")
    inv = write_inventory(lab, tmp_path / "inv4.yaml", known_hosts=changed)
    proc = fleetcuda("apply", str(MARKER), "-i", str(inv), "--var", f"root={env['root']}", "--plain",
                     "--limit", "bashhost/300", state=env["state"])
    assert proc.returncode == 3
    assert "HOST KEY CHANGED" in proc.stdout


def test_var_values_are_never_executed(lab: LoopbackSshd, env: dict[str, Path], tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    evil = f"$ (touch {pwned})' touch {pwned}';touch {pwned}'\"; touch {pwned}"  # `$(`: refused at load
    fleetcuda("apply", str(MARKER), "-i", str(env["inv"]), "--var", f"root={env['root']}", "--var",
              f"greeting={evil}", "--limit", "zshhost,dashhost", "--plain", state=env["state"], check=True)
    assert greeting(env["root"], 310) == evil
    assert not pwned.exists()


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_dry_run_lines_pasted_into_a_shell_do_what_apply_does(lab: LoopbackSshd, env: dict[str, Path],
                                                               tmp_path: Path, shell: str) -> None:
    by_hand, by_apply = env["root"] / "hand", env["root"] / "apply"
    for d in (by_hand, by_apply):
        d.mkdir()
    common = ["-i", str(env["inv"]), "--limit", "zshhost,bashhost/300", "--var", "greeting=it's 5 $/h, \"q\" \\ !"]
    fleetcuda("apply", str(MARKER), *common, "--var", f"root={by_apply}", "--plain", state=env["state"],
              check=True)
    dry = fleetcuda("apply", str(MARKER), *common, "--var", f"root={by_hand}", "--dry-run", "--format", "shell",
                    state=env["state"], check=True)
    # Replay as apply does: per step, the check; if it fails, apply then verify.
    blocks = _dry_run_steps(dry.stdout)
    assert blocks, dry.stdout
    for phases in blocks:
        run = lambda line: subprocess.run([shell, "-c", line], capture_output=True, text=True, timeout=60)  # noqa: E731
        if "check" in phases and run(phases["check"]).returncode == 0:
            continue
        if "apply" in phases:
            assert run(phases["apply"]).returncode == 0
        if "verify" in phases:
            assert run(phases["verify"]).returncode == 0
    for vmid in (300, 310):
        assert (by_hand / f"ct{vmid}" / "greeting").read_text() == "it's 5 $/h, \"q\" \\ !"
        assert (by_hand / f"ct{vmid}" / "greeting").read_text() == greeting(by_apply, vmid)
        assert applies(by_hand, vmid) == applies(by_apply, vmid) == 1


def _dry_run_steps(text: str) -> list[dict[str, str]]:
    steps: list[dict[str, str]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# step ") and ": " in line and "skipped" not in line:
            phase = line.split("): ")[1].split()[0]
            if phase == "check" or not steps or phase in steps[-1]:
                steps.append({})
            steps[-1][phase] = lines[i + 1]
    return steps


def test_local_host_runs_through_local_shell(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    inv = tmp_path / "local.yaml"
    inv.write_text("hosts:\n  gpu-box:\n    kind: local\n")
    root = tmp_path / "r"
    root.mkdir()
    state = tmp_path / "fc"
    proc = fleetcuda("apply", str(MARKER), "-i", str(inv), "--var", f"root={root}", "--plain", state=state,
                     check=True)
    assert (root / "ct" / "greeting").read_text() == "hello"
    assert "gpu-box done: changed" in proc.stdout
    again = fleetcuda("verify", str(MARKER), "-i", str(inv), "--var", f"root={root}", "--plain", state=state)
    assert again.returncode == 0
    (root / "ct" / "greeting").write_text("tampered")
    drift = fleetcuda("verify", str(MARKER), "-i", str(inv), "--var", f"root={root}", "--plain", state=state)
    assert drift.returncode == 1
    assert "write-greeting: drift" in drift.stdout
    assert (root / "ct" / "greeting").read_text() == "tampered"  # verify is read-only


def test_trust_records_a_key_only_after_showing_it(lab: LoopbackSshd, env: dict[str, Path], tmp_path: Path) -> None:
    kh = tmp_path / "kh" / "known_hosts"
    inv = write_inventory(lab, tmp_path / "inv5.yaml", known_hosts=kh)
    real = subprocess.run(["ssh-keygen", "-lf", str(lab.workdir / "ssh_host_ed25519_key.pub")], capture_output=True,
                          text=True, check=True).stdout.split()[1]
    # Without a terminal and without a fingerprint to compare, nothing is recorded.
    proc = fleetcuda("trust", "bashhost", "-i", str(inv), state=env["state"])
    assert proc.returncode == 2 and "pass --fingerprint" in proc.stderr
    assert real in proc.stdout
    assert not kh.exists()
    wrong = fleetcuda("trust", "bashhost", "-i", str(inv), "--fingerprint", "SHA256:AAAA", state=env["state"])
    assert wrong.returncode == 3 and "fingerprint mismatch" in wrong.stderr
    assert not kh.exists()
    ok = fleetcuda("trust", "bashhost", "-i", str(inv), "--fingerprint", real, state=env["state"])
    assert ok.returncode == 0, ok.stderr
    assert kh.stat().st_mode & 0o777 == 0o600
    assert kh.read_text().startswith(f"[127.0.0.1]:{lab.port} ssh-ed25519 ")
    again = fleetcuda("trust", "bashhost", "-i", str(inv), state=env["state"])
    assert again.returncode == 0 and "already trusted" in again.stdout
    fleetcuda("apply", str(MARKER), "-i", str(inv), "--var", f"root={env['root']}", "--plain",
              "--limit", "bashhost/300", state=env["state"], check=True)
