"""Every command through `fleetcuda.cli.main(argv, env)` in this process: an Environment of StringIO streams,
a mapping of variables, a temporary state directory and a fixed clock; real bash on a local host.

What is asserted is what a user reads: the exit status, what went to stdout and what to stderr (usage errors
and bad input exit 2, naming file:line: field), and that what a run keeps lands in the environment's state
directory, never in the process's.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from fleetcuda.cli import Environment, main
from fleetcuda.cli.environment import state_dir_of
from fleetcuda.results import ExitStatus

FIXED = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)


def fixed_clock() -> datetime:
    return FIXED


@dataclass
class Outcome:
    code: int
    out: str
    err: str


@dataclass
class Cli:
    """main() with a fresh Environment per call: its streams, variables, home, cwd and state directory."""

    tmp: Path
    state: Path
    environ: dict[str, str]
    clock: Callable[[], datetime] = fixed_clock
    stdout_is_terminal: bool = False

    def __call__(self, *argv: str | Path, stdin: str = "") -> Outcome:
        out, err = io.StringIO(), io.StringIO()
        env = Environment.with_streams(out, err, io.StringIO(stdin), environ=self.environ, home=self.tmp / "home",
                                       cwd=self.tmp, state_dir=self.state, stdout_is_terminal=self.stdout_is_terminal,
                                       clock=self.clock)
        try:
            code = main([str(a) for a in argv], env)
        except SystemExit as exc:  # argparse: --help, --version, a usage error
            code = int(exc.code or 0)
        return Outcome(code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cli:
    # The process's own state directory is elsewhere: whatever lands there was not the environment's.
    monkeypatch.setenv("FLEETCUDA_STATE_DIR", str(tmp_path / "process-state"))
    monkeypatch.setenv("FLEETCUDA_CACHE_DIR", str(tmp_path / "cache"))  # engine internals read the process's
    monkeypatch.delenv("FLEETCUDA_INVENTORY", raising=False)
    (tmp_path / "home").mkdir()
    environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "COLUMNS": "200"}
    return Cli(tmp_path, tmp_path / "state", environ)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def local(tmp_path: Path) -> Path:
    return write(tmp_path / "local.yaml", "hosts:\n  h:\n    kind: local\n")


@pytest.fixture
def bad_recipe(tmp_path: Path) -> Path:
    return write(tmp_path / "bad.yaml", "name: r\nsteps:\n  - name: s\n    timeout: x\n")


@pytest.fixture
def bad_inventory(tmp_path: Path) -> Path:
    return write(tmp_path / "badinv.yaml", "hosts:\n  a:\n    port: true\n")


def converge_recipe(tmp_path: Path) -> Path:
    """A step that is not satisfied until apply makes its file."""
    made = tmp_path / "made"
    return write(tmp_path / "converge.yaml", f"name: converge\nsteps:\n  - name: touch\n    check: test -e {made}\n"
                                             f"    apply: touch {made}\n    verify: test -e {made}\n")


# -- usage and bad input: exit 2 --------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "says"), [
    ([], "the following arguments are required: command"),
    (["bogus"], "argument command: invalid choice: 'bogus'"),
    (["apply"], "the following arguments are required: recipe"),
    (["apply", "r.yaml", "--dry-run", "--check"], "argument --check: not allowed with argument --dry-run"),
    (["verify", "r.yaml", "--format", "xml"], "argument --format: invalid choice: 'xml'"),
    (["history", "--runs", "many"], "argument --runs: invalid int value: 'many'"),
    (["schedule", "sometimes"], "argument action: invalid choice: 'sometimes'"),
    (["cache"], "the following arguments are required: cache_action"),
    (["wheelhouse"], "the following arguments are required: wheelhouse_command"),
    (["wheelhouse", "push"], "the following arguments are required: dir"),
    (["doctor", "--format", "xml"], "argument --format: invalid choice: 'xml'"),
    (["trust"], "the following arguments are required: HOST"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_usage_error_is_exit_2_with_usage_on_stderr(cli: Cli, argv: list[str], says: str) -> None:
    got = cli(*argv)
    assert got.code == ExitStatus.INPUT
    assert got.out == ""
    assert got.err.startswith("usage: fleetcuda") and f"fleetcuda: error: {says}" in got.err


def test_help_and_version_go_to_the_environments_stdout(cli: Cli) -> None:
    top = cli("--help")
    assert top.code == 0 and top.err == ""
    assert top.out.startswith("usage: fleetcuda") and "apply" in top.out and "wheelhouse" in top.out
    sub = cli("wheelhouse", "push", "--help")
    assert sub.code == 0 and "/var/cache/fleetcuda/wheelhouse" in sub.out
    version = cli("--version")
    assert version.code == 0 and version.out == "fleetcuda 0.1.0\n"


def test_an_inventory_default_comes_from_the_environments_variables(cli: Cli, bad_inventory: Path) -> None:
    cli.environ["FLEETCUDA_INVENTORY"] = str(bad_inventory)
    got = cli("doctor")
    assert got.code == ExitStatus.INPUT
    assert got.err == f"fleetcuda: {bad_inventory}:3: hosts.a.port: Input should be a valid integer (got True)\n"


def test_bad_files_are_exit_2_naming_file_line_and_field(cli: Cli, local: Path, bad_recipe: Path,
                                                          bad_inventory: Path, tmp_path: Path) -> None:
    recipe_says = f"fleetcuda: {bad_recipe}:4: steps[0].timeout: Input should be a valid integer (got 'x')\n"
    inventory_says = f"fleetcuda: {bad_inventory}:3: hosts.a.port: Input should be a valid integer (got True)\n"
    good = converge_recipe(tmp_path)
    cases = {
        ("apply", bad_recipe, "-i", local): recipe_says,
        ("apply", bad_recipe, "-i", local, "--dry-run"): recipe_says,
        ("apply", good, "-i", bad_inventory, "--check"): inventory_says,
        ("verify", bad_recipe, "-i", local): recipe_says,
        ("verify", good, "-i", bad_inventory): inventory_says,
        ("doctor", "-i", bad_inventory): inventory_says,
        ("wheelhouse", "build", bad_recipe, tmp_path / "wheels"): recipe_says,
        ("wheelhouse", "push", tmp_path, "-i", bad_inventory): inventory_says,
        ("schedule", "install", bad_recipe, "-i", local): recipe_says,
        ("schedule", "install", good, "-i", bad_inventory): inventory_says,
    }
    for argv, says in cases.items():
        got = cli(*argv)
        assert (got.code, got.out, got.err) == (ExitStatus.INPUT, "", says), argv
    assert not (tmp_path / "made").exists() and not cli.state.exists()  # nothing ran, nothing was kept


@pytest.mark.parametrize(("argv", "says"), [
    (["--forks", "0"], "fleetcuda: --forks: must be at least 1\n"),
    (["--limit", " , "], "fleetcuda: --limit: ' , ': is empty: name hosts, groups, containers or globs\n"),
    (["--limit", "nowhere"], None),
    (["--var", "novalue"], None),
    (["--report", "yaml=x"], "fleetcuda: --report: yaml=x: expected FORMAT=PATH with FORMAT json, junit or "
                             "prometheus\n"),
    (["--output", "x.json"], "fleetcuda: --output: needs --format json, junit or prometheus\n"),
])
def test_bad_arguments_of_a_run_are_exit_2_before_anything_runs(cli: Cli, local: Path, tmp_path: Path,
                                                                 argv: list[str], says: str | None) -> None:
    got = cli("verify", converge_recipe(tmp_path), "-i", local, *argv)
    assert got.code == ExitStatus.INPUT and got.out == ""
    if says:
        assert got.err == says
    else:  # the loader's own words: one line
        assert got.err.startswith("fleetcuda: ") and got.err.count("\n") == 1
    assert not cli.state.exists()


def test_a_state_directory_that_is_a_file_is_bad_input_named_as_the_user_set_it(cli: Cli, local: Path,
                                                                                  tmp_path: Path) -> None:
    cli.state = write(tmp_path / "statefile", "")
    cli.environ["FLEETCUDA_STATE_DIR"] = str(cli.state)
    for argv in (["history"], ["verify", converge_recipe(tmp_path), "-i", local]):
        got = cli(*argv)
        assert got.code == ExitStatus.INPUT
        assert got.err == f"fleetcuda: FLEETCUDA_STATE_DIR: {cli.state} is not a directory; name a directory\n"


def test_cache_prune_refuses_a_negative_age(cli: Cli) -> None:
    got = cli("cache", "prune", "--older-than", "-1")
    assert (got.code, got.err) == (ExitStatus.INPUT, "fleetcuda: --older-than: -1.0: must be 0 or more days\n")


def test_trust_refuses_a_host_that_is_not_an_ssh_host(cli: Cli, local: Path) -> None:
    got = cli("trust", "h", "-i", local)
    assert (got.code, got.err) == (ExitStatus.INPUT, f"fleetcuda: {local}: hosts: 'h' is not an ssh host of this "
                                                     "inventory\n")


# -- runs on a local host ----------------------------------------------------------------------------------------


def test_apply_converges_then_finds_nothing_to_do(cli: Cli, local: Path, tmp_path: Path) -> None:
    recipe = converge_recipe(tmp_path)
    check = cli("apply", recipe, "-i", local, "--check", "--plain")
    assert check.code == ExitStatus.OK and "h done: would-change" in check.out
    assert not (tmp_path / "made").exists()  # --check changes nothing
    first = cli("apply", recipe, "-i", local, "--plain")
    assert first.code == ExitStatus.OK and "h done: changed" in first.out and (tmp_path / "made").exists()
    again = cli("apply", recipe, "-i", local, "--plain")
    assert again.code == ExitStatus.OK and "h done: ok" in again.out
    assert f"logs: {cli.state / 'runs'}" in again.out
    assert len(list((cli.state / "runs").iterdir())) == 3
    assert not (tmp_path / "process-state").exists()


def test_check_previews_a_fresh_target_and_says_would_change_in_its_exit_code_when_asked(cli: Cli, local: Path,
                                                                                       tmp_path: Path) -> None:
    made = tmp_path / "made"
    recipe = write(tmp_path / "fresh.yaml", f"""name: fresh
steps:
  - name: venv
    check: test -e {made}
    apply: touch {made}
  - name: venv-sane
    verify: test -e {made}
""")
    check = cli("apply", recipe, "-i", local, "--check", "--plain")
    assert check.code == ExitStatus.OK, check.out + check.err
    assert "h venv-sane: unknown (depends on venv, which would change, " in check.out
    assert f"h: step venv would change: shell: check `test -e {made}`; apply `touch {made}`\n" in check.out
    assert "h: step venv-sane unknown: depends on venv, which would change" in check.out
    assert "h done: would-change" in check.out and not made.exists()
    detailed = cli("apply", recipe, "-i", local, "--check", "--plain", "--detailed-exitcode")
    assert detailed.code == ExitStatus.WOULD_CHANGE == 4 and not made.exists()
    assert cli("apply", recipe, "-i", local, "--plain").code == ExitStatus.OK and made.exists()
    assert cli("apply", recipe, "-i", local, "--check", "--plain", "--detailed-exitcode").code == ExitStatus.OK
    for wrong in (["--dry-run"], []):
        refused = cli("apply", recipe, "-i", local, *wrong, "--detailed-exitcode")
        assert refused.code == ExitStatus.INPUT and "--detailed-exitcode: only goes with --check" in refused.err


def test_a_dry_run_prints_the_commands_and_runs_none(cli: Cli, local: Path, tmp_path: Path) -> None:
    got = cli("apply", converge_recipe(tmp_path), "-i", local, "--dry-run", "--format", "shell")
    assert got.code == ExitStatus.OK and got.err == ""
    assert got.out.startswith(f"# fleetcuda apply {tmp_path / 'converge.yaml'} --dry-run: 1 target(s) from {local}")
    assert "# step 1/1 touch (shell): check (exit 0 means already satisfied)" in got.out
    assert f"touch {tmp_path / 'made'}" in got.out
    assert not (tmp_path / "made").exists() and not cli.state.exists()


def test_verify_reports_ok_and_drift_and_records_both_in_the_environments_history(cli: Cli, local: Path,
                                                                                   tmp_path: Path) -> None:
    recipe = converge_recipe(tmp_path)
    drift = cli("verify", recipe, "-i", local, "--plain")
    assert drift.code == ExitStatus.FAILED and "h touch: drift" in drift.out
    (tmp_path / "made").touch()
    ok = cli("verify", recipe, "-i", local, "--format", "json", "--plain")
    assert ok.code == ExitStatus.OK
    report = json.loads(ok.out)  # stdout holds the report alone: progress went to stderr
    assert report["exit_code"] == 0 and report["started_at"] == "2031-05-06T07:08:09Z"
    assert "h done: ok" in ok.err
    with sqlite3.connect(cli.state / "history.sqlite") as db:
        assert db.execute("SELECT exit_code FROM runs ORDER BY id").fetchall() == [(1,), (0,)]
    assert not (tmp_path / "process-state").exists()


def test_verify_on_a_terminal_draws_the_live_view(cli: Cli, local: Path, tmp_path: Path) -> None:
    (tmp_path / "made").touch()
    cli.stdout_is_terminal = True
    got = cli("verify", converge_recipe(tmp_path), "-i", local, "--no-history")
    assert got.code == ExitStatus.OK
    assert "\x1b[" in got.out  # rich drew to the StringIO as to a terminal
    assert " done: ok" not in got.out  # no plain lines
    assert not (cli.state / "history.sqlite").exists()


def test_an_interrupted_apply_stops_its_step_and_exits_130(cli: Cli, local: Path, tmp_path: Path) -> None:
    started = tmp_path / "started"
    recipe = write(tmp_path / "slow.yaml", f"name: slow\nsteps:\n  - name: wait\n    check: 'false'\n"
                                           f"    apply: touch {started}; sleep 60\n    timeout: 120\n")

    def interrupt_once_started() -> None:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # the handler execute() set, in the main thread

    before = signal.getsignal(signal.SIGINT)
    killer = threading.Thread(target=interrupt_once_started)
    killer.start()
    began = time.monotonic()
    got = cli("apply", recipe, "-i", local, "--plain")
    killer.join()
    assert got.code == ExitStatus.INTERRUPTED
    assert time.monotonic() - began < 45  # the sleep was stopped, not waited for
    assert "h done: interrupted" in got.out and "what had run, and what was stopped on each target" in got.out
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored for whatever runs next


def test_a_host_that_cannot_be_reached_is_exit_3(cli: Cli, tmp_path: Path) -> None:
    known_hosts = write(tmp_path / "known_hosts", "")
    closed = write(tmp_path / "far.yaml", "hosts:\n  far:\n    address: 127.0.0.1\n    port: 1\n    user: root\n"
                                          f"    known_hosts: {known_hosts}\n")
    got = cli("verify", converge_recipe(tmp_path), "-i", closed, "--plain", "--no-history")
    assert got.code == ExitStatus.UNREACHABLE
    assert "far done: unreachable: root@[127.0.0.1]:1: cannot connect" in got.out


# -- history and schedule: reading --------------------------------------------------------------------------------


def test_history_lists_the_runs_of_the_environments_state_directory(cli: Cli, local: Path, tmp_path: Path) -> None:
    empty = cli("history")
    assert (empty.code, empty.out) == (ExitStatus.OK, f"no runs recorded in {cli.state / 'history.sqlite'}\n")
    recipe = converge_recipe(tmp_path)
    cli("verify", recipe, "-i", local, "--plain")
    (tmp_path / "made").touch()
    cli("verify", recipe, "-i", local, "--plain")
    table = cli("history")
    assert table.code == ExitStatus.OK
    # The table's title names the database; rich wraps a long title, so compare without the wrapping.
    assert f"recentruns({cli.state / 'history.sqlite'})" in "".join(table.out.split())
    assert "converge" in table.out and "fixed" in table.out  # drift, then ok: the check was fixed
    listed = cli("history", "--format", "json", "--runs", "1")
    assert listed.code == ExitStatus.OK
    data = json.loads(listed.out)
    assert [r["exit_code"] for r in data["runs"]] == [0]
    assert [c["kind"] for c in data["changes"] if c["step"] == "touch"] == ["fixed"]
    assert cli("history", "--limit", "nobody", "--format", "json").out.count('"target"') == 0


def test_history_of_a_damaged_database_fails_with_what_to_do(cli: Cli) -> None:
    cli.state.mkdir()
    (cli.state / "history.sqlite").write_bytes(b"\0garbage" * 300)
    got = cli("history")
    assert got.code == ExitStatus.FAILED and "is damaged" in got.err and "move it aside" in got.err


@pytest.fixture
def crontab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `crontab` on PATH that keeps its table in a file (crontab runs as a subprocess of this process)."""
    table, bindir = tmp_path / "crontab.txt", tmp_path / "bin"
    bindir.mkdir()
    write(bindir / "crontab", f"#!/bin/sh\ncase \"$1\" in\n  -l) cat {table} 2>/dev/null || "
                              "{ echo 'no crontab for x' >&2; exit 1; } ;;\n"
                              f"  -) cat > {table} ;;\nesac\n").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return table


def test_schedule_installs_shows_and_removes_a_cron_job(cli: Cli, local: Path, tmp_path: Path, crontab: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # files named on the command line are opened by the process, from its cwd
    none = cli("schedule", "show")
    assert (none.code, none.out) == (ExitStatus.FAILED, "no fleetcuda verify job named 'nightly' is installed\n")
    converge_recipe(tmp_path)
    installed = cli("schedule", "install", "converge.yaml", "-i", "local.yaml")
    assert installed.code == ExitStatus.OK and installed.out.startswith("installed: 0 3 * * * ")
    line = crontab.read_text().strip()
    assert f"verify {tmp_path / 'converge.yaml'} -i {tmp_path / 'local.yaml'} --plain" in line  # made absolute
    assert f"cd {tmp_path} " in line and str(cli.state / "reports" / "nightly.json") in line
    assert (cli.state / "crontab.lock").exists()  # the lock is the environment's
    shown = cli("schedule", "show")
    assert (shown.code, shown.out) == (ExitStatus.OK, line + "\n")
    removed = cli("schedule", "remove")
    assert (removed.code, removed.out) == (ExitStatus.OK, "removed 'nightly'\n")
    assert cli("schedule", "show").code == ExitStatus.FAILED


def test_schedule_shows_systemd_units(cli: Cli, local: Path, tmp_path: Path) -> None:
    units = tmp_path / "units"
    units.mkdir()
    installed = cli("schedule", "install", converge_recipe(tmp_path), "-i", local, "--systemd", "--unit-dir", units)
    assert installed.code == ExitStatus.OK and installed.out.startswith("wrote: ")
    shown = cli("schedule", "show", "--systemd", "--unit-dir", units)
    assert shown.code == ExitStatus.OK
    assert f"# {units / 'fleetcuda-verify-nightly.timer'}" in shown.out and "OnCalendar=" in shown.out
    assert f"WorkingDirectory={tmp_path}" in shown.out


def test_a_bad_schedule_is_exit_2(cli: Cli) -> None:
    got = cli("schedule", "remove", "--name", "a b")
    assert got.code == ExitStatus.INPUT and got.err.startswith("fleetcuda: schedule: job name 'a b':")


def test_cache_list_of_an_empty_cache(cli: Cli) -> None:
    got = cli("cache", "list", "--format", "json")
    assert got.code == ExitStatus.OK and json.loads(got.out)["entries"] == []


# -- the environment -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variables", [{"FLEETCUDA_STATE_DIR": "/srv/fc"}, {"XDG_STATE_HOME": "/x/state"}, {}])
def test_the_environments_state_directory_is_the_engines(monkeypatch: pytest.MonkeyPatch,
                                                         variables: dict[str, str]) -> None:
    from fleetcuda.run.engine import state_dir

    for name in ("FLEETCUDA_STATE_DIR", "XDG_STATE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert Environment.from_process().state_dir == state_dir() == state_dir_of(os.environ, Path.home())


def test_the_environment_is_frozen(tmp_path: Path) -> None:
    env = Environment.with_streams(io.StringIO(), io.StringIO(), io.StringIO(), environ={}, home=tmp_path,
                                   cwd=tmp_path)
    with pytest.raises(AttributeError):
        env.state_dir = tmp_path  # type: ignore[misc]
    assert env.state_dir == tmp_path / ".local" / "state" / "fleetcuda"


def test_format_is_for_dry_runs_and_each_format_is_what_it_says(cli: Cli, local: Path, tmp_path: Path) -> None:
    recipe = converge_recipe(tmp_path)
    refused = cli("apply", recipe, "-i", local, "--format", "json")
    assert refused.code == ExitStatus.INPUT and "--format" in refused.err and "only goes with --dry-run" in refused.err
    assert not (tmp_path / "made").exists()
    doc = json.loads(cli("apply", recipe, "-i", local, "--dry-run", "--format", "json").out)
    assert doc["schema"] == "fleetcuda.plan/1" and [s["name"] for s in doc["targets"][0]["steps"]] == ["touch"]
    human = cli("apply", recipe, "-i", local, "--dry-run").out
    made = tmp_path / "made"
    assert f"  1 touch: shell: check `test -e {made}`; apply `touch {made}`; verify `test -e {made}`\n" in \
        human.replace("\n      ", " ")
    assert max(len(line) for line in human.splitlines()) <= 120
    full = cli("apply", recipe, "-i", local, "--dry-run", "--verbose").out
    assert "step 1/1 touch (shell)" in full and max(len(line) for line in full.splitlines()) <= 160
    for wrong in (["--format", "json"], ["--format", "shell"], []):
        refused = cli("apply", recipe, "-i", local, *wrong, "--verbose", *(["--dry-run"] if wrong else []))
        assert refused.code == ExitStatus.INPUT and "--verbose: only goes with --dry-run's human format" in refused.err
    assert not (tmp_path / "made").exists()
