"""What an operator reads (issue 25, points 1 to 4): off a terminal (a pipe, cron's `env -i`) nothing wraps and
every line is stamped; the nightly verify prints drift, failures and one summary line; run logs are pruned and
name fleetcuda's programs instead of repeating them; the live view keeps target, status and elapsed at 80
columns and leaves a clean screen after Ctrl-C; --show-output shows no framing; found and expected say resolved
values and the step's own line, the same every night, and a step's time includes its batched check."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from fleetcuda.cli import Environment, main

ROOT = Path(__file__).resolve().parent.parent
STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(Z|[+-]\d\d:?\d\d) ")
BOX = re.compile("[\u2500-\u257f]")
LONG = "a-step-whose-name-is-most-of-an-eighty-column-terminal-line"  # with what follows it: wider


def recipe(tmp: Path) -> Path:
    """One ok step, one drifted step with a long name, a satisfied_if with a variable, a missing interpreter."""
    path = tmp / "nightly.yaml"
    path.write_text(
        "name: nightly\nvars:\n  cuda_version: '12.8'\nsteps:\n"
        "  - name: ok-step\n    check: 'echo fine'\n    apply: 'true'\n"
        f"  - name: {LONG}\n    check: 'ls {tmp}/no/such/dir/with/a/long/path/that/goes/on/and/on/and/on'\n"
        "    apply: 'true'\n"
        "  - name: cuda-home\n    satisfied_if: test -d x{{ cuda_version }} || "
        "test -d /usr/local/cuda-{{ cuda_version }} || test -d /\n    check: 'false'\n    apply: 'true'\n"
        "  - name: torch\n    check: |\n      true\n      /nonexistent/venv/bin/python -c 'import torch'\n"
        "    apply: 'true'\n")
    return path


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[Path, Path, Path]:
    deep = tmp_path / ("state-directory-with-a-long-name-" * 3)
    inventory = tmp_path / "inv.yaml"
    inventory.write_text("hosts:\n  h:\n    kind: local\n")
    return recipe(tmp_path), inventory, deep


def cron_verify(fleet: tuple[Path, Path, Path], *extra: str) -> subprocess.CompletedProcess[str]:
    """`fleetcuda verify` as cron runs it: `env -i` (no TERM, no COLUMNS, no HOME), output into a pipe."""
    rec, inventory, state = fleet
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "FLEETCUDA_STATE_DIR": str(state)}
    return subprocess.run(["env", "-i", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-m", "fleetcuda",
                           "verify", str(rec), "-i", str(inventory), *extra],
                          capture_output=True, text=True, timeout=120, check=False)


# -- 1. off a terminal ---------------------------------------------------------------------------------------


def test_a_nightly_verify_under_cron_prints_stamped_unwrapped_lines_drift_and_one_summary(fleet) -> None:
    got = cron_verify(fleet)
    assert got.returncode == 1, got.stderr
    lines = got.stdout.splitlines()
    assert lines and all(STAMP.match(line) for line in lines), got.stdout
    assert not [line for line in lines if line != line.rstrip()]  # no trailing spaces (`full log: `, `logs: `)
    assert not BOX.search(got.stdout)  # no table unless asked for
    run_dir = next((fleet[2] / "runs").iterdir())
    # Paths and names whole, on one line each: nothing wraps at 80 columns.
    assert any(line.endswith(f"full log: {run_dir / 'h.log'}") for line in lines)
    assert any(f"h: {LONG} drift" in line for line in lines)
    summary = [line for line in lines if "; exit " in line]
    assert len(summary) == 1 and summary[0].endswith(f"1 drift; exit 1; {summary[0].split('; ')[-2]}; logs: {run_dir}")
    assert not any(" ok-step" in line for line in lines)  # what is fine is not repeated every night
    assert any(line.endswith(" h done: drift") for line in lines)  # each target's result, in one line


def test_the_full_table_on_request_is_as_wide_as_its_content(fleet) -> None:
    got = cron_verify(fleet, "--table")
    lines = got.stdout.splitlines()
    assert all(STAMP.match(line) and line == line.rstrip() for line in lines)
    rows = [line for line in lines if BOX.search(line)]
    assert rows and len({len(line) for line in rows}) == 1 and len(rows[0]) > 120  # one width, wider than 80
    assert any(LONG in line and "drift" in line for line in rows)  # a cell unbroken


def test_history_and_other_tables_off_a_terminal_keep_their_cells_whole(tmp_path: Path, fleet) -> None:
    rec, inventory, _ = fleet
    out = io.StringIO()

    def run(*argv: str) -> str:
        out.seek(0)
        out.truncate()
        env = Environment.with_streams(out, io.StringIO(), io.StringIO(), environ={"PATH": "/usr/bin:/bin"},
                                       home=tmp_path, cwd=tmp_path, state_dir=tmp_path / "s")
        main(list(argv), env)
        return out.getvalue()

    run("verify", str(rec), "-i", str(inventory))
    run("verify", str(rec), "-i", str(inventory))
    table = run("history")
    assert re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", table)  # a date whole, not `2026-12-0` / `2T06:53:0`
    assert str(tmp_path / "s" / "history.sqlite") in table
    assert all(line == line.rstrip() for line in table.splitlines())


def test_a_plain_console_never_wraps_nor_leaves_trailing_spaces() -> None:
    from fleetcuda.reports.plain import plain_console

    buf = io.StringIO()
    console = plain_console(buf, {"COLUMNS": "80"})
    path = "/var/lib/" + "deep/" * 40 + "file.log"
    console.print(f"    full log: {path}", markup=False)
    from rich.table import Table

    table = Table(title="t", box=None)
    table.add_column("package")
    table.add_column("fingerprint")
    table.add_row("causal-conv1d 1.7.0", "x" * 100)
    console.print(table)
    text = buf.getvalue()
    assert f"    full log: {path}\n" in text and "package" in text and "x" * 100 in text
    assert all(line == line.rstrip() for line in text.splitlines())


def test_prune_removes_old_runs_and_every_run_applies_the_default(tmp_path: Path, fleet) -> None:
    rec, inventory, _ = fleet
    state = tmp_path / "s"
    runs = state / "runs"
    runs.mkdir(parents=True)
    old = [runs / f"2001010{i}T000000Z-verify-r-1-x{i}" for i in range(1, 4)]
    for d in old:
        d.mkdir()
        (d / "h.log").write_text("log")
    recent = runs / (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-verify-r-1-new")
    recent.mkdir()
    out, err = io.StringIO(), io.StringIO()
    env = Environment.with_streams(out, err, io.StringIO(), environ={"PATH": "/usr/bin:/bin"}, home=tmp_path,
                                   cwd=tmp_path, state_dir=state)
    assert main(["prune", "--keep", "1", "--dry-run"], env) == 0
    assert all(d.exists() for d in old) and "3 run(s) would be removed" in out.getvalue()
    assert main(["prune", "--keep", "3"], env) == 0
    assert [d.exists() for d in old] == [False, True, True] and recent.exists()
    # The default (30 days, the 20 newest kept) is applied as every run ends, so the nightly job prunes.
    for i in range(25):
        (runs / f"2002{i % 12 + 1:02d}01T0000{i:02d}Z-verify-r-1-y").mkdir()
    assert main(["verify", str(rec), "-i", str(inventory)], env) == 1
    assert len([d for d in runs.iterdir()]) == 20


def test_a_run_log_names_fleetcudas_programs_by_digest_instead_of_repeating_them() -> None:
    from fleetcuda.plan.inventory import load_inventory
    from fleetcuda.plan.planner import base_values, batch_command, pending_facts, plan_run
    from fleetcuda.plan.recipe import load_recipe
    from fleetcuda.remote import program
    from fleetcuda.run.logtext import by_reference

    flagship = load_recipe(ROOT / "recipes" / "gdn-fastpath.yaml")
    target = load_inventory(ROOT / "inventories" / "example.yaml").targets[0]
    values = {n: "1" for n in pending_facts(flagship, base_values(flagship, target, {}))}
    values.update(cuda_version="12.8", distro="debian12", python_xy="3.11", max_jobs="8")
    plan = plan_run(flagship, [target], values, lambda t: None, "abcd1234", "0123456789abcdef").plans[target.id]
    probes = [(s.index, s.verify_probe) for s in plan.steps if s.verify_probe is not None and not s.on_host]
    shown = batch_command(plan, probes).display  # what the log's `$ ` line held: over 60,000 characters
    logged = by_reference(shown)
    assert len(logged) < len(shown) / 2
    for name in ("pyserver", "fast_path_gate", "import_check"):
        assert f"<program {name} sha256:{program(name).digest}>" in logged
    assert "def main(" not in logged and "FLEETCUDA_NONCE" not in logged


# -- 2. the live view ----------------------------------------------------------------------------------------


def rows(n: int = 3) -> list[dict[str, str]]:
    return [{"target": f"pve-gpu{i}/20{i}", "status": "running", "step": "causal-conv1d (apply)", "elapsed": "312s",
             "last output": "building 'causal_conv1d_cuda' extension " * 3} for i in range(n)]


@pytest.mark.parametrize("width", [60, 80, 100, 160, 240])
def test_the_live_table_keeps_target_status_and_elapsed_and_fits(width: int) -> None:
    from fleetcuda.reports.live import column_widths

    widths = column_widths(rows(), width)
    assert {"target", "status", "elapsed"} <= set(widths)
    assert widths["target"] == len("pve-gpu0/200") and widths["status"] == len("running")
    assert sum(widths.values()) + 3 * len(widths) + 1 <= width - 2  # room for the echoed ^C
    if "last output" in widths:  # it gives way first: the step is whole whenever it is shown
        assert widths["step"] == len("causal-conv1d (apply)")
    if width >= 160:
        assert list(widths) == ["target", "status", "step", "elapsed", "last output"]


SLOW = ("name: slow\nsteps:\n  - name: a-rather-long-step-name-for-the-layout\n    check: 'false'\n"
        "    apply: 'for i in $(seq 1 60); do echo a long line of output from the target, number $i, "
        "with more words than fit; sleep 0.2; done'\n    verify: 'true'\n")


def tmux(*argv: str) -> str:
    """tmux on a server of this test's own (its own socket, no configuration): nobody else's sizes or sessions."""
    return subprocess.run(["tmux", "-L", f"fleetcuda-test-{os.getpid()}", "-f", "/dev/null", *argv],
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
@pytest.mark.parametrize("columns", [80, 160])
def test_the_live_view_in_a_terminal_keeps_its_columns_and_ctrl_c_leaves_a_clean_screen(tmp_path: Path,
                                                                                        columns: int) -> None:
    (tmp_path / "slow.yaml").write_text(SLOW)
    (tmp_path / "inv.yaml").write_text("hosts:\n  h:\n    kind: local\n  a-local-host-with-a-long-name:\n"
                                       "    kind: local\n")
    name = f"fleetcuda-live-{os.getpid()}-{columns}"
    cmd = (f"cd {ROOT} && unset COLUMNS LINES; PYTHONPATH={ROOT} FLEETCUDA_STATE_DIR={tmp_path / 's'} "
           f"{sys.executable} -m fleetcuda apply {tmp_path / 'slow.yaml'} -i {tmp_path / 'inv.yaml'}; "
           "echo EXITED $?; sleep 60")
    tmux("new-session", "-d", "-s", name, "-x", str(columns), "-y", "40", cmd)
    try:
        deadline = time.monotonic() + 30
        screen = ""
        wanted = "a long line of output" if columns > 100 else "running"
        while time.monotonic() < deadline and wanted not in screen:
            time.sleep(0.3)
            screen = tmux("capture-pane", "-p", "-t", name)
        header = next(line for line in screen.splitlines() if "\u2503 target" in line)
        for col in ("target", "status", "elapsed"):
            assert col in header, screen
        assert "a-local-host-with-a-long-name" in screen and "running" in screen
        if columns >= 160:
            assert "last output" in header and "a-rather-long-step-name-for-the-layout (apply)" in screen
        tmux("send-keys", "-t", name, "C-c")
        while time.monotonic() < deadline + 30 and "EXITED" not in screen:
            time.sleep(0.3)
            screen = tmux("capture-pane", "-p", "-t", name)
        assert "EXITED 130" in screen
        before_summary = screen.split("interrupted: what had run")[0]
        assert not BOX.search(before_summary), screen  # no stray border of the live table left above
    finally:
        subprocess.run(["tmux", "-L", f"fleetcuda-test-{os.getpid()}", "kill-server"], check=False)


# -- 3. --show-output -------------------------------------------------------------------------------------------


def test_show_output_shows_what_the_target_printed_and_never_framing(fleet) -> None:
    got = cron_verify(fleet, "--show-output")
    shown = [line.split(" | ", 1)[1] for line in got.stdout.splitlines() if " | " in line and " all-steps" in line]
    assert "fine" in shown and any("No such file or directory" in line for line in shown), got.stdout
    assert "@@fleetcuda" not in got.stdout
    assert all(line.strip() and not line.startswith("|") for line in shown)


# -- 4. found and expected ----------------------------------------------------------------------------------


def test_found_names_the_step_and_its_own_line_with_resolved_values_the_same_every_night(fleet) -> None:
    import json
    import sqlite3

    first, second = cron_verify(fleet, "--format", "json"), cron_verify(fleet, "--format", "json")
    checks = {c["step"]: c for c in json.loads(first.stdout)["targets"][0]["checks"]}
    torch = checks["torch"]["found"]
    assert torch == "torch: line 2: /nonexistent/venv/bin/python: No such file or directory", torch
    home = checks["cuda-home"]["found"]
    assert home == "satisfied_if holds: test -d x12.8 || test -d /usr/local/cuda-12.8 || test -d /", home
    assert not any("fleetcuda" in c["found"] or "${" in c["found"] for c in checks.values())
    assert json.loads(second.stdout)["targets"][0]["checks"][3]["found"] == torch
    with sqlite3.connect(fleet[2] / "history.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM runs").fetchone() == (2,)
    from fleetcuda.reports.history import changes

    assert changes(fleet[2] / "history.sqlite") == []  # the same drift is no change


def test_history_compares_values_recorded_with_run_ids_as_the_same() -> None:
    from fleetcuda.results import normalised

    a = "fleetcuda-batch@bc39fa96: line 27: /root/venv/bin/python: No such file or directory"
    b = "fleetcuda-batch@0a1b2c3d: line 31: /root/venv/bin/python: No such file or directory"
    assert normalised(a) == normalised(b) != normalised(a.replace("python", "python3"))
    assert normalised("fleetcuda:cuda-home@bc39fa96: line 5: nvcc: not found") == "fleetcuda:cuda-home: nvcc: not found"


def test_a_steps_time_includes_its_batched_check(tmp_path: Path) -> None:
    rec = tmp_path / "r.yaml"
    rec.write_text("name: r\nsteps:\n" + "".join(f"  - name: s{i}\n    check: 'sleep 0.4'\n    apply: 'true'\n"
                                                 for i in range(2)))
    (tmp_path / "inv.yaml").write_text("hosts:\n  h:\n    kind: local\n")
    out = io.StringIO()
    env = Environment.with_streams(out, io.StringIO(), io.StringIO(), environ={"PATH": "/usr/bin:/bin"},
                                   home=tmp_path, cwd=tmp_path, state_dir=tmp_path / "s")
    assert main(["apply", str(rec), "-i", str(tmp_path / "inv.yaml")], env) == 0
    times = [float(m) for m in re.findall(r"already satisfied, (\d+\.\d)s", out.getvalue())]
    assert len(times) == 2 and all(t >= 0.4 for t in times), out.getvalue()


def test_a_terminal_console_is_left_to_rich() -> None:
    env = Environment.with_streams(io.StringIO(), io.StringIO(), io.StringIO(), environ={"COLUMNS": "100"},
                                   home=Path("/"), cwd=Path("/"), stdout_is_terminal=True)
    console: Console = env.console()
    assert console.is_terminal and console.width == 100


def test_cache_list_through_a_pipe_keeps_its_headers_and_cells(tmp_path: Path) -> None:
    from fleetcuda.run.wheelcache import FIELDS

    cache_dir = tmp_path / "cache"
    wheel = tmp_path / "causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"PK\x03\x04 a wheel")
    fp = dict.fromkeys(FIELDS, "x") | {"package": "causal-conv1d", "version": "1.7.0", "torch": "2.11.0+cu128"}
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "FLEETCUDA_CACHE_DIR": str(cache_dir)}
    store = ("import sys; from pathlib import Path; from fleetcuda.run.wheelcache import WheelCache; "
             "WheelCache().store(Path(sys.argv[1]), eval(sys.argv[2]), {'built_on': 'pve-gpu1/200'})")
    subprocess.run(["env", "-i", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-c", store, str(wheel),
                    repr(fp)], check=True)
    got = subprocess.run(["env", "-i", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-m", "fleetcuda",
                          "cache", "list"], capture_output=True, text=True, check=True)
    header = next(line for line in got.stdout.splitlines() if "package" in line)
    for col in ("package", "fingerprint", "torch", "built on", "installs", "sha256"):
        assert col in header, got.stdout
    assert "causal-conv1d 1.7.0" in got.stdout and "2.11.0+cu128" in got.stdout and "pve-gpu1/200" in got.stdout
    assert all(line == line.rstrip() for line in got.stdout.splitlines())
