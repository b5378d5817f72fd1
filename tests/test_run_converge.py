"""check -> apply -> verify, in-process on the fake connector: what each step ends as, and what was sent."""

from __future__ import annotations

from pathlib import Path

from fleetcuda.connectors.fake import exit_with, ok
from fleetcuda.results import ExitStatus, StepStatus, TargetStatus, exit_code
from tests.run_support import log_of, make_engine

TWO_STEPS = ("  - name: a\n    check: test -e /etc/a\n    apply: touch /etc/a\n    verify: test -s /etc/a\n"
             "  - name: b\n    check: test -e /etc/b\n    apply: touch /etc/b\n")


def test_a_satisfied_check_is_ok_and_nothing_is_applied(tmp_path: Path) -> None:
    engine, fake = make_engine(tmp_path, TWO_STEPS)
    [result] = engine.run()
    assert result.status == TargetStatus.OK
    assert [(s.name, s.status, s.detail) for s in result.steps] == [
        ("a", StepStatus.OK, "already satisfied"), ("b", StepStatus.OK, "already satisfied")]
    # Both checks went in one round trip, and nothing else was sent.
    assert [(c.step, c.phase, c.batched) for c in fake.calls] == [
        ("all-steps", "check", False), ("a", "check", True), ("b", "check", True)]
    assert "eval 'test -e /etc/a'" in fake.calls_for(step="a")[0].script
    assert exit_code([result]) == ExitStatus.OK


def test_a_failing_check_is_applied_then_verified_and_changed(tmp_path: Path) -> None:
    engine, fake = make_engine(tmp_path, TWO_STEPS)
    fake.on(step="a", phase="check", reply=exit_with(1, "no /etc/a"))
    [result] = engine.run()
    assert [(s.name, s.status) for s in result.steps] == [("a", StepStatus.CHANGED), ("b", StepStatus.OK)]
    assert result.steps[0].detail == "applied and verified"
    assert [c.phase for c in fake.calls_for(step="a")] == ["check", "apply", "verify"]
    # After a change, later checks are asked again on their own: their answers may have changed.
    assert [(c.phase, c.batched) for c in fake.calls_for(step="b")] == [("check", True), ("check", False)]
    assert result.status == TargetStatus.CHANGED and exit_code([result]) == ExitStatus.OK
    log = log_of(engine, "h")
    assert " a apply\n$ " in log and "## exit 0 after" in log


def test_a_failing_verify_fails_the_step_and_later_steps_do_not_run(tmp_path: Path) -> None:
    engine, fake = make_engine(tmp_path, TWO_STEPS)
    fake.on(step="a", phase="check", reply=exit_with(1))
    fake.on(step="b", phase="check", reply=exit_with(1))
    fake.on(step="a", phase="verify", reply=exit_with(1, "size 0\n/etc/a is empty"))
    [result] = engine.run()
    assert result.status == TargetStatus.FAILED
    [a] = result.steps  # b has no result: it never ran
    assert a.status == StepStatus.FAILED and a.detail == "verify: apply ran, but the verification failed"
    assert a.tail == ["size 0", "/etc/a is empty"]
    assert [c.phase for c in fake.calls_for(step="b")] == ["check"]  # only its batched check
    assert exit_code([result]) == ExitStatus.FAILED


def test_check_mode_says_would_change_and_applies_nothing(tmp_path: Path) -> None:
    engine, fake = make_engine(tmp_path, TWO_STEPS, mode="check")
    fake.on(step="b", phase="check", reply=exit_with(1, "no /etc/b"))
    [result] = engine.run()
    assert [s.status for s in result.steps] == [StepStatus.OK, StepStatus.WOULD_CHANGE]
    b = result.steps[1]
    assert b.detail == "check not satisfied" and b.tail == ["no /etc/b"]
    assert b.would_run is not None and "touch /etc/b" in b.would_run
    assert fake.calls_for(phase="apply") == []
    assert result.status == TargetStatus.WOULD_CHANGE


def test_verify_mode_reports_drift_with_what_was_found(tmp_path: Path) -> None:
    steps = ("  - name: driver\n    verify: nvidia-smi\n  - name: cuda\n    check: nvcc --version\n"
             "    apply: install-cuda\n")
    engine, fake = make_engine(tmp_path, steps, mode="verify")
    fake.on(step="driver", reply=ok("NVIDIA-SMI 570.86"))
    fake.on(step="cuda", reply=exit_with(1, "looking\nnvcc: release 12.4, expected 12.8"))
    [result] = engine.run()
    driver, cuda = result.steps
    assert (driver.status, driver.found) == (StepStatus.OK, "NVIDIA-SMI 570.86")
    assert (cuda.status, cuda.detail) == (StepStatus.DRIFT, "verification failed")
    assert cuda.found == "nvcc: release 12.4, expected 12.8"
    assert {c.phase for c in fake.calls if c.batched} == {"verify"}
    assert fake.calls_for(phase="apply") == []
    assert result.status == TargetStatus.DRIFT and exit_code([result]) == ExitStatus.FAILED


def test_a_single_step_is_checked_on_its_own(tmp_path: Path) -> None:
    engine, fake = make_engine(tmp_path, "  - name: a\n    check: test -e /x\n    apply: touch /x\n")
    fake.on(step="a", phase="check", reply=exit_with(1), times=1)
    [result] = engine.run()
    assert result.steps[0].status == StepStatus.CHANGED
    assert [(c.step, c.phase, c.batched) for c in fake.calls] == [
        ("a", "check", False), ("a", "apply", False), ("a", "verify", False)]  # no check: verify is the check


def test_a_secret_the_target_prints_is_masked_in_results_and_logs(tmp_path: Path) -> None:
    engine, fake = make_engine(tmp_path, "  - name: login\n    check: 'false'\n    apply: login \"$HF_TOKEN\"\n"
                                         "    env:\n      HF_TOKEN: '{{ hf_token }}'\n",
                               recipe_vars="vars:\n  hf_token: hf_abcdefghijkl\n")
    fake.on(step="login", phase="check", reply=exit_with(1))
    fake.on(step="login", phase="apply", reply=exit_with(2, "token hf_abcdefghijkl rejected"))
    [result] = engine.run()
    [login] = result.steps
    assert login.status == StepStatus.FAILED and login.detail == "apply: apply failed (exit 2)"
    assert login.tail == ["token *** rejected"]
    log = log_of(engine, "h")
    assert "token *** rejected" in log and "hf_abcdefghijkl" not in log


# -- --check previews a fresh target: ok, would-change, unknown, failed ------------------------------------------

# A fresh container, as the flagship's: a toolchain step to install, a step that needs what it installs, and
# assertions before and after it.
FRESH = ("  - name: sane\n    verify: test -d /\n"
         "  - name: compiler\n    check: command -v nvcc\n    apply: apt-get install -y cuda-nvcc\n"
         "  - name: nvcc-matches\n    verify: nvcc --version | grep -q 'release 12.8'\n"
         "  - name: ext\n    check: python -c 'import ext'\n    apply: pip install ext\n"
         "  - name: ext-works\n    verify: python -c 'import ext; ext.run()'\n")


def test_check_says_unknown_for_a_check_that_an_earlier_change_decides(tmp_path: Path) -> None:
    engine, fake = make_engine(tmp_path, FRESH, mode="check")
    fake.on(step="compiler", phase="check", reply=exit_with(1, "no nvcc"))
    fake.on(step="nvcc-matches", reply=exit_with(127, "bash: nvcc: command not found"))
    fake.on(step="ext", phase="check", reply=exit_with(1, "ModuleNotFoundError: No module named 'ext'"))
    fake.on(step="ext-works", reply=exit_with(1, "ModuleNotFoundError: No module named 'ext'"))
    [result] = engine.run()
    assert [(s.name, str(s.status), s.detail) for s in result.steps] == [
        ("sane", "ok", "already satisfied"),
        ("compiler", "would-change", "check not satisfied"),
        ("nvcc-matches", "unknown", "depends on compiler, which would change"),
        ("ext", "would-change", "check not satisfied"),
        ("ext-works", "unknown", "depends on compiler and ext, which would change")]
    nvcc = result.steps[2]
    assert nvcc.found == "bash: nvcc: command not found" and nvcc.tail == ["bash: nvcc: command not found"]
    # What each would do, in the kind's words, not a command line.
    assert result.steps[1].would_run == "shell: check `command -v nvcc`; apply `apt-get install -y cuda-nvcc`"
    assert fake.calls_for(phase="apply") == []
    # Nothing failed: the preview exits 0, or WOULD_CHANGE when asked for the detail.
    assert result.status == TargetStatus.WOULD_CHANGE
    assert exit_code([result]) == ExitStatus.OK
    assert exit_code([result], detailed=True) == ExitStatus.WOULD_CHANGE == 4


def test_check_still_fails_a_real_failure(tmp_path: Path) -> None:
    # Before anything would change, a failed assertion is a failure: nothing later could make it pass.
    engine, fake = make_engine(tmp_path, FRESH, mode="check")
    fake.on(step="sane", reply=exit_with(1, "no /"))
    [result] = engine.run()
    assert [(s.name, str(s.status)) for s in result.steps] == [("sane", "failed")]
    assert result.status == TargetStatus.FAILED and exit_code([result], detailed=True) == ExitStatus.FAILED
    # After one, a check that timed out gave no answer: a failure too, never unknown.
    (tmp_path / "again").mkdir()
    engine, fake = make_engine(tmp_path / "again", FRESH, mode="check")
    fake.on(step="compiler", phase="check", reply=exit_with(1, "no nvcc"))
    fake.on(step="nvcc-matches", reply=exit_with(124, "still waiting"))
    [result] = engine.run()
    assert [(s.name, str(s.status)) for s in result.steps] == [
        ("sane", "ok"), ("compiler", "would-change"), ("nvcc-matches", "failed")]
    assert result.status == TargetStatus.FAILED and exit_code([result]) == ExitStatus.FAILED


def test_check_with_nothing_to_change_is_ok_and_exit_0_even_with_the_detail(tmp_path: Path) -> None:
    engine, _ = make_engine(tmp_path, FRESH, mode="check")
    [result] = engine.run()
    assert {str(s.status) for s in result.steps} == {"ok"} and result.status == TargetStatus.OK
    assert exit_code([result], detailed=True) == ExitStatus.OK


def test_apply_still_fails_an_assertion_after_a_change(tmp_path: Path) -> None:
    # unknown is --check's alone: a real apply ran the change, so the assertion's failure is real.
    engine, fake = make_engine(tmp_path, FRESH)
    fake.on(step="compiler", phase="check", reply=exit_with(1, "no nvcc"))
    fake.on(step="nvcc-matches", reply=exit_with(1, "release 13.0"))
    [result] = engine.run()
    assert [(s.name, str(s.status)) for s in result.steps] == [
        ("sane", "ok"), ("compiler", "changed"), ("nvcc-matches", "failed")]


def test_unknown_names_the_nearest_three_steps_that_would_change(tmp_path: Path) -> None:
    steps = "".join(f"  - name: s{i}\n    check: test -e /s{i}\n    apply: touch /s{i}\n" for i in range(5))
    engine, fake = make_engine(tmp_path, steps + "  - name: all-there\n    verify: test -e /s4\n", mode="check")
    for i in range(5):
        fake.on(step=f"s{i}", phase="check", reply=exit_with(1))
    fake.on(step="all-there", reply=exit_with(1))
    [result] = engine.run()
    assert result.steps[-1].status == StepStatus.UNKNOWN
    assert result.steps[-1].detail == "depends on s2, s3 and s4 (and 2 earlier step(s)), which would change"
