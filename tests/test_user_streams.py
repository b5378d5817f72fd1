"""Writing to the user never stops convergence nor loses the run's record (issue 22.9b): a reader that left
(`| head -3`, EPIPE) or a terminal that closed (EIO) ends what is written there, and the run goes on with its
exit status and its history record. Through the real CLI on a `kind: local` target, and in-process with a
stream that fails."""

from __future__ import annotations

import errno
import io
import os
import pty
import sqlite3
import subprocess
import sys
from pathlib import Path

from fleetcuda.cli import Environment, main
from tests.conftest import REPO


def _files(tmp_path: Path) -> tuple[Path, Path, list[Path]]:
    made = [tmp_path / f"made{n}" for n in range(3)]
    steps = "".join(f"  - name: s{n}\n    check: test -e {m}\n    apply: sleep 0.3; touch {m}\n"
                    for n, m in enumerate(made))
    r = tmp_path / "r.yaml"
    r.write_text("name: r\nsteps:\n" + steps)
    i = tmp_path / "i.yaml"
    i.write_text("hosts:\n  h:\n    kind: local\n")
    return r, i, made


def _history(state: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(state / "history.sqlite") as db:
        return db.execute("SELECT mode, exit_code FROM runs").fetchall()


def test_an_apply_piped_into_head_converges_and_is_recorded(tmp_path: Path) -> None:
    r, i, made = _files(tmp_path)
    state = tmp_path / "state"
    env = {**os.environ, "FLEETCUDA_STATE_DIR": str(state), "PYTHONPATH": str(REPO)}
    # (--lock-wait: a local target's lock is this machine's, which other tests may hold a moment)
    command = f'{sys.executable} -m fleetcuda apply {r} -i {i} --plain --lock-wait 120 | head -3'
    proc = subprocess.run(["bash", "-c", command + '; echo "rc=${PIPESTATUS[0]}" >&2'],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert len(proc.stdout.splitlines()) == 3
    assert all(m.exists() for m in made), proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "rc=0", proc.stderr
    assert "Error" not in proc.stderr and "Traceback" not in proc.stderr
    assert _history(state) == [("apply", 0)]


class _ClosedTerminal(io.StringIO):
    """A terminal that went away: every write fails with EIO after the first few."""

    def __init__(self, good_writes: int):
        super().__init__()
        self.left = good_writes

    def write(self, text: str) -> int:
        if self.left <= 0:
            raise OSError(errno.EIO, "Input/output error")
        self.left -= 1
        return super().write(text)


def test_a_closed_terminal_stops_the_output_not_the_run(tmp_path: Path) -> None:
    r, i, made = _files(tmp_path)
    state = tmp_path / "state"
    for terminal in (False, True):  # plain lines, and the rich live view
        for m in made:
            m.unlink(missing_ok=True)
        out, err = _ClosedTerminal(2), _ClosedTerminal(0)
        env = Environment.with_streams(out, err, io.StringIO(), environ={"FLEETCUDA_STATE_DIR": str(state)},
                                       home=tmp_path, cwd=tmp_path, stdout_is_terminal=terminal,
                                       stderr_is_terminal=terminal)
        assert main(["apply", str(r), "-i", str(i), "--lock-wait", "120"], env) == 0
        assert all(m.exists() for m in made)
    assert _history(state) == [("apply", 0), ("apply", 0)]


def test_a_pty_whose_master_closed_stops_the_output_not_the_run(tmp_path: Path) -> None:
    r, i, made = _files(tmp_path)
    state = tmp_path / "state"
    master, slave = pty.openpty()
    env = {**os.environ, "FLEETCUDA_STATE_DIR": str(state), "PYTHONPATH": str(REPO), "TERM": "xterm"}
    # Not its controlling terminal (no SIGHUP when it closes): only the writes fail, with EIO.
    proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "apply", str(r), "-i", str(i), "--lock-wait", "120"],
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, cwd=REPO)
    os.close(slave)
    os.read(master, 100)  # it has started writing
    os.close(master)
    assert proc.wait(120) == 0
    assert all(m.exists() for m in made)
    assert _history(state) == [("apply", 0)]
