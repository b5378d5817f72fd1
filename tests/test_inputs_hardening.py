"""Bad input the loaders and the CLI used to answer with a traceback, a hang, or silence: now exit 2 (or the
documented code) with a message naming the file, line and field, or the option.

Each test runs the real CLI (a subprocess, as a user runs it) or calls the function the CLI uses, and asserts
what a user sees: the exit code and the message.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fleetcuda.errors import InputError
from fleetcuda.plan.recipe import check_fact_value, parse_var_overrides
from fleetcuda.plan.templating import TemplateError
from fleetcuda.run.schedule import install_cron, show_cron
from fleetcuda.run.wheelcache import CacheEntry, WheelCache
from tests.conftest import REPO

LOCAL_INVENTORY = "hosts:\n  here:\n    kind: local\n"
TRUE_RECIPE = "name: r\nsteps:\n  - name: s\n    check: 'true'\n"


def write(tmp: Path, name: str, text: str | bytes) -> Path:
    path = tmp / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def cli(tmp: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 60,
        ) -> subprocess.CompletedProcess[str]:
    """The real CLI, as tests.conftest.run_fleetcuda runs it, with extra environment; output bytes that are not
    UTF-8 (a path from non-UTF-8 argv) are read back as backslash escapes."""
    full = {**os.environ, "FLEETCUDA_STATE_DIR": str(tmp / "state"), "FLEETCUDA_CACHE_DIR": str(tmp / "cache"),
            "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "fleetcuda", *args], capture_output=True, text=True, env=full,
                          cwd=REPO, timeout=timeout, errors="backslashreplace")


def assert_input_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------------- NUL, surrogates

@pytest.mark.parametrize(("step", "line", "field"), [
    ("    check: 'true'\n    env:\n      A: \"x\\0y\"\n", 6, "steps[0].env.A"),
    ("    check: \"true\\0\"\n", 4, "steps[0].check"),
    ("    check: 'true'\n    satisfied_if: \"test -e /x\\0\"\n", 5, "steps[0].satisfied_if"),
    ("    check: 'true'\n    apply: \"\\0\"\n", 5, "steps[0].apply"),
])
@pytest.mark.parametrize("command", ["apply --dry-run", "verify"])
def test_a_nul_in_a_step_is_refused_at_load(tmp_path: Path, step: str, line: int, field: str, command: str) -> None:
    recipe = write(tmp_path, "r.yaml", "name: r\nsteps:\n  - name: s\n" + step)
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY)
    verb, *rest = command.split()
    proc = cli(tmp_path, verb, str(recipe), "-i", str(inv), *rest)
    assert_input_error(proc, f"{recipe}:{line}: {field}: ", "NUL")


@pytest.mark.parametrize(("text", "line", "field"), [
    ("name: r\ndescription: \"\\ud800\"\nsteps:\n  - name: s\n    check: 'true'\n", 2, "description"),
    (TRUE_RECIPE + "    env:\n      A: \"ok \\udfff\"\n", 6, "steps[0].env.A"),
    ("name: r\nvars:\n  \"x\\ud800\": 1\nsteps:\n  - name: s\n    check: 'true'\n", 3, "vars.'x\\ud800'"),
    ("name: r\nsteps:\n  - name: s\n    check: ['true', \"\\ud83d\"]\n", 4, "steps[0].check[1]"),
])
def test_a_lone_surrogate_is_refused_at_load(tmp_path: Path, text: str, line: int, field: str) -> None:
    recipe = write(tmp_path, "r.yaml", text)
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY)
    proc = cli(tmp_path, "apply", str(recipe), "-i", str(inv), "--dry-run")
    assert_input_error(proc, f"{recipe}:{line}: {field}: ", "surrogate")


def test_a_lone_surrogate_in_an_inventory_is_refused(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE)
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY + "    vars:\n      greeting: \"hi \\udc80\"\n")
    proc = cli(tmp_path, "apply", str(recipe), "-i", str(inv), "--dry-run")
    assert_input_error(proc, f"{inv}:5: hosts.here.vars.greeting: ", "surrogate")


# ---------------------------------------------------------------------------------------------- special files

def test_an_inventory_that_is_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "inv.fifo"
    os.mkfifo(fifo)
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE)
    proc = cli(tmp_path, "apply", str(recipe), "-i", str(fifo), "--dry-run", timeout=30)
    assert_input_error(proc, f"fleetcuda: {fifo}: cannot read: a FIFO, not a regular file")


@pytest.mark.parametrize(("path", "what"), [("/dev/zero", "a character device"), ("/dev/null", "a character device"),
                                            ("/", "a directory")])
def test_an_inventory_that_is_a_device_or_directory_is_refused(tmp_path: Path, path: str, what: str) -> None:
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE)
    proc = cli(tmp_path, "apply", str(recipe), "-i", path, "--dry-run", timeout=30)
    assert_input_error(proc, f"fleetcuda: {path}: cannot read: {what}, not a regular file")


def test_a_recipe_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "r.fifo"
    os.mkfifo(fifo)
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY)
    proc = cli(tmp_path, "verify", str(fifo), "-i", str(inv), timeout=30)
    assert_input_error(proc, f"fleetcuda: {fifo}: cannot read: a FIFO")


def test_a_large_file_is_read_only_up_to_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetcuda.plan import yamlsrc

    big = write(tmp_path, "big.yaml", b"#" * 5000)
    monkeypatch.setattr(yamlsrc, "MAX_FILE_BYTES", 100)
    assert len(yamlsrc.read_bounded(big, 100)) == 101
    with pytest.raises(InputError, match="file is larger than 100 bytes"):
        yamlsrc.load_yaml(big)


# ---------------------------------------------------------------------------------------------- report paths

@pytest.mark.parametrize(("how", "fragment"), [
    ("missing-dir", "does not exist"),
    ("is-dir", "is a directory"),
    ("parent-is-file", "is not a directory"),
    ("proc", "cannot write in /proc"),
    ("device", "is not a regular file"),
])
@pytest.mark.parametrize("option", ["--report", "--output"])
def test_report_paths_are_checked_before_the_run(tmp_path: Path, how: str, fragment: str, option: str) -> None:
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE)
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY)
    afile = write(tmp_path, "afile", "x")
    path = {"missing-dir": str(tmp_path / "nope" / "r.json"), "is-dir": str(tmp_path),
            "parent-is-file": str(afile / "r.json"), "proc": "/proc/fleetcuda-report.json",
            "device": "/dev/zero"}[how]
    args = ["--report", f"json={path}"] if option == "--report" else ["--format", "json", "--output", path]
    proc = cli(tmp_path, "verify", str(recipe), "-i", str(inv), *args)
    assert_input_error(proc, f"fleetcuda: {option}: ", fragment)
    assert proc.stdout == ""
    assert not (tmp_path / "state" / "runs").exists()  # refused before anything ran
    assert Path("/dev/zero").is_char_device()  # never replaced by a report


# ---------------------------------------------------------------------------------------------- damaged history

def test_a_damaged_history_does_not_stop_verify_and_history_says_so(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE)
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY)
    state = tmp_path / "state"
    state.mkdir()
    db = state / "history.sqlite"
    db.write_bytes(os.urandom(4096))
    report = tmp_path / "report.json"
    proc = cli(tmp_path, "verify", str(recipe), "-i", str(inv), "--plain", "--report", f"json={report}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"warning: the history file {db} is damaged" in proc.stderr
    assert "this run was not recorded in the history" in proc.stderr
    assert report.is_file()  # the run's report is still written
    for fmt in ("table", "json"):
        shown = cli(tmp_path, "history", "--format", fmt)
        assert shown.returncode == 1, shown.stdout + shown.stderr
        assert "Traceback" not in shown.stderr
        assert f"fleetcuda: the history file {db} is damaged" in shown.stderr
    # apply --dry-run and the other commands that do not use the history are unaffected.
    assert cli(tmp_path, "apply", str(recipe), "-i", str(inv), "--dry-run").returncode == 0


# ---------------------------------------------------------------------------------------------- state dir

@pytest.mark.parametrize("args", [
    ["verify", "{recipe}", "-i", "{inv}"],
    ["history"],
    ["schedule", "install", "{recipe}", "-i", "{inv}", "--name", "n"],
])
@pytest.mark.parametrize("how", ["file", "below-a-file"])
def test_a_state_dir_that_is_a_file_is_bad_input(tmp_path: Path, args: list[str], how: str) -> None:
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE)
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY)
    afile = write(tmp_path, "afile", "x")
    state = afile if how == "file" else afile / "state"
    argv = [a.format(recipe=recipe, inv=inv) for a in args]
    proc = cli(tmp_path, *argv, env={"FLEETCUDA_STATE_DIR": str(state), "PATH": "/nonexistent"})
    assert_input_error(proc, "fleetcuda: FLEETCUDA_STATE_DIR: ", "not a directory")


def test_apply_with_a_state_dir_that_is_a_file_is_bad_input(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE)
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY)
    afile = write(tmp_path, "afile", "x")
    proc = cli(tmp_path, "apply", str(recipe), "-i", str(inv), env={"FLEETCUDA_STATE_DIR": str(afile)})
    assert_input_error(proc, "FLEETCUDA_STATE_DIR", "not a directory")


# ---------------------------------------------------------------------------------------------- wheelhouse, schedule

@pytest.mark.parametrize("how", ["missing", "file"])
def test_wheelhouse_push_of_a_missing_directory(tmp_path: Path, how: str) -> None:
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY)
    where = tmp_path / "nope" if how == "missing" else write(tmp_path, "afile", "x")
    proc = cli(tmp_path, "wheelhouse", "push", str(where), "-i", str(inv), "--dest", str(tmp_path / "dest"))
    assert_input_error(proc, "fleetcuda: wheelhouse push: DIR: ",
                       "no such directory" if how == "missing" else "is not a directory")
    assert not (tmp_path / "dest").exists()


def test_wheelhouse_build_into_a_file(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE + "wheelhouse:\n  wheels: [x]\n")
    afile = write(tmp_path, "afile", "x")
    proc = cli(tmp_path, "wheelhouse", "build", str(recipe), str(afile))
    assert_input_error(proc, "wheelhouse build: DIR: ", "is not a directory")


@pytest.mark.parametrize("action", ["remove", "show"])
def test_schedule_systemd_unit_dir_that_is_a_file(tmp_path: Path, action: str) -> None:
    afile = write(tmp_path, "afile", "x")
    proc = cli(tmp_path, "schedule", action, "--systemd", "--unit-dir", str(afile))
    assert_input_error(proc, f"unit directory {afile} is not a directory")
    assert afile.read_text() == "x"


# ---------------------------------------------------------------------------------------------- --var

def test_var_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE)
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY)
    bad = os.fsdecode(b"x=\xff")  # what Python makes of the bytes: a lone surrogate (surrogateescape)
    for verb in (["apply", "--dry-run"], ["verify"]):
        proc = cli(tmp_path, verb[0], str(recipe), "-i", str(inv), "--var", bad, *verb[1:])
        assert_input_error(proc, "fleetcuda: --var: x=...: is not UTF-8 text")  # its name, never its value


@pytest.mark.parametrize("item", ["x\n=1", "x\r\n=1", "\nx=1", "x y=1", "=1", "x"])
def test_var_names_are_checked_to_the_very_end(tmp_path: Path, item: str) -> None:
    with pytest.raises(InputError) as info:
        parse_var_overrides([item])
    assert info.value.file == "--var" and "expected NAME=VALUE" in info.value.message
    assert "\n" not in str(info.value) and "\r" not in str(info.value)
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE)
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY)
    proc = cli(tmp_path, "apply", str(recipe), "-i", str(inv), "--var", item, "--dry-run")
    assert_input_error(proc, "fleetcuda: --var: ", "expected NAME=VALUE")


def test_a_fact_value_with_a_trailing_newline_is_refused() -> None:
    assert check_fact_value("cuda", "12.8") == "12.8"
    for value in ("12.8\n", "12.8\r", "\n12.8", "a b"):
        with pytest.raises(TemplateError, match="not a plain value"):
            check_fact_value("cuda", value)


# ---------------------------------------------------------------------------------------------- wrong types

@pytest.mark.parametrize(("field", "value"), [("port", "true"), ("port", "false"), ("port", "'22'"),
                                              ("connect_timeout", "true")])
def test_host_numbers_must_be_integers(tmp_path: Path, field: str, value: str) -> None:
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE)
    inv = write(tmp_path, "inv.yaml", f"hosts:\n  a:\n    address: h\n    {field}: {value}\n")
    proc = cli(tmp_path, "apply", str(recipe), "-i", str(inv), "--dry-run")
    assert_input_error(proc, f"fleetcuda: {inv}:4: hosts.a.{field}: ", "valid integer")
    assert "-p 1" not in proc.stdout


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("timeout", "true", "valid integer"), ("retries", "true", "valid integer"), ("timeout", "'60'", "valid integer"),
    ("retries", "false", "valid integer"), ("retry_delay", "true", "not true"),
])
def test_step_numbers_must_not_be_booleans(tmp_path: Path, field: str, value: str, fragment: str) -> None:
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE + f"    {field}: {value}\n")
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY)
    proc = cli(tmp_path, "apply", str(recipe), "-i", str(inv), "--dry-run")
    assert_input_error(proc, f"fleetcuda: {recipe}:5: steps[0].{field}: ", fragment)


def test_step_numbers_still_load(tmp_path: Path) -> None:
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE + "    timeout: 60\n    retries: 2\n    retry_delay: 0.5\n")
    inv = write(tmp_path, "inv.yaml", "hosts:\n  a:\n    address: h\n    port: 2222\n")
    proc = cli(tmp_path, "apply", str(recipe), "-i", str(inv), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "-p 2222" in proc.stdout and " 60 " in proc.stdout


# ---------------------------------------------------------------------------------------------- concurrency

FAKE_CRONTAB = """#!/bin/sh
# crontab(1) stand-in: -l prints the table (slowly, so that unserialized edits overlap), - replaces it.
store="{store}"
case "$1" in
  -l) if [ -f "$store" ]; then sleep 0.3; cat "$store"; else sleep 0.3; echo "no crontab for x" >&2; exit 1; fi ;;
  -) cat > "$store.tmp" && mv "$store.tmp" "$store" ;;
esac
"""


def test_concurrent_schedule_installs_keep_every_line(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    store = tmp_path / "crontab.txt"
    crontab = bindir / "crontab"
    crontab.write_text(FAKE_CRONTAB.format(store=store))
    crontab.chmod(0o755)
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE)
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY)
    env = {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin", "FLEETCUDA_STATE_DIR": str(tmp_path / "state")}
    names = [f"job{i}" for i in range(6)]
    procs = [subprocess.Popen([sys.executable, "-m", "fleetcuda", "schedule", "install", str(recipe), "-i", str(inv),
                               "--name", name, "--reports-dir", str(tmp_path / "reports")], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in names]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, out + err
    table = store.read_text()
    for name in names:
        assert table.count(f"# fleetcuda-verify:{name}\n") == 1, table


def test_install_cron_holds_the_lock(tmp_path: Path) -> None:
    """In-process: several threads installing different jobs through one slow crontab all keep their line."""
    crontab = tmp_path / "crontab"
    store = tmp_path / "crontab.txt"
    crontab.write_text(FAKE_CRONTAB.format(store=store).replace("sleep 0.3", "sleep 0.1"))
    crontab.chmod(0o755)
    lock = tmp_path / "state" / "crontab.lock"
    line = "0 3 * * * /usr/bin/true # fleetcuda-verify:{}"
    errors: list[BaseException] = []

    def install(i: int) -> None:
        try:
            install_cron(line.format(f"t{i}"), f"t{i}", crontab_cmd=str(crontab), lock_path=lock)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=install, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for i in range(5):
        assert show_cron(f"t{i}", crontab_cmd=str(crontab)) == line.format(f"t{i}")


FP = {"package": "causal-conv1d", "version": "1.7.0", "python": "3.11", "abi": "cpython-311-x86_64-linux-gnu",
      "platform": "linux-x86_64", "glibc": "2.36", "torch": "2.11.0+cu128", "torch_cuda": "12.8", "cxx11_abi": "1",
      "nvcc": "12.8", "archs": "upstream"}


def test_a_replaced_cache_entry_is_never_missing(tmp_path: Path) -> None:
    cache = WheelCache(tmp_path / "cache")
    wheel_name = "causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl"

    def store(i: int) -> None:
        src = tmp_path / f"in{i}" / wheel_name
        src.parent.mkdir()
        src.write_bytes(os.urandom(64 * 1024) + str(i).encode())
        cache.store(src, FP, {"built_on": f"t{i}"})

    store(0)
    seen: list[object] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.append(cache.lookup(FP))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        for i in range(1, 150):
            store(i)
            if time.monotonic() > deadline:
                break
    finally:
        stop.set()
        thread.join(30)
    assert len(seen) > 100
    bad = [s for s in seen if not isinstance(s, CacheEntry)]
    assert not bad, f"{len(bad)} of {len(seen)} lookups saw no usable entry: {bad[:3]}"
    assert not list((tmp_path / "cache").glob("*/.*"))  # no staging or old entries left behind


# ---------------------------------------------------------------------------------------------- found by the fuzz

def test_history_runs_beyond_sqlite_integers_lists_all(tmp_path: Path) -> None:
    """Found by the argv fuzz: `history --runs 99999999999999999999` was an OverflowError once a run was recorded."""
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE)
    inv = write(tmp_path, "inv.yaml", LOCAL_INVENTORY)
    assert cli(tmp_path, "verify", str(recipe), "-i", str(inv), "--plain").returncode == 0
    for runs in ("99999999999999999999", "9223372036854775808", "-5"):
        proc = cli(tmp_path, "history", "--runs", runs, "--format", "json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
        assert proc.stdout.count('"recipe_name": "r"') == (0 if runs == "-5" else 1)


def test_a_run_from_a_non_utf8_path_is_recorded(tmp_path: Path) -> None:
    """A recipe path from non-UTF-8 argv bytes (surrogateescape) could not be stored in SQLite."""
    from datetime import UTC, datetime

    from fleetcuda.reports.formats import RunInfo
    from fleetcuda.reports.history import record
    from fleetcuda.run.engine import StepResult, TargetResult

    now = datetime.now(UTC)
    info = RunInfo(mode="verify", recipe_path=os.fsdecode(b"/srv/r\xff.yaml"), recipe_name="r",
                   inventory_path="inv.yaml", started_at=now, finished_at=now, exit_code=0, run_dir=None)
    warnings: list[str] = []
    results = [TargetResult("here", "ok", [StepResult("s", "ok", 0.1, "verified", found=os.fsdecode(b"v\xfe"))],
                            None, os.fsdecode(b"/logs/\xff.log"), 0.2)]
    assert isinstance(record(tmp_path / "state" / "history.sqlite", info, results, on_error=warnings.append), int)
    assert warnings == []
    shown = cli(tmp_path, "history", "--format", "json")
    assert shown.returncode == 0, shown.stderr
    assert "/srv/r\\\\udcff.yaml" in shown.stdout, shown.stdout


def test_two_runs_in_one_second_get_their_own_run_directories(tmp_path: Path) -> None:
    from fleetcuda.run.engine import make_run_dir

    first = make_run_dir("verify", "r", root=tmp_path)
    second = make_run_dir("verify", "r", root=tmp_path)
    assert first != second and first.is_dir() and second.is_dir()


@pytest.mark.parametrize(("text", "line", "field"), [
    ("hosts:\n  h0:\n    kind: local\n    containers:\n      ? ''\n      : {}\n", 5, "hosts.h0.containers.''.vmid"),
    ("hosts:\n  h0:\n    address: h\n    containers:\n      2.5: {}\n", 4, "hosts.h0.containers.'2.5'"),
    (".nangroups:\n  a: 1\nhosts: {}\n", 1, "'.nangroups'"),
    ("hosts:\n  gpu1.lab:\n    address: h\n    port: x\n", 4, "hosts.'gpu1.lab'.port"),
])
def test_a_key_that_would_not_read_as_one_field_segment_is_quoted(tmp_path: Path, text: str, line: int,
                                                                   field: str) -> None:
    """Found by the long loader fuzz: an empty key, or one with a `.`, made the field path ambiguous
    (`containers..vmid`, `.nangroups`)."""
    recipe = write(tmp_path, "r.yaml", TRUE_RECIPE)
    inv = write(tmp_path, "inv.yaml", text)
    proc = cli(tmp_path, "apply", str(recipe), "-i", str(inv), "--dry-run")
    assert_input_error(proc, f"fleetcuda: {inv}:{line}: {field}: ")
