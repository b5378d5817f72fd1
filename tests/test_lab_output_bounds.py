"""What fleetcuda keeps of a target's output is bounded over SSH and `pct exec` too (issue 22.3): a batched
check that prints 40 MB, and a check alone that prints without end until its timeout, in real containers (a zsh
login as root, bash with sudo -n), cost the control process a bounded amount of memory and the run log a
bounded size. tests/test_output_bounds.py has the same on a local target, where the batch shell is measured too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_lab_e2e import INV, lab_is_up  # noqa: F401  (the fixture skips/fails without a lab)
from tests.test_output_bounds import _MEASURE, LINE, MAX_LOG, MAX_RSS_MB

pytestmark = pytest.mark.lab
TARGETS = "lab-a/200,lab-b/300"


def _run(tmp_path: Path, recipe: str) -> tuple[int, int, str, list[Path]]:
    r = tmp_path / "r.yaml"
    r.write_text(textwrap.dedent(recipe))
    state = tmp_path / "state"
    env = {**os.environ, "FLEETCUDA_STATE_DIR": str(state), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, "-m", "fleetcuda", "verify", str(r), "-i",
                           INV, "--limit", TARGETS, "--plain"], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    first, _, out = proc.stdout.partition("\n")
    rc, rss_kb = map(int, first.split())
    return rc, rss_kb // 1024, out, sorted(state.glob("runs/*/*.log"))


def test_a_batched_check_with_a_huge_output_over_ssh_and_pct(tmp_path: Path) -> None:
    rc, rss, out, logs = _run(tmp_path, f"""\
        name: r
        steps:
          - name: quiet
            verify: "true"
          - name: loud
            verify: |
              {LINE} | head -c 40000000; echo; echo the end
        """)
    assert rc == 0, out
    assert rss < MAX_RSS_MB, f"{rss} MB"
    assert len(logs) == 2
    for log in logs:
        text = log.read_text()
        assert log.stat().st_size < MAX_LOG
        assert re.search(r"\| \[\.\.\. \d+ bytes dropped \.\.\.\]", text) and "| the end" in text


def test_an_endless_check_alone_over_ssh_and_pct(tmp_path: Path) -> None:
    rc, rss, out, logs = _run(tmp_path, f"""\
        name: r
        steps:
          - name: endless
            timeout: 3
            verify: |
              {LINE}
        """)
    assert rc == 1 and out.count("endless: failed (verification timed out after 3s") == 2, out
    assert rss < MAX_RSS_MB, f"{rss} MB"
    for log in logs:
        assert log.stat().st_size < MAX_LOG
        assert re.search(r"^\[\.\.\. \d+ bytes dropped \.\.\.\]$", log.read_text(), re.M)


def test_an_apply_piped_into_head_converges_over_ssh_and_pct(tmp_path: Path) -> None:
    # Issue 22.9b where a user meets it: the reader leaves after 3 lines, the run goes on to the end.
    import secrets
    import sqlite3

    mark = f"/tmp/fleetcuda-22-9b-{secrets.token_hex(4)}"
    r = tmp_path / "r.yaml"
    r.write_text("name: r\nsteps:\n" + "".join(
        f"  - name: s{n}\n    check: test -e {mark}-{n}\n    apply: sleep 0.3; touch {mark}-{n}\n" for n in range(3)))
    state = tmp_path / "state"
    env = {**os.environ, "FLEETCUDA_STATE_DIR": str(state)}
    command = (f"{sys.executable} -m fleetcuda apply {r} -i {INV} --limit {TARGETS} --plain --lock-wait 120 "
               '| head -3; echo "rc=${PIPESTATUS[0]}" >&2')
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert len(proc.stdout.splitlines()) == 3
    assert proc.stderr.strip().splitlines()[-1] == "rc=0", proc.stderr
    with sqlite3.connect(state / "history.sqlite") as db:
        assert db.execute("SELECT mode, exit_code FROM runs").fetchall() == [("apply", 0)]
    again = subprocess.run([sys.executable, "-m", "fleetcuda", "verify", str(r), "-i", INV, "--limit", TARGETS,
                            "--plain"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert again.returncode == 0, again.stdout  # every step of both targets had converged
