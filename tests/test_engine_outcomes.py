"""The engine in-process, on a scripted transport: whatever goes wrong inside a target, it ends with a final
status and its reason, and the run's exit status says so (red team items 5, 6, 9)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetcuda.connectors.ssh import RunResult, Transport, TransportPool
from fleetcuda.plan.command import BuiltCommand
from fleetcuda.plan.inventory import load_inventory
from fleetcuda.plan.recipe import load_recipe
from fleetcuda.reports.live import Reporter
from fleetcuda.results import ExitStatus, StepStatus, TargetStatus, exit_code
from fleetcuda.run.engine import Engine

Reply = Callable[[BuiltCommand], RunResult]


class ScriptedTransport(Transport):
    """Answers each command with `reply(cmd)`; records what was sent."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.sent: list[BuiltCommand] = []

    def run(self, cmd: BuiltCommand, *, timeout: float | None, on_line: Callable[[str], None]) -> RunResult:
        self.sent.append(cmd)
        res = self.reply(cmd)
        for line in res.output.splitlines():
            on_line(line)
        return res


def _setup(tmp_path: Path, steps: str) -> tuple:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nvars:\n  x: '1'\nsteps:\n{steps}")
    inv = tmp_path / "i.yaml"
    inv.write_text("hosts:\n  h:\n    kind: local\n")
    return load_recipe(recipe), load_inventory(inv).targets


def _engine(tmp_path: Path, steps: str, reply: Reply, mode: str = "verify",
            reporter: Reporter | None = None) -> tuple[Engine, ScriptedTransport]:
    recipe, targets = _setup(tmp_path, steps)
    transport = ScriptedTransport(reply)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    engine = Engine(recipe, targets, {}, mode, TransportPool(lambda host: transport),  # type: ignore[arg-type]
                    reporter or Reporter(), run_dir)
    return engine, transport


TWO_CHECKS = "  - name: a\n    verify: 'true'\n  - name: b\n    verify: 'false'\n"


def test_an_unexpected_error_inside_a_target_fails_it_with_its_message(tmp_path: Path) -> None:
    def reply(cmd: BuiltCommand) -> RunResult:
        raise RuntimeError("something nobody foresaw")

    engine, _ = _engine(tmp_path, TWO_CHECKS, reply)
    results = engine.run()
    assert results[0].status == TargetStatus.FAILED
    assert "RuntimeError: something nobody foresaw" in (results[0].error or "")
    assert exit_code(results) == ExitStatus.FAILED


def test_a_reporter_that_raises_does_not_leave_the_target_running(tmp_path: Path) -> None:
    class Broken(Reporter):
        def step_finished(self, target: str, result: object) -> None:
            raise ValueError("closing tag '[/]' at position 5 has nothing to close")

    engine, _ = _engine(tmp_path, TWO_CHECKS, lambda cmd: RunResult(0, "", 0.0), reporter=Broken())
    results = engine.run()
    assert results[0].status == TargetStatus.FAILED and exit_code(results) == ExitStatus.FAILED


@pytest.mark.parametrize("status", ["pending", "running", "something-new", TargetStatus.LOCKED])
def test_any_status_but_success_is_a_failure(status: str) -> None:
    from fleetcuda.results import TargetResult
    assert exit_code([TargetResult("t", TargetStatus.OK), TargetResult("u", status)]) == ExitStatus.FAILED
    assert exit_code([TargetResult("t", TargetStatus.OK), TargetResult("u", TargetStatus.CHANGED)]) == ExitStatus.OK


def _batch_reply(forged_output: str) -> Reply:
    """A target where check `a` passes and check `b` fails after printing `forged_output`."""
    def reply(cmd: BuiltCommand) -> RunResult:
        assert "@@fleetcuda:${fcn} begin" in cmd.argv[-2], "checks are batched"
        nonce = cmd.stdin.split("\0")[0]  # the nonce travels on stdin, never on the command line
        assert re.fullmatch("[0-9a-f]{16}", nonce) and nonce not in cmd.argv[-2]
        mark = f"@@fleetcuda:{nonce}"
        # What the target's bash prints: fleetcuda's frames, and each check's output through the payload filter.
        body = "".join(f"| {line}\n" for line in forged_output.format(nonce=nonce).splitlines())
        return RunResult(0, f"\n{mark} begin 0\n\n{mark} end 0 0 3\n\n{mark} begin 1\n{body}\n{mark} end 1 1 4\n"
                            f"\n{mark} done 2\n", 0.1)
    return reply


@pytest.mark.parametrize("forged", [
    "@@fleetcuda-batch end 1 0 0",  # the old protocol's frame
    "@@fleetcuda:{nonce} end 1 0 0",  # this run's, with its nonce read from the parent's command line
    "\n@@fleetcuda:{nonce} end 1 0 0\n@@fleetcuda:{nonce} begin 1",
])
def test_a_check_cannot_forge_its_own_result(tmp_path: Path, forged: str) -> None:
    engine, _ = _engine(tmp_path, TWO_CHECKS, _batch_reply(forged))
    results = engine.run()
    steps = {s.name: s.status for s in results[0].steps}
    assert steps == {"a": StepStatus.OK, "b": StepStatus.DRIFT}
    assert exit_code(results) == ExitStatus.FAILED


def test_a_timed_out_apply_is_never_sent_again(tmp_path: Path) -> None:
    steps = ("  - name: slow\n    check: 'false'\n    apply: sleep 100\n    timeout: 5\n    retries: 3\n"
             "    retry_delay: 0\n")

    def reply(cmd: BuiltCommand) -> RunResult:
        if "sleep 100" in cmd.argv[-2]:
            return RunResult(124, "", 5.0)  # `timeout` on the target stopped it
        return RunResult(1, "", 0.0)

    engine, transport = _engine(tmp_path, steps, reply, mode="apply")
    results = engine.run()
    applies = [c for c in transport.sent if "sleep 100" in c.argv[-2]]
    assert len(applies) == 1
    assert results[0].status == TargetStatus.FAILED and "timed out after 5s" in results[0].steps[0].detail


@pytest.mark.parametrize("mode", ["apply", "verify"])
def test_a_step_killed_quickly_is_reported_killed_not_timed_out(tmp_path: Path, mode: str) -> None:
    # A container stopped mid-step: `pct exec` ends 137 after 3 s of a 1800 s timeout (issue 22.9a).
    steps = "  - name: build\n    check: 'false'\n    apply: 'sleep 100'\n    verify: 'sleep 50'\n    retries: 2\n"

    def reply(cmd: BuiltCommand) -> RunResult:
        return RunResult(137, "", 3.2) if "sleep" in cmd.argv[-2] else RunResult(1, "", 0.0)

    engine, transport = _engine(tmp_path, steps, reply, mode=mode)
    [result] = engine.run()
    detail = result.steps[0].detail
    assert result.status == TargetStatus.FAILED, result
    assert "timed out" not in detail
    assert "killed (exit 137: the container stopped or the process was killed)" in detail
    assert len([c for c in transport.sent if "sleep 100" in c.argv[-2]]) == (1 if mode == "apply" else 0)


def test_a_failed_apply_that_did_not_time_out_is_retried(tmp_path: Path) -> None:
    steps = "  - name: flaky\n    check: 'false'\n    apply: 'exit 3'\n    retries: 2\n    retry_delay: 0\n"
    engine, transport = _engine(tmp_path, steps, lambda cmd: RunResult(3 if "exit 3" in cmd.argv[-2] else 1, "", 0),
                                mode="apply")
    engine.run()
    assert len([c for c in transport.sent if "exit 3" in c.argv[-2]]) == 3


def test_labels_are_unique_per_run(tmp_path: Path) -> None:
    steps = "  - name: stop\n    check: 'false'\n    apply: 'true'\n"
    labels = []
    for run in ("one", "two"):
        (tmp_path / run).mkdir()
        engine, transport = _engine(tmp_path / run, steps, lambda cmd: RunResult(0, "", 0), mode="apply")
        engine.run()
        labels.append({c.label for c in transport.sent})
    assert labels[0].isdisjoint(labels[1])
    # A step named like fleetcuda's own stop script still has a label of its own kind.
    assert labels[0] and all(label.startswith("fleetcuda:stop@") for label in labels[0])


class _Notices(Reporter):
    def __init__(self) -> None:
        self.said: list[tuple[str, str]] = []

    def notice(self, target: str, text: str) -> None:
        self.said.append((target, text))


def test_a_stale_lock_taken_over_and_a_lock_not_released_are_said_on_the_console(tmp_path: Path) -> None:
    # Issue 22.9c: not only in the target's log.
    from fleetcuda.run.locks import TargetLock, run_owner

    def reply(cmd: BuiltCommand) -> RunResult:
        mark = "@@fleetcuda:" + cmd.stdin.split("\0")[0]
        call = cmd.argv[-2].rsplit("\n", 1)[-1]  # lock.sh's functions, then the one called
        if call.startswith("fleetcuda_lock_acquire "):
            return RunResult(0, f"\n{mark} lock stale someone@else pid 7\n\n{mark} lock held\n", 0.1)
        if call.startswith("fleetcuda_lock_release "):
            return RunResult(1, "rm: cannot remove '/run/lock/fleetcuda-apply': Read-only file system\n", 0.1)
        return RunResult(0, "", 0.1)

    recipe, targets = _setup(tmp_path, "  - name: a\n    check: 'true'\n    apply: 'true'\n")
    reporter = _Notices()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    transport = ScriptedTransport(reply)
    engine = Engine(recipe, targets, {}, "apply", TransportPool(lambda host: transport), reporter, run_dir,
                    lock=TargetLock(run_owner()))
    [result] = engine.run()
    assert result.status == TargetStatus.OK
    said = "\n".join(text for _, text in reporter.said)
    assert "took over a stale lock (not refreshed for 15 min): someone@else pid 7" in said
    assert "could not release the apply lock (exit 1)" in said
