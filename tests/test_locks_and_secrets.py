"""Two applies on one target: the second refuses (or waits) by a lock on the target itself; other
targets proceed. Secrets: never in dry-run output, logs, reports or history, yet the step gets them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, end_step, labelled_pids, run_fleetcuda
from tests.lab.sshd import LoopbackSshd
from tests.test_e2e_ssh import write_inventory

SLOW = str(REPO / "tests/data/slow.yaml")
SECRET = str(REPO / "tests/data/secret.yaml")


@pytest.fixture
def lab(sshd_lab: LoopbackSshd) -> LoopbackSshd:
    for vmid in (300, 301, 310, 320):
        sshd_lab.add_container(vmid, name=f"c{vmid}")
    return sshd_lab


@pytest.fixture
def env(lab: LoopbackSshd, tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(tmp_path, 0o755)
    return {"inv": write_inventory(lab, tmp_path / "inv.yaml"), "root": root, "state": tmp_path / "fc"}


def start(*args: str, state: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "fleetcuda", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**os.environ, "FLEETCUDA_STATE_DIR": str(state), "COLUMNS": "200"})


def test_second_apply_on_a_target_refuses_while_others_proceed(env: dict[str, Path]) -> None:
    common = ["-i", str(env["inv"]), "--var", f"root={env['root']}", "--plain"]
    first = start("apply", SLOW, *common, "--limit", "bashhost/300", "--var", "seconds=4", state=env["state"])
    time.sleep(1.5)
    second = run_fleetcuda("apply", SLOW, *common, "--limit", "bashhost/300,bashhost/301", "--var", "seconds=0",
                           state=env["state"])
    out, _ = first.communicate(timeout=60)
    assert first.returncode == 0, out
    assert second.returncode == 1, second.stdout
    assert "bashhost/300 done: locked: another fleetcuda apply holds /run/lock/fleetcuda-apply-300" in second.stdout
    assert f"pid {first.pid} since" in second.stdout  # names who holds it
    assert "bashhost/301 done: changed" in second.stdout  # another target proceeded in parallel
    # The first run released its lock: a new apply gets it, finds nothing to do, and releases it again.
    third = run_fleetcuda("apply", SLOW, *common, "--limit", "bashhost/300", state=env["state"], check=True)
    assert "done: ok" in third.stdout
    assert not Path("/run/lock/fleetcuda-apply-300").exists()


def test_lock_wait_waits_for_the_first_run(env: dict[str, Path]) -> None:
    common = ["-i", str(env["inv"]), "--var", f"root={env['root']}", "--plain", "--limit", "zshhost/310"]
    first = start("apply", SLOW, *common, "--var", "seconds=3", state=env["state"])
    time.sleep(1.5)
    second = run_fleetcuda("apply", SLOW, *common, "--lock-wait", "30", state=env["state"])
    first.communicate(timeout=60)
    assert first.returncode == 0
    assert second.returncode == 0, second.stdout
    assert "zshhost/310 done: ok" in second.stdout  # waited, then found the work done


def test_secrets_are_used_but_never_shown_or_stored(env: dict[str, Path], tmp_path: Path) -> None:
    token = "tok-8f3a9c2e77"
    mirror = "https://ci:hunter2-pw@mirror.example.invalid/simple"
    common = ["-i", str(env["inv"]), "--var", f"root={env['root']}", "--var", f"api_token={token}",
              "--var", f"mirror={mirror}", "--limit", "dashhost/320"]
    dry = run_fleetcuda("apply", SECRET, *common, "--dry-run", state=env["state"], check=True)
    assert token not in dry.stdout and "hunter2-pw" not in dry.stdout
    # A password in a URL makes the whole value a secret: read from stdin, shown nowhere (red team 3).
    assert "***" in dry.stdout and "mirror.example.invalid" not in dry.stdout

    report = tmp_path / "r.json"
    run = run_fleetcuda("apply", SECRET, *common, "--plain", "--show-output", state=env["state"])
    assert run.returncode == 1
    assert (env["root"] / "ct320" / "token").read_text() == token  # the step did get the real value
    assert "using token *** with https://ci:***@mirror.example.invalid/simple" in run.stdout
    ver = run_fleetcuda("verify", SECRET, *common, "--plain", "--report", f"json={report}", state=env["state"])
    assert ver.returncode == 0, ver.stdout
    written = [run.stdout, ver.stdout, report.read_text()]
    written += [p.read_text() for p in (env["state"] / "runs").rglob("*.log")]
    with sqlite3.connect(env["state"] / "history.sqlite") as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        assert len(tables) >= 2
        written += [json.dumps(row) for table in tables for row in db.execute(f"SELECT * FROM {table}")]  # noqa: S608
    for text in written:
        assert token not in text and "hunter2-pw" not in text


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_interrupt_stops_the_remote_step_and_the_next_run_resumes(env: dict[str, Path], signal_name: str) -> None:
    import signal

    common = ["-i", str(env["inv"]), "--var", f"root={env['root']}", "--plain", "--limit", "dashhost/320"]
    run = start("apply", SLOW, *common, "--var", "seconds=120", state=env["state"])
    deadline = time.monotonic() + 20
    while not labelled_pids("fleetcuda:slow-marker", script_has="fc_seconds=120\n"):  # the apply, not the check
        assert time.monotonic() < deadline, "the step never started"
        time.sleep(0.2)
    run.send_signal(getattr(signal, signal_name))
    out, _ = run.communicate(timeout=60)
    assert run.returncode == 130, out
    # timeout and bash in a real container; here the stand-in container shares the host, so sudo too
    stopped = re.search(r"interrupted during slow-marker: stopped (\d+) process\(es\) labelled fleetcuda:slow-marker",
                        out)
    assert stopped and int(stopped[1]) >= 1, out
    assert labelled_pids("fleetcuda:slow-marker") == []  # nothing left running on the target
    assert not Path("/run/lock/fleetcuda-apply-320").exists()
    assert not (env["root"] / "ct320" / "slow").exists()  # nothing half-done reported as done
    hist = run_fleetcuda("history", "--format", "json", state=env["state"], check=True)
    assert json.loads(hist.stdout)["runs"][0]["exit_code"] == 130
    again = run_fleetcuda("apply", SLOW, *common, "--var", "seconds=0", state=env["state"], check=True)
    assert "slow-marker: changed" in again.stdout


def test_a_full_disk_is_named_with_its_free_space(env: dict[str, Path], tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "fleetcuda-test", str(small)], check=True)
    try:
        out = run_fleetcuda("apply", str(REPO / "tests/data/fill.yaml"), "-i", str(env["inv"]), "--var",
                            f"dir={small}", "--plain", "--limit", "bashhost/300", state=env["state"])
        assert out.returncode == 1
        assert re.search(rf"disk full on bashhost/300: .*{small}: 0 MiB free of 1 MiB", out.stdout), out.stdout
        assert not (small / "done").exists()
    finally:
        subprocess.run(["umount", str(small)], check=False)


def _drop_sessions(user: str) -> None:
    """Kill the sshd processes serving `user`: the connection drops as if the link went away."""
    subprocess.run(["pkill", "-KILL", "-f", f"^sshd: {user}"], check=False)


def test_dropped_connection_mid_apply_is_a_clear_error_and_the_next_run_converges(
        lab: LoopbackSshd, env: dict[str, Path]) -> None:
    common = ["-i", str(env["inv"]), "--var", f"root={env['root']}", "--plain", "--limit", "dashhost/320,zshhost/310"]
    run = start("apply", SLOW, *common, "--var", "seconds=3", state=env["state"])
    deadline = time.monotonic() + 20
    while not labelled_pids("fleetcuda:slow-marker", vmid=320, script_has="fc_seconds=3\n"):  # the apply, not the check
        assert time.monotonic() < deadline
        time.sleep(0.1)
    _drop_sessions(lab.users["dash"])
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 3, out
    assert re.search(r"dashhost/320 done: unreachable: fcd@\[127\.0\.0\.1\]:\d+: .*(connection lost|cannot connect)|"
                     r"dashhost/320 done: unreachable: 127\.0\.0\.1: connection lost", out), out
    assert "zshhost/310 done: changed" in out  # the other host finished
    # The step goes on in the container after the drop, and holds the target's lock until it ends
    # (test_lock_faults.py): the next run is started once it has.
    deadline = time.monotonic() + 30
    while labelled_pids("fleetcuda:slow-marker", script_has="fc_seconds=3\n"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    again = run_fleetcuda("apply", SLOW, *common, "--var", "seconds=0", state=env["state"], check=True)
    assert "dashhost/320 done:" in again.stdout


def test_dropped_connection_during_a_read_only_check_is_retried(lab: LoopbackSshd, env: dict[str, Path]) -> None:
    common = ["-i", str(env["inv"]), "--var", f"root={env['root']}", "--plain", "--limit", "dashhost/320"]
    run_fleetcuda("apply", SLOW, *common, "--var", "seconds=0", state=env["state"], check=True)
    run = start("verify", SLOW, *common, "--var", "check_seconds=3", state=env["state"])
    deadline = time.monotonic() + 20
    while not labelled_pids("fleetcuda:slow-marker"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    _drop_sessions(lab.users["dash"])
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 0, out
    log = Path(out.split("logs: ")[-1].split()[0]) / "dashhost_320.log"
    assert "the command is read-only, so it is sent once more" in log.read_text()


def test_the_lock_of_a_killed_run_is_taken_over(env: dict[str, Path]) -> None:
    common = ["-i", str(env["inv"]), "--var", f"root={env['root']}", "--plain", "--limit", "bashhost/301"]
    run = start("apply", SLOW, *common, "--var", "seconds=30", state=env["state"])
    deadline = time.monotonic() + 20
    while not labelled_pids("fleetcuda:slow-marker", script_has="fc_seconds=30\n"):  # the apply, not the check
        assert time.monotonic() < deadline
        time.sleep(0.1)
    run.kill()  # SIGKILL: no chance to clean up
    run.wait()
    try:
        assert Path("/run/lock/fleetcuda-apply-301/owner").read_text().startswith("root@")
        # Its step goes on in the container and keeps the lock (test_lock_faults.py), until it ends: here, now.
        # (And what it started: its `sleep` carries the step's label in its environment, and keeps the lock.)
        end_step(labelled_pids("fleetcuda:slow-marker", script_has="fc_seconds=30\n"), "fleetcuda:slow-marker")
        out = run_fleetcuda("apply", SLOW, *common, "--var", "seconds=0", state=env["state"], check=True)
        assert "bashhost/301 lock: take-over" in out.stdout
        assert "bashhost/301 done: changed" in out.stdout
    finally:
        for pid in labelled_pids("fleetcuda:slow-marker"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 15)
