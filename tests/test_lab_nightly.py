"""The nightly job against the lab: verify's reports and exit codes, history, the installed schedule
(real crontab, systemd unit files), and doctor on a converged and on a broken container."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import REPO, run_fleetcuda
from tests.test_lab_e2e import GDN, INV, PIP, ct, lab_is_up  # noqa: F401  (lab_is_up: autouse fixture)

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nightly")


@pytest.fixture(scope="module")
def converged(state: Path) -> None:
    out = run_fleetcuda("apply", GDN, "-i", INV, "--plain", state=state)
    assert out.returncode == 0, out.stdout + out.stderr


def prom_samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_drift_shows_in_reports_history_and_exit_codes(converged: None, state: Path, tmp_path: Path) -> None:
    prom, js, junit = tmp_path / "fleetcuda.prom", tmp_path / "verify.json", tmp_path / "verify.xml"
    reports = ["--report", f"prometheus={prom}", "--report", f"json={js}", "--report", f"junit={junit}"]
    ok = run_fleetcuda("verify", GDN, "-i", INV, "--plain", *reports, state=state)
    assert ok.returncode == 0, ok.stdout
    assert prom.stat().st_mode & 0o777 == 0o644 and js.stat().st_mode & 0o777 == 0o600
    before = prom_samples(prom.read_text())
    assert before['fleetcuda_verify_check_ok{recipe="gdn-fastpath",target="lab-a/201",step="fla-core"}'] == 1
    assert before['fleetcuda_verify_exit_code{recipe="gdn-fastpath"}'] == 0

    ct("lab-a/201", "/root/venv/bin/pip uninstall -y -q fla-core")
    try:
        out = run_fleetcuda("verify", GDN, "-i", INV, "--plain", *reports, state=state)
        assert out.returncode == 1
        after = prom_samples(prom.read_text())
        assert after['fleetcuda_verify_check_ok{recipe="gdn-fastpath",target="lab-a/201",step="fla-core"}'] == 0
        assert after['fleetcuda_verify_check_ok{recipe="gdn-fastpath",target="lab-a/200",step="fla-core"}'] == 1
        assert after['fleetcuda_verify_exit_code{recipe="gdn-fastpath"}'] == 1
        doc = json.loads(js.read_text())
        assert doc["schema"] == "fleetcuda.verify/1" and doc["exit_code"] == 1
        t201 = next(t for t in doc["targets"] if t["target"] == "lab-a/201")
        check = next(c for c in t201["checks"] if c["step"] == "fla-core")
        assert check["status"] == "drift"
        assert check["expected"] == "fla-core==0.6.0; import fla"
        assert "import fla: ModuleNotFoundError" in check["found"]
        assert any("fla-core: not installed (want 0.6.0)" in line for line in check["output_tail"])
        assert 'failures="1"' in junit.read_text() or 'failures="2"' in junit.read_text()

        hist = run_fleetcuda("history", "--format", "json", "--limit", "lab-a/*", state=state, check=True)
        changes = json.loads(hist.stdout)["changes"]
        assert {"target": "lab-a/201", "step": "fla-core", "kind": "broke"}.items() <= next(
            c for c in changes if c["target"] == "lab-a/201" and c["step"] == "fla-core").items()
        assert not any(c["target"] == "lab-a/200" for c in changes)
    finally:
        run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", "lab-a/201", state=state, check=True)
    fixed = run_fleetcuda("verify", GDN, "-i", INV, "--plain", state=state)
    assert fixed.returncode == 0
    hist = run_fleetcuda("history", "--format", "json", "--limit", "lab-a/201", state=state, check=True)
    kinds = {(c["step"], c["kind"]) for c in json.loads(hist.stdout)["changes"]}
    assert ("fla-core", "fixed") in kinds


def test_two_verify_runs_at_once_are_both_recorded(converged: None, state: Path) -> None:
    before = json.loads(run_fleetcuda("history", "--format", "json", "--runs", "1000", state=state,
                                      check=True).stdout)["runs"]
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: run_fleetcuda("verify", GDN, "-i", INV, "--plain", state=state), range(2)))
    assert [r.returncode for r in runs] == [0, 0], [r.stdout for r in runs]
    after = json.loads(run_fleetcuda("history", "--format", "json", "--runs", "1000", state=state,
                                     check=True).stdout)["runs"]
    assert len(after) == len(before) + 2
    assert {r["run_dir"] for r in after[:2]} == {r.stdout.split("logs: ")[-1].split()[0] for r in runs}


def _fleetcuda_bin() -> str:
    return str(Path(sys.executable).parent / "fleetcuda")


def test_schedule_installs_one_cron_entry_that_runs_unattended(converged: None, state: Path) -> None:
    if not Path("/usr/bin/crontab").exists():
        pytest.fail("crontab missing (tests/run installs cron)") if os.environ.get("CI") else pytest.skip("no cron")
    saved = subprocess.run(["crontab", "-l"], capture_output=True, text=True)
    other = "15 4 * * 1 /usr/bin/true # someone else's job\n"
    subprocess.run(["crontab", "-"], input=other, text=True, check=True)
    reports = state / "reports"
    try:
        first = run_fleetcuda("schedule", "install", GDN, "-i", INV, "--reports-dir", str(reports), state=state,
                              check=True)
        second = run_fleetcuda("schedule", "install", GDN, "-i", INV, "--reports-dir", str(reports), state=state,
                               check=True)
        assert first.stdout.startswith("installed: ") and second.stdout.startswith("already installed: ")
        table = subprocess.run(["crontab", "-l"], capture_output=True, text=True, check=True).stdout
        lines = table.splitlines()
        assert lines[0] == other.strip()
        ours = [ln for ln in lines if "fleetcuda-verify:nightly" in ln]
        assert len(ours) == 1
        expected = (f"0 3 * * * umask 077; cd {REPO} && HOME={os.environ['HOME']} FLEETCUDA_STATE_DIR={state} "
                    f"{_fleetcuda_bin()} verify {REPO}/{GDN} -i {REPO}/{INV} "
                    f"--plain --report json={reports}/nightly.json "
                    f"--report prometheus={reports}/fleetcuda_nightly.prom "
                    f"</dev/null >>{reports}/nightly.log 2>&1 # fleetcuda-verify:nightly")
        assert ours[0] == expected

        # What cron would run: the command part, through sh, with cron's bare environment and no terminal.
        command = ours[0].split(" ", 5)[5].rsplit(" # ", 1)[0].replace("\\%", "%")
        env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "SHELL": "/bin/sh",
               "FLEETCUDA_STATE_DIR": str(state)}
        proc = subprocess.run(["/bin/sh", "-c", command], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=300, start_new_session=True)
        assert proc.returncode == 0, (reports / "nightly.log").read_text()
        assert json.loads((reports / "nightly.json").read_text())["exit_code"] == 0
        assert "fleetcuda_verify_exit_code" in (reports / "fleetcuda_nightly.prom").read_text()

        shown = run_fleetcuda("schedule", "show", state=state, check=True)
        assert shown.stdout.strip() == expected
        run_fleetcuda("schedule", "remove", state=state, check=True)
        table = subprocess.run(["crontab", "-l"], capture_output=True, text=True).stdout
        assert table == other
    finally:
        if saved.returncode == 0:
            subprocess.run(["crontab", "-"], input=saved.stdout, text=True, check=True)
        else:
            subprocess.run(["crontab", "-r"], capture_output=True)


def test_schedule_systemd_units_exact_and_idempotent(state: Path, tmp_path: Path) -> None:
    units = tmp_path / "units"
    units.mkdir()
    reports = state / "reports"
    args = ["schedule", "install", GDN, "-i", INV, "--systemd", "--unit-dir", str(units), "--reports-dir",
            str(reports), "--on-calendar", "*-*-* 02:30:00"]
    first = run_fleetcuda(*args, state=state, check=True)
    assert "systemctl daemon-reload && systemctl enable --now fleetcuda-verify-nightly.timer" in first.stdout
    service = (units / "fleetcuda-verify-nightly.service").read_text()
    timer = (units / "fleetcuda-verify-nightly.timer").read_text()
    exec_start = next(ln for ln in service.splitlines() if ln.startswith("ExecStart="))
    assert shlex.split(exec_start.removeprefix("ExecStart=")) == [
        _fleetcuda_bin(), "verify", f"{REPO}/{GDN}", "-i", f"{REPO}/{INV}", "--plain",
        "--report", f"json={reports}/nightly.json", "--report", f"prometheus={reports}/fleetcuda_nightly.prom"]
    for line in ("Type=oneshot", "StandardInput=null"):
        assert line in service.splitlines()
    for line in ("OnCalendar=*-*-* 02:30:00", "Persistent=true"):
        assert line in timer.splitlines()
    mtimes = [p.stat().st_mtime_ns for p in units.iterdir()]
    time.sleep(0.01)
    second = run_fleetcuda(*args, state=state, check=True)
    assert second.stdout.startswith("unchanged")
    assert [p.stat().st_mtime_ns for p in units.iterdir()] == mtimes
    assert sorted(p.name for p in units.iterdir()) == ["fleetcuda-verify-nightly.service",
                                                       "fleetcuda-verify-nightly.timer"]


def test_doctor_on_a_converged_and_a_broken_container(converged: None, state: Path) -> None:
    good = run_fleetcuda("doctor", "-i", INV, "--limit", "lab-b/300", "--format", "json", state=state, check=True)
    findings = {f["check"]: f for f in json.loads(good.stdout)["lab-b/300"]["findings"]}
    assert findings["nvcc via /usr/local/cuda-12.8"]["value"] == "/usr/local/cuda-12.8/bin/nvcc release 12.8"
    assert findings["torch"]["value"].startswith("2.11.0+cu128 (CUDA 12.8")
    assert findings["causal_conv1d"]["status"] == "ok" and findings["fla"]["status"] == "ok"
    assert findings["GPU"]["value"] == "none visible"

    cache = "/root/.cache/pip/wheels/ab/cd/causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl"
    ct("lab-b/300", f"{PIP} --force-reinstall --no-deps torch==2.11.0+cu130 && mkdir -p {cache.rsplit('/', 1)[0]}"
                    f" && touch -d '2020-01-01' {cache}")
    try:
        bad = run_fleetcuda("doctor", "-i", INV, "--limit", "lab-b/300", "--format", "json", state=state)
        assert bad.returncode == 1
        findings = {f["check"]: f for f in json.loads(bad.stdout)["lab-b/300"]["findings"]}
        assert findings["causal_conv1d"]["status"] == "fail"
        assert "undefined symbol" in findings["causal_conv1d"]["value"]
        assert findings["nvcc via /usr/local/cuda-12.8"]["status"] == "warn"  # 12.8 vs torch's 13.0
        assert findings["cached causal-conv1d wheel"]["status"] == "warn"
        table = run_fleetcuda("doctor", "-i", INV, "--limit", "lab-b/300", state=state)
        assert re.search(r"causal_conv1d.*undefined symbol", table.stdout.replace("\n", " "))
    finally:
        ct("lab-b/300", f"{PIP} --force-reinstall --no-deps torch==2.11.0+cu128 && rm -rf /root/.cache/pip")
