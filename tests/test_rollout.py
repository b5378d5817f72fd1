"""`apply --canary N` and `--serial K`, in-process: the CLI and the engine on the fake connector.

A rollout converges its targets batch after batch in inventory order (after --limit); a batch that does not
fully succeed (failed, unreachable, locked, ...) stops the rest, whose targets are reported not-run with the
reason, in the summary, the reports and the history, and the run exits non-zero. One run: one run directory,
one history record, the apply locks and shared builds as without batches.
"""

from __future__ import annotations

import io
import json
import re
import sqlite3
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from fleetcuda.cli import Environment, main
from fleetcuda.connectors.base import RunResult
from fleetcuda.connectors.fake import Call, FakeTransport, exit_with, ok
from fleetcuda.errors import UnreachableError
from fleetcuda.reports.formats import RunInfo, to_json, to_junit, to_prometheus
from fleetcuda.results import ExitStatus, StepResult, StepStatus, TargetResult, TargetStatus, exit_code
from fleetcuda.run import rollout
from tests.run_support import STEP, TWO_CONTAINERS, Recorder, fake_fleet, make_engine
from tests.test_run_shared import build_leaves_a_wheel

TARGETS = ["h/201", "h/202", "h/203", "h/204", "h/205"]
FIVE = "hosts:\n  h:\n    address: 10.0.0.1\n    user: root\n    containers:\n" + "".join(
    f"      {t.split('/')[1]}:\n        venv: /root/venv\n" for t in TARGETS)
RECIPE = "name: roll\nsteps:\n  - name: s\n    check: test -e /tmp/done\n    apply: touch /tmp/done\n"
ANOTHER_RUN = "alice@ctl2 pid 4242 since 2026-12-01T09:00:00Z machine 0123456789ab boot 89abcdef start 5150"


@dataclass
class Outcome:
    code: int
    out: str
    err: str


@dataclass
class Rollout:
    """`fleetcuda apply` in this process, every host answered by one fake connector (`fake`)."""

    tmp: Path
    fake: FakeTransport
    terminal: bool = False

    @property
    def state(self) -> Path:
        return self.tmp / "state"

    def __call__(self, *argv: str, recipe: str = RECIPE, inventory: str = FIVE) -> Outcome:
        (self.tmp / "r.yaml").write_text(recipe)
        (self.tmp / "i.yaml").write_text(inventory)
        out, err = io.StringIO(), io.StringIO()
        env = Environment.with_streams(out, err, io.StringIO(), environ={"PATH": "/usr/bin:/bin", "COLUMNS": "200"},
                                       home=self.tmp, cwd=self.tmp, state_dir=self.state,
                                       stdout_is_terminal=self.terminal,
                                       clock=lambda: datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC))
        try:
            plain = [] if self.terminal else ["--plain"]
            code = main(["apply", str(self.tmp / "r.yaml"), "-i", str(self.tmp / "i.yaml"), *plain, *argv], env)
        except SystemExit as exc:  # argparse's usage errors
            code = int(exc.code or 0)
        return Outcome(code, out.getvalue(), err.getvalue())

    def history(self) -> list[tuple[str, str, str | None]]:
        with sqlite3.connect(self.state / "history.sqlite") as db:
            assert db.execute("SELECT count(*) FROM runs").fetchone() == (1,)  # one record for the whole apply
            return db.execute("SELECT target, status, error FROM target_results ORDER BY target").fetchall()

    def touched(self) -> list[str]:
        """The targets the fake was asked anything for, in the order of their first call."""
        seen: list[str] = []
        for call in self.fake.calls:
            if call.target and call.target not in seen:
                seen.append(call.target)
        return seen

    def span(self, target: str) -> tuple[int, int]:
        """The positions of a target's first and last call."""
        at = [i for i, c in enumerate(self.fake.calls) if c.target == target]
        return at[0], at[-1]


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Rollout:
    monkeypatch.setenv("FLEETCUDA_CACHE_DIR", str(tmp_path / "cache"))
    fake = FakeTransport()
    fake.on(step="s", phase="check", reply=exit_with(1))  # nowhere converged yet
    monkeypatch.setattr("fleetcuda.cli.common.transport_factory", lambda inventory: lambda host: fake)
    return Rollout(tmp_path, fake)


def fail_apply_on(fake: FakeTransport, target: str) -> None:
    fake.on(step="s", phase="apply", match=lambda c: c.target == target,
            reply=exit_with(1, "ImportError: undefined symbol: _ZN3c104cuda9SetDevice (torch 2.12)"))


def batch_lines(out: str) -> list[str]:
    """The plain reporter's `HH:MM:SS [canary ]batch N/M: targets` lines, without their time."""
    return re.findall(r"^\S+ ((?:canary )?batch \d+/\d+: .*)$", out, re.M)


def assert_batches_in_order(run: Rollout, *batches: list[str]) -> None:
    """Every call of a batch's targets came after every call of the batch before."""
    for before, after in zip(batches, batches[1:], strict=False):
        assert max(run.span(t)[1] for t in before) < min(run.span(t)[0] for t in after), (before, after)


# -- batches --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("canary", "serial", "expected"), [
    (None, None, [("batch", "abcde")]),
    (1, None, [("canary", "a"), ("batch", "bcde")]),
    (2, None, [("canary", "ab"), ("batch", "cde")]),
    (None, 2, [("batch", "ab"), ("batch", "cd"), ("batch", "e")]),
    (1, 2, [("canary", "a"), ("batch", "bc"), ("batch", "de")]),
    (1, 3, [("canary", "a"), ("batch", "bcd"), ("batch", "e")]),
    (5, None, [("canary", "abcde")]),  # a canary as large as the fleet: one batch
    (9, 2, [("canary", "abcde")]),
    (None, 9, [("batch", "abcde")]),
    (4, 9, [("canary", "abcd"), ("batch", "e")]),
])
def test_batches_are_the_canary_then_serial_sized_chunks_in_order(canary: int | None, serial: int | None,
                                                                  expected: list[tuple[str, str]]) -> None:
    got = rollout.batches(list("abcde"), canary, serial)
    assert [("canary" if b.canary else "batch", "".join(b.targets)) for b in got] == expected
    assert [(b.number, b.total) for b in got] == [(i + 1, len(expected)) for i in range(len(expected))]


def test_batch_names_and_the_reason_the_rest_stopped() -> None:
    first, second, _ = rollout.batches(list("abcde"), 1, 2)
    assert (first.name, second.name) == ("canary batch 1/3", "batch 2/3")
    assert rollout.stop_reason(first, [("a", "failed")]) == "not started: canary batch failed (a failed)"
    many = [(t, "unreachable") for t in "bcdef"]
    assert rollout.stop_reason(second, many) == ("not started: batch 2/3 failed (b unreachable, c unreachable, "
                                                 "d unreachable and 2 more)")
    with pytest.raises(ValueError):
        rollout.batches(list("ab"), 0, None)


# -- apply over the fake fleet ---------------------------------------------------------------------------------------


def test_a_canary_that_converges_lets_every_target_converge(run: Rollout) -> None:
    got = run("--canary", "1")
    assert got.code == ExitStatus.OK, got.out
    assert "canary batch 1/2: h/201\n" in got.out and "batch 2/2: h/202, h/203, h/204, h/205\n" in got.out
    assert all(f"{t} done: changed" in got.out for t in TARGETS)
    assert_batches_in_order(run, ["h/201"], TARGETS[1:])
    assert {t: s for t, s, _ in run.history()} == dict.fromkeys(TARGETS, "changed")


def test_a_failing_canary_stops_the_rest_and_they_are_reported_not_run(run: Rollout) -> None:
    fail_apply_on(run.fake, "h/201")
    got = run("--canary", "1")
    assert got.code == ExitStatus.FAILED
    why = "not started: canary batch failed (h/201 failed)"
    assert "h/201 done: failed" in got.out
    for t in TARGETS[1:]:
        assert f"{t} done: not-run: {why}\n" in got.out
    # The summary (plain: no table): the canary's failure with its output, the rest in one line, then the counts.
    assert "h/201: step s failed: apply: apply failed (exit 1)" in got.out and "(torch 2.12)" in got.out
    assert f"h/202, h/203, h/204, h/205: not-run: {why}\n" in got.out
    assert "apply roll: 5 target(s): 1 failed, 4 not-run; exit 1;" in got.out
    assert run.touched() == ["h/201"]  # nothing was sent for the others, not even a check
    assert run.history() == [("h/201", "failed", None)] + [(t, "not-run", why) for t in TARGETS[1:]]
    [run_dir] = (run.state / "runs").iterdir()  # one run, whose logs are the canary's only
    assert [p.name for p in run_dir.iterdir()] == ["h_201.log"]


def test_serial_batches_run_in_order_and_a_failing_second_batch_stops_the_third(run: Rollout) -> None:
    fail_apply_on(run.fake, "h/204")
    got = run("--serial", "2")
    assert got.code == ExitStatus.FAILED
    assert batch_lines(got.out) == ["batch 1/3: h/201, h/202", "batch 2/3: h/203, h/204"]  # the third never started
    assert_batches_in_order(run, ["h/201", "h/202"], ["h/203", "h/204"])
    assert "h/203 done: changed" in got.out  # the failing batch ran to its end
    assert "h/205 done: not-run: not started: batch 2/3 failed (h/204 failed)" in got.out
    assert "h/205" not in run.touched()
    assert dict((t, s) for t, s, _ in run.history()) == {"h/201": "changed", "h/202": "changed", "h/203": "changed",
                                                         "h/204": "failed", "h/205": "not-run"}


def test_canary_and_serial_combine(run: Rollout) -> None:
    got = run("--canary", "1", "--serial", "2", "--forks", "1")
    assert got.code == ExitStatus.OK
    assert batch_lines(got.out) == [
        "canary batch 1/3: h/201", "batch 2/3: h/202, h/203", "batch 3/3: h/204, h/205"]
    assert_batches_in_order(run, ["h/201"], ["h/202", "h/203"], ["h/204", "h/205"])


def test_a_limit_then_the_inventory_order_makes_the_batches(run: Rollout) -> None:
    got = run("--limit", "h/204,h/202,h/205", "--canary", "1")
    assert got.code == ExitStatus.OK
    assert "canary batch 1/2: h/202\n" in got.out and "batch 2/2: h/204, h/205\n" in got.out


def test_a_canary_as_large_as_the_fleet_is_one_batch(run: Rollout) -> None:
    fail_apply_on(run.fake, "h/203")
    got = run("--canary", "9")
    assert got.code == ExitStatus.FAILED
    assert " batch " not in got.out and "not-run" not in got.out  # one batch: nothing to stop
    assert sorted(run.touched()) == TARGETS


def test_on_a_terminal_the_live_view_says_each_batch_and_the_summary_the_targets_not_run(run: Rollout) -> None:
    fail_apply_on(run.fake, "h/203")
    run.terminal = True
    got = run("--canary", "1", "--serial", "2")
    assert got.code == ExitStatus.FAILED
    assert "\x1b[" in got.out and " done: " not in got.out  # rich drew it, no plain lines
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", got.out)
    assert "canary batch 1/3: h/201" in text and "batch 2/3: h/202, h/203" in text and "batch 3/3" not in text
    assert "h/204, h/205: not-run: not started: batch 2/3 failed (h/203 failed)" in text


def test_an_unreachable_canary_is_exit_3_and_a_locked_one_exit_1(run: Rollout) -> None:
    def unreachable(call: Call) -> RunResult:
        raise UnreachableError("root@[10.0.0.1]:22: cannot connect: connection refused")

    rule = run.fake.on(match=lambda c: c.target == "h/201", reply=unreachable)
    run.fake.rules.remove(rule)
    run.fake.rules.insert(0, rule)  # before the check's rule: every call for the canary
    got = run("--canary", "1")
    assert got.code == ExitStatus.UNREACHABLE  # the cause, not hidden by the targets it kept from starting
    assert "h/202 done: not-run: not started: canary batch failed (h/201 unreachable)" in got.out

    run.fake.rules.remove(rule)
    run.fake.locks.hold("fleetcuda-apply-201", ANOTHER_RUN)
    again = run("--canary", "1")
    assert again.code == ExitStatus.FAILED
    assert "h/202 done: not-run: not started: canary batch failed (h/201 locked)" in again.out


def test_serial_bounds_the_targets_at_once_and_forks_bounds_them_within_a_batch(run: Rollout) -> None:
    running, most, guard = [0], [0], threading.Lock()

    def slow(call: Call) -> RunResult:
        with guard:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.3)
        with guard:
            running[0] -= 1
        return ok()

    run.fake.on(step="s", phase="apply", reply=slow)
    assert run().code == ExitStatus.OK
    assert most[0] > 2  # the control: without --serial, targets overlap
    for argv, bound in ((["--serial", "2"], 2), (["--serial", "4", "--forks", "2"], 2)):
        most[0] = 0
        assert run(*argv).code == ExitStatus.OK
        assert 1 <= most[0] <= bound, argv


# -- bad values and modes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "says"), [
    (["--canary", "0"], "argument --canary: expected a number of targets, 1 or more (got '0')"),
    (["--canary", "-1"], "argument --canary: expected a number of targets, 1 or more (got '-1')"),
    (["--serial", "2.5"], "argument --serial: expected a number of targets, 1 or more (got '2.5')"),
    (["--serial", "two"], "argument --serial: expected a number of targets, 1 or more (got 'two')"),
    (["--serial", ""], "argument --serial: expected a number of targets, 1 or more (got '')"),
    (["--canary", "1_0"], "argument --canary: expected a number of targets, 1 or more (got '1_0')"),
])
def test_a_bad_count_is_a_usage_error_and_nothing_runs(run: Rollout, argv: list[str], says: str) -> None:
    got = run(*argv)
    assert got.code == ExitStatus.INPUT and got.out == ""
    assert got.err.startswith("usage: fleetcuda apply") and f"fleetcuda: error: {says}\n" in got.err
    assert run.fake.calls == [] and not run.state.exists()


@pytest.mark.parametrize(("argv", "says"), [
    (["--check", "--serial", "2"], "fleetcuda: --serial: does not go with --check: a check changes nothing, so "
                                   "there is nothing to roll out (--dry-run shows the batches)\n"),
    (["--check", "--canary", "1", "--serial", "2"], "fleetcuda: --canary/--serial: does not go with --check"),
    (["--dry-run", "--format", "json", "--canary", "1"],
     "fleetcuda: --canary: with --dry-run, the batches are shown by --format human or shell, not json\n"),
])
def test_rollout_options_refuse_the_modes_they_make_no_sense_in(run: Rollout, argv: list[str], says: str) -> None:
    got = run(*argv)
    assert got.code == ExitStatus.INPUT and got.out == "" and got.err.startswith(says)
    assert run.fake.calls == []


def test_verify_offers_no_rollout_options(run: Rollout, tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text(RECIPE)
    err = io.StringIO()
    env = Environment.with_streams(io.StringIO(), err, io.StringIO(), environ={}, home=tmp_path, cwd=tmp_path,
                                   state_dir=tmp_path / "state")
    with pytest.raises(SystemExit) as exc:
        main(["verify", str(tmp_path / "r.yaml"), "--serial", "2"], env)
    assert exc.value.code == ExitStatus.INPUT and "unrecognized arguments: --serial 2" in err.getvalue()


@pytest.mark.parametrize("fmt", ["human", "shell"])
def test_a_dry_run_shows_the_batches_in_its_header(run: Rollout, fmt: str) -> None:
    got = run("--dry-run", "--format", fmt, "--canary", "1", "--serial", "3")
    assert got.code == ExitStatus.OK and run.fake.calls == []
    header = got.out.split("\n\n")[0].splitlines()
    # (A long temporary path wraps the first line: what it says is read with the wrap undone; the summary wraps
    # at spaces, the full listing anywhere.)
    unwrapped = re.sub(r"\n[#+ ]*", " " if fmt == "human" else "", got.out.split("\n\n")[0])
    assert header[0].startswith("# fleetcuda apply ") and "--dry-run: 5 target(s) from" in unwrapped
    assert f"--dry-run: 5 target(s) from {run.tmp / 'i.yaml'}" in unwrapped
    assert header[-3:] == ["#   canary batch 1/3: h/201", "#   batch 2/3: h/202, h/203, h/204", "#   batch 3/3: h/205"]
    assert "# Rollout (--canary 1 --serial 3): 3 batch(es), in this order;" in got.out
    plain = run("--dry-run", "--format", fmt)
    assert "Rollout" not in plain.out and "batch 1/" not in plain.out


# -- the engine: Ctrl-C between batches, locks and shared builds across them ------------------------------------------


ONE_STEP = "  - name: s\n    check: test -e /done\n    apply: touch /done\n"


def test_ctrl_c_between_batches_starts_no_other_and_releases_every_lock(tmp_path: Path) -> None:
    class CtrlCBeforeTheSecondBatch(Recorder):
        def batch_started(self, name: str, targets: list[str]) -> None:
            if name.startswith("batch 2/"):
                raise KeyboardInterrupt  # what the CLI's SIGINT handler raises in the main thread

    recorder = CtrlCBeforeTheSecondBatch()
    fake = FakeTransport()
    fake.on(step="s", phase="check", reply=exit_with(1))
    engine, _ = make_engine(tmp_path, ONE_STEP, inventory=TWO_CONTAINERS, fake=fake, locked=True, reporter=recorder)
    engine.executor.batches = rollout.batches(engine.targets, 1)
    results = {r.target: r for r in engine.run()}
    assert engine.interrupted
    assert results["h/201"].status == TargetStatus.CHANGED
    assert (results["h/202"].status, results["h/202"].error) == (TargetStatus.INTERRUPTED, "not started: interrupted")
    assert exit_code(list(results.values())) == ExitStatus.INTERRUPTED
    assert {c.target for c in fake.calls} <= {"h/201", ""}
    assert fake.locks.owners == {}  # the canary's lock was released; the other's never taken
    assert fake.locks.said("held") == fake.locks.said("released") == 1


def test_a_wheel_the_canary_built_is_installed_by_the_later_batch(tmp_path: Path) -> None:
    fake = fake_fleet()
    held, entered = threading.Event(), threading.Event()
    held.set()  # nobody waits: the canary builds alone
    build_leaves_a_wheel(fake, entered, held)
    engine, _ = make_engine(tmp_path, STEP, inventory=TWO_CONTAINERS, fake=fake, locked=True)
    engine.executor.batches = rollout.batches(engine.targets, 1)
    results = {r.target: r for r in engine.run()}
    assert [c.target for c in fake.calls_for(step="ext", phase="apply")] == ["h/201"]  # one build, the canary's
    assert [c.target for c in fake.calls_for(phase="install")] == ["h/202"]
    assert results["h/202"].steps[0].detail.startswith("installed the wheel built on h/201 for fingerprint ")
    assert all(r.status == TargetStatus.CHANGED for r in results.values())
    assert fake.locks.owners == {} and fake.locks.said("held") == 2
    assert fake.files.paths(None) == []  # the host's staging copy removed at the end of the run


def test_the_engine_refuses_batches_that_are_not_its_targets(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="each of the run's targets once"):
        make_engine(tmp_path, ONE_STEP, inventory=TWO_CONTAINERS, rollout=[rollout.Batch(1, 1, True, ())])


# -- reports ---------------------------------------------------------------------------------------------------------


def stopped_rollout() -> tuple[RunInfo, list[TargetResult]]:
    why = "not started: canary batch failed (h/201 failed)"
    results = [TargetResult("h/201", TargetStatus.FAILED, [StepResult("s", StepStatus.FAILED, 1.0, "apply failed")],
                            log="/runs/x/h_201.log", duration=1.0),
               TargetResult("h/202", TargetStatus.NOT_RUN, error=why),
               TargetResult("h/203", TargetStatus.NOT_RUN, error=why)]
    at = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
    info = RunInfo("apply", "r.yaml", "roll", "i.yaml", at, at, int(exit_code(results)), "/runs/x")
    return info, results


def test_reports_list_the_targets_a_stopped_rollout_never_started() -> None:
    info, results = stopped_rollout()
    assert info.exit_code == ExitStatus.FAILED
    report = json.loads(to_json(info, results))
    assert report["summary"]["target_status"]["not-run"] == 2
    assert [(t["target"], t["status"], t["error"]) for t in report["targets"]][1:] == [
        ("h/202", "not-run", "not started: canary batch failed (h/201 failed)"),
        ("h/203", "not-run", "not started: canary batch failed (h/201 failed)")]

    junit = ET.fromstring(to_junit(info, results))
    suite = junit.find("testsuite[@name='h/202']")
    assert suite is not None and suite.get("skipped") == "1" and suite.get("errors") == "0"
    skipped = suite.find("testcase[@name='(target)']/skipped")
    assert skipped is not None and skipped.get("message") == "not started: canary batch failed (h/201 failed)"
    assert junit.get("failures") == "1" and junit.get("skipped") == "2"

    metrics = to_prometheus(info, results)
    assert 'fleetcuda_verify_target_up{recipe="roll",target="h/202"} 0' in metrics
    assert 'fleetcuda_verify_target_ok{recipe="roll",target="h/202"} 0' in metrics
    assert 'fleetcuda_verify_exit_code{recipe="roll"} 1' in metrics


def test_not_run_alone_is_never_success() -> None:
    assert exit_code([TargetResult("a", TargetStatus.NOT_RUN)]) == ExitStatus.FAILED
    assert exit_code([TargetResult("a", TargetStatus.OK), TargetResult("b", TargetStatus.NOT_RUN)]) \
        == ExitStatus.FAILED
    assert exit_code([TargetResult("a", TargetStatus.FAILED), TargetResult("b", TargetStatus.UNREACHABLE),
                      TargetResult("c", TargetStatus.NOT_RUN)]) == ExitStatus.FAILED
