"""`apply --canary` and `--serial` against the lab's four containers (inventory order: lab-a/200, lab-a/201,
lab-b/300, lab-b/301), with a tiny recipe written here: its one step touches a marker file in the container,
and refuses on the container whose vmid is `--var fail_vmid=...`. The markers say which containers a rollout
reached; a stopped rollout must leave the rest untouched, say so, and release every lock it took.

The containers are not reset: only the marker (a file of this test's own name under /root) is made and removed.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_fleetcuda
from tests.test_lab_e2e import INV, TARGETS, ct, lab_is_up  # noqa: F401

pytestmark = pytest.mark.lab

MARKER = f"/root/fleetcuda-canary-{uuid.uuid4().hex[:8]}"
RECIPE = f"""name: canary-probe
vars:
  marker: {MARKER}
  fail_vmid: none
steps:
  - name: probe
    check: test -e "{{{{ marker }}}}"
    apply: |
      if [ "{{{{ vmid }}}}" = "{{{{ fail_vmid }}}}" ]; then echo "refusing on purpose on {{{{ vmid }}}}" >&2; exit 1; fi
      touch "{{{{ marker }}}}"
"""


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("canary") / "probe.yaml"
    path.write_text(RECIPE)
    return path


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    """A state directory per test (its history holds that test's runs only); no marker before or after."""
    remove_markers()
    yield tmp_path
    remove_markers()


def remove_markers() -> None:
    for target in TARGETS:
        ct(target, f"rm -f {MARKER}")


def reached() -> list[str]:
    """The containers that have the marker, in inventory order."""
    return [t for t in TARGETS if ct(t, f"test -e {MARKER}", check=False).returncode == 0]


def no_lock_left() -> None:
    for target in TARGETS:
        vmid = target.split("/")[1]
        left = ct(target, f"ls -d /run/lock/fleetcuda-apply-{vmid} /run/fleetcuda-apply-{vmid} 2>/dev/null",
                  check=False).stdout
        assert left.strip() == "", f"{target}: a lock was left: {left}"


def apply(recipe: Path, state: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return run_fleetcuda("apply", str(recipe), "-i", INV, "--plain", *argv, state=state)


def batch_lines(out: str) -> list[str]:
    return re.findall(r"^\S+ ((?:canary )?batch \d+/\d+: .*)$", out, re.M)


def last_run(state: Path) -> dict[str, object]:
    listed = run_fleetcuda("history", "--format", "json", "--runs", "1", state=state, check=True)
    [run] = json.loads(listed.stdout)["runs"]
    return run


def test_a_failing_canary_stops_the_rollout_and_the_rest_stay_untouched(recipe: Path, state: Path) -> None:
    out = apply(recipe, state, "--canary", "1", "--var", "fail_vmid=200")
    assert out.returncode == 1, out.stdout + out.stderr
    assert batch_lines(out.stdout) == ["canary batch 1/2: lab-a/200"]
    assert "lab-a/200 done: failed" in out.stdout and "refusing on purpose on 200" in out.stdout
    why = "not started: canary batch failed (lab-a/200 failed)"
    for target in TARGETS[1:]:
        assert f"{target} done: not-run: {why}" in out.stdout
    assert f"lab-a/201, lab-b/300, lab-b/301: not-run: {why}" in out.stdout
    assert reached() == []
    no_lock_left()
    run = last_run(state)
    assert run["exit_code"] == 1 and run["target_status"] == {"failed": 1, "not-run": 3}
    # Only the canary was connected to: the run directory holds its log alone.
    assert [p.name for p in Path(out.stdout.split("logs: ")[-1].strip()).iterdir()] == ["lab-a_200.log"]


def test_a_failing_second_batch_stops_the_third(recipe: Path, state: Path) -> None:
    out = apply(recipe, state, "--canary", "1", "--serial", "2", "--var", "fail_vmid=300")
    assert out.returncode == 1, out.stdout + out.stderr
    assert batch_lines(out.stdout) == ["canary batch 1/3: lab-a/200", "batch 2/3: lab-a/201, lab-b/300"]
    assert "lab-b/300 done: failed" in out.stdout and "lab-a/201 done: changed" in out.stdout
    assert "lab-b/301 done: not-run: not started: batch 2/3 failed (lab-b/300 failed)" in out.stdout
    assert reached() == ["lab-a/200", "lab-a/201"]
    no_lock_left()
    assert last_run(state)["target_status"] == {"changed": 2, "failed": 1, "not-run": 1}


def test_a_good_rollout_converges_every_container_batch_after_batch(recipe: Path, state: Path) -> None:
    out = apply(recipe, state, "--serial", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert batch_lines(out.stdout) == ["batch 1/2: lab-a/200, lab-a/201", "batch 2/2: lab-b/300, lab-b/301"]
    lines = out.stdout.splitlines()
    first_done = max(i for i, ln in enumerate(lines) if re.search(r" lab-a/20[01] done: changed$", ln))
    second_start = lines.index(next(ln for ln in lines if ln.endswith("batch 2/2: lab-b/300, lab-b/301")))
    assert first_done < second_start  # the second batch started once the first had ended
    assert reached() == TARGETS
    again = apply(recipe, state, "--canary", "1", "--serial", "2")
    assert again.returncode == 0 and all(f"{t} done: ok" in again.stdout for t in TARGETS)
    no_lock_left()
