"""Red team round 3: each test reproduces a broken promise of the dry-run, the one plan, the CLI or framing
through the real CLI (local hosts, real bash)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_fleetcuda

LOCAL = "hosts:\n  h:\n    kind: local\n"


def _files(tmp_path: Path, recipe: str, inventory: str = LOCAL) -> tuple[Path, Path]:
    r = tmp_path / "r.yaml"
    r.write_text(textwrap.dedent(recipe))
    i = tmp_path / "i.yaml"
    i.write_text(inventory)
    return r, i


def _command_lines_with(text: str, proc: subprocess.Popen[str], seconds: float = 20) -> set[str]:
    seen: set[str] = set()
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    cmd = (d / "cmdline").read_bytes().decode("utf-8", "replace")
                except OSError:
                    continue
                if text in cmd and "fleetcuda" in cmd and "pytest" not in cmd:
                    seen.add(cmd.replace("\0", " ")[:300])
        time.sleep(0.05)
    proc.communicate(timeout=30)
    return seen


# Promise 1 (docs/dry-run.md): "every value fleetcuda treats as a secret (..., credentials in URLs) is shown as
# `***`, and never travels on a command line: the scripts read it from stdin". A mirror URL with a password in
# an ordinary variable is shown as *** by --dry-run, but apply puts the password on the command line of
# `env -i ... bash -c` (and in the step's environment), so --format shell is not what apply sends either.
def test_redteam3_url_password_in_plain_variable_is_on_a_command_line(tmp_path: Path) -> None:
    password = "hunter2pass-" + "z" * 8
    r, i = _files(tmp_path, """\
        name: r
        vars:
          mirror: unset
        env:
          MIRROR: "{{ mirror }}"
        steps:
          - name: s
            check: "false"
            apply: "echo {{ mirror }} >/dev/null; sleep 2"
        """, LOCAL + f"    vars:\n      mirror: https://bob:{password}@mirror.example.invalid/simple\n")
    env = {"PATH": "/usr/bin:/bin", "FLEETCUDA_STATE_DIR": str(tmp_path / "s"), "HOME": str(tmp_path),
           "FLEETCUDA_CACHE_DIR": str(tmp_path / "c")}
    dry = run_fleetcuda("apply", str(r), "-i", str(i), "--dry-run", state=tmp_path / "s")
    assert dry.returncode == 0 and password not in dry.stdout  # shown as ***: fleetcuda treats it as a secret
    proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "apply", str(r), "-i", str(i), "--plain"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = _command_lines_with(password, proc)
    assert not seen, f"the URL's password is on a command line while the step runs: {sorted(seen)[:2]}"


# Promise 4: "nothing a target prints can forge framing". The nonce is now read from stdin, but it is still in
# the batch shell's memory: a check running as the same user (root, as checks do) reads it from
# /proc/<batch>/mem, writes a passing `end` and the closing `done` frame into the batch's stdout
# (/proc/<batch>/fd/1), and kills the batch shell before the real frames follow. The batch's exit status (137)
# said it died, yet its frames were believed: a check that exits 1 was reported ok, exit 0.
FORGER = r'''
import os, re, signal, sys
pid, batch = os.getppid(), None
while pid > 1:
    if b"fleetcuda-batch" in open(f"/proc/{pid}/cmdline", "rb").read():
        batch = pid
        break
    pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
if batch is None:
    sys.exit(1)
found = set()
with open(f"/proc/{batch}/maps") as maps, open(f"/proc/{batch}/mem", "rb", 0) as mem:
    for line in maps:
        if "[heap]" in line or "[stack]" in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            mem.seek(lo)
            found.update(re.findall(rb"(?<![0-9a-f])[0-9a-f]{16}(?![0-9a-f])", mem.read(hi - lo)))
out = os.open(f"/proc/{batch}/fd/1", os.O_WRONLY)
for n in found:
    os.write(out, b"\n@@fleetcuda:" + n + b" end 1 0 5\n\n@@fleetcuda:" + n + b" done 2\n")
os.kill(batch, signal.SIGKILL)
sys.exit(1)
'''


def test_redteam3_check_reads_nonce_from_batch_memory_and_forges_its_pass(tmp_path: Path) -> None:
    forger = tmp_path / "forger.py"
    forger.write_text(FORGER)
    r, i = _files(tmp_path, f"""\
        name: r
        steps:
          - name: a
            verify: "true"
          - name: evil
            verify: "{sys.executable} {forger}"
        """)
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", state=tmp_path / "s", timeout=60)
    assert "evil: ok" not in proc.stdout, "a check that exits 1 is reported ok: " + proc.stdout
    assert re.search(r"evil: (drift|failed) ", proc.stdout), proc.stdout  # (plain verify prints what is not ok)
    assert proc.returncode == 1, proc.stdout


# Promise 1: `--format shell` prints what apply sends. Each command apply runs on a local host is recorded (its
# argv, as the connector gets it) and looked for among the dry-run's pasteable lines, read back by bash; the
# run id, the frame nonce and the lock owner's start time are fixed or normalized.
def _argvs_of_shell_lines(text: str) -> list[list[str]]:
    out = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            got = subprocess.run(["bash", "-c", "printf '%s\\0' " + line], capture_output=True, check=True).stdout
            out.append(got.decode("utf-8", "surrogateescape").split("\0")[:-1])
    return out


def _normal(argv: list[str]) -> list[str]:
    import re
    return [re.sub(r"since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", "since T", a) for a in argv]


def _sent_and_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipe: str, *args: str,
                    inventory: str = LOCAL) -> tuple[list[list[str]], list[list[str]]]:
    import io
    import secrets

    from fleetcuda.cli import Environment, main
    from fleetcuda.connectors import base

    r, i = _files(tmp_path, recipe, inventory)
    monkeypatch.setattr(secrets, "token_hex", lambda n=8: "ab" * n)
    monkeypatch.setenv("FLEETCUDA_CACHE_DIR", str(tmp_path / "cache"))
    sent: list[list[str]] = []
    real = base.LocalTransport.run

    def record(self, cmd, **kw):  # type: ignore[no-untyped-def]
        sent.append(list(cmd.argv))
        return real(self, cmd, **kw)

    monkeypatch.setattr(base.LocalTransport, "run", record)

    def cli(*argv: str) -> str:
        out, err = io.StringIO(), io.StringIO()
        env = Environment.with_streams(out, err, io.StringIO(), environ={"PATH": "/usr/bin:/bin", "COLUMNS": "200"},
                                       home=tmp_path, cwd=tmp_path, state_dir=tmp_path / "state")
        code = main(list(argv), env)
        assert code in (0, 1), out.getvalue() + err.getvalue()
        return out.getvalue()

    shown = _argvs_of_shell_lines(cli("apply", str(r), "-i", str(i), "--dry-run", "--format", "shell", *args))
    sent.clear()
    cli("apply", str(r), "-i", str(i), "--plain", *args)
    return [_normal(a) for a in sent], [_normal(a) for a in shown]


def test_redteam3_shell_format_lines_are_what_apply_sends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = tmp_path / "made"
    sent, shown = _sent_and_shown(tmp_path, monkeypatch, f"""\
        name: r
        secrets: [word]
        vars:
          odd: "it's a $ (x) !x \\\\ caf\\u00e9"
          word: "s3cret-word"
          db_password: "pw-123456"
        env:
          ODD: "{{{{ odd }}}}"
        steps:
          - name: ok
            check: "true"
          - name: touch
            env:
              PW: "{{{{ db_password }}}}"
            check: test -e {made}
            apply: "printf '%s' {{{{ odd }}}} {{{{ word }}}} > {made}"
            verify: test -e {made}
        """)
    assert sent
    missing = [a for a in sent if a not in shown]
    assert not missing, f"apply sent {len(missing)} command(s) that --format shell does not show: {missing[:1]}"


# Promise 3: 130 interrupted, the lock released "also after Ctrl-C", the remote step stopped. SIGHUP (the
# terminal or the SSH session that runs fleetcuda goes away) killed fleetcuda outright: exit 129, the target's
# lock left behind and the step's processes still running, so a next run (which takes over a dead run's
# lock) applies alongside them.
def test_redteam3_sighup_leaves_lock_and_step_running(tmp_path: Path) -> None:
    import os
    import signal

    marker = f"fc-hup-{os.getpid()}"
    r, i = _files(tmp_path, f"""\
        name: r
        steps:
          - name: long
            check: "false"
            apply: "sleep 20; : {marker}"
        """)
    env = {"PATH": "/usr/bin:/bin", "FLEETCUDA_STATE_DIR": str(tmp_path / "s"), "HOME": str(tmp_path),
           "FLEETCUDA_CACHE_DIR": str(tmp_path / "c")}
    proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "apply", str(r), "-i", str(i), "--plain"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not _pids_running(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGHUP)
    out, _ = proc.communicate(timeout=60)
    time.sleep(0.5)
    left = _pids_running(marker)
    for pid in left:  # ours: the step this test started
        os.kill(pid, signal.SIGKILL)
    lock = Path("/run/lock/fleetcuda-apply")
    held = lock.exists() and f"pid {proc.pid} " in (lock / "owner").read_text()
    if held:
        import shutil
        shutil.rmtree(lock)
    assert proc.returncode == 130, f"exit {proc.returncode}: {out}"
    assert not held, "the target's lock is left behind"
    assert not left, "the step goes on running after fleetcuda is gone"


def _pids_running(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text.encode() in (d / "cmdline").read_bytes() and b"pytest" not in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


# Promise 1: every line of the human dry-run is 7-bit ASCII, none over 160 characters, and nothing a value holds
# can fake its structure. The recipe's and the inventory's paths went into the first line raw: a long directory
# made it longer than 160, and a file name's newline, escape sequence or non-ASCII reached the output as is.
def test_redteam3_dry_run_header_path_is_raw(tmp_path: Path) -> None:
    where = tmp_path / ("d" * 120) / "x\n  step 9/9 fake (shell)\n\x1b[2J\u00e9"
    where.mkdir(parents=True)
    r, i = _files(where, "name: r\nsteps:\n  - name: s\n    verify: \"true\"\n")
    proc = run_fleetcuda("apply", str(r), "-i", str(i), "--dry-run", state=tmp_path / "s")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 160
    assert proc.stdout.isascii() and "\x1b" not in proc.stdout
    assert not any(line.startswith("  step 9/9") for line in lines), "a file name fakes a step header"


# Promise 2: bad input is refused naming file:line:field, never silently changed. YAML 1.1 reads `12:30` as 750
# (base 60), `010` as 8 and `0x1F` as 31: an inventory variable written so reached the scripts as another value
# (as `cuda_version: 12.10` once became 12.1, which yamlsrc already keeps as text).
@pytest.mark.parametrize(("written", "meant"), [("12:30", "12:30"), ("010", "010"), ("0x1F", "0x1F")])
def test_redteam3_yaml_integer_notation_changes_a_variable(written: str, meant: str, tmp_path: Path) -> None:
    r, i = _files(tmp_path, "name: r\nvars:\n  x: unset\nsteps:\n  - name: s\n    verify: test {{ x }}\n",
                  LOCAL + f"    vars:\n      x: {written}\n")
    proc = run_fleetcuda("apply", str(r), "-i", str(i), "--dry-run", "--format", "json", state=tmp_path / "s")
    assert proc.returncode == 0, proc.stderr
    script = json.loads(proc.stdout)["targets"][0]["steps"][0]["scripts"]["verify"]["script"]
    assert f"fc_x={meant}\n" in script, script


# Promise 4: no terminal control sequences reach the terminal. The error boundary printed an error naming a
# file (the recipe's path, with an escape sequence in a directory name) raw on stderr, and --plain's first line
# printed that path raw on stdout.
def test_redteam3_error_and_start_line_print_a_path_raw(tmp_path: Path) -> None:
    where = tmp_path / "e\x1b]0;pwned\x07\x1b[2J"
    where.mkdir()
    bad, i = _files(where, "name: r\nsteps:\n  - name: s\n    timeout: x\n")
    refused = run_fleetcuda("apply", str(bad), "-i", str(i), "--dry-run", state=tmp_path / "s")
    assert refused.returncode == 2 and "steps[0].timeout" in refused.stderr
    assert "\x1b" not in refused.stderr and "\x07" not in refused.stderr, refused.stderr
    missing = run_fleetcuda("apply", str(where / "nope.yaml"), "-i", str(i), "--dry-run", state=tmp_path / "s")
    assert missing.returncode == 2 and "\x1b" not in missing.stderr, missing.stderr
    ok, _ = _files(where, "name: r\nsteps:\n  - name: s\n    verify: \"true\"\n")
    ran = run_fleetcuda("verify", str(ok), "-i", str(i), "--plain", state=tmp_path / "s")
    assert ran.returncode == 0 and "\x1b" not in ran.stdout + ran.stderr, ran.stdout


# The same break seen from --format shell: a URL's password written in the recipe's script is shown as *** on
# the pasteable line, and apply sends the password itself, on the command line: the line is not what it sends.
def test_redteam3_url_password_in_script_differs_from_shell_line(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    sent, shown = _sent_and_shown(tmp_path, monkeypatch, """\
        name: r
        steps:
          - name: s
            check: "false"
            apply: "echo https://bob:hunter2pass-zz@mirror.example.invalid/simple >/dev/null"
        """)
    assert not [a for a in sent if "hunter2pass-zz" in " ".join(a)], "the password is on a command line"
    missing = [a for a in sent if a not in shown]
    assert not missing, f"apply sent {len(missing)} command(s) that --format shell does not show: {missing[:1]}"


# Promise 1: `--format shell` is lines to paste into bash or zsh. Its `#` lines are comments in bash, but an
# interactive zsh (default options: no INTERACTIVE_COMMENTS) runs them as commands: the header's `; apply sends
# exactly these` runs `apply`, and a recipe's `when:` text shown in a skipped step's header runs its `$(...)`.
@pytest.mark.xfail(strict=True, reason="red team 3: shell format's # lines run in interactive zsh")
def test_redteam3_shell_format_comment_runs_a_command_in_interactive_zsh(tmp_path: Path) -> None:
    import shutil
    if shutil.which("zsh") is None:
        pytest.skip("needs zsh")
    pwned = tmp_path / "pwned"
    r, i = _files(tmp_path, f"""\
        name: r
        vars:
          x: a
        steps:
          - name: s
            when: "x == $(touch {pwned})"
            verify: "true"
          - name: t
            verify: "true"
        """)
    proc = run_fleetcuda("apply", str(r), "-i", str(i), "--dry-run", "--format", "shell", state=tmp_path / "s")
    assert proc.returncode == 0, proc.stderr
    comments = "".join(line + "\n" for line in proc.stdout.splitlines() if line.startswith("#"))
    subprocess.run(["zsh", "-f", "-i"], input=comments, capture_output=True, text=True, timeout=30,
                   env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TERM": "dumb"}, cwd=tmp_path)
    assert not pwned.exists(), "pasting --format shell's comment lines into zsh ran the recipe's $(...)"
