"""The red team's findings, through the real CLI on a local host (real bash, real processes): each test
asserts what a user would see, and failed before its fix. The same promises over SSH and pct are in
tests/test_lab_promises.py."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_fleetcuda


def _files(tmp_path: Path, recipe: str) -> tuple[Path, Path]:
    r = tmp_path / "r.yaml"
    r.write_text(textwrap.dedent(recipe))
    i = tmp_path / "i.yaml"
    i.write_text("hosts:\n  h:\n    kind: local\n")
    return r, i


def test_a_variable_in_double_quotes_cannot_run_commands_during_verify(tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    r, i = _files(tmp_path, """\
        name: r
        vars:
          x: "12.8"
        steps:
          - name: release
            verify: echo "Cuda compilation tools, release 12.8, V12.8.93" | grep -q "release {{ x }},"
          - name: backticks
            verify: test "`echo {{ x }}`" = "$(printf %s {{ x }})"
          - name: heredoc
            verify: |
              cat <<EOF | grep -qF -- "{{ x }}"
              {{ x }}
              EOF
        """)
    ok = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", state=tmp_path / "s")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for value in [f"$(touch {pwned})", f"`touch {pwned}`", f'"; touch {pwned}; "', f"'; touch {pwned}; '",
                  f"a\ntouch {pwned}"]:
        proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", "--var", f"x={value}", state=tmp_path / "s")
        assert not pwned.exists(), value
        if "touch" in value and value[0] in "$`":  # an expansion: refused at load (tests/test_arith_values.py)
            assert proc.returncode == 2 and "expansion or a backtick" in proc.stderr, proc.stderr
            continue
        assert proc.returncode == 1  # release no longer matches: drift, and nothing ran
        assert "release: drift" in proc.stdout


def test_a_variable_in_single_quotes_is_refused_before_anything_runs(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        vars:
          x: "1"
        steps:
          - name: quoted
            verify: python3 -c 'print("{{ x }}")'
        """)
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", state=tmp_path / "s")
    assert proc.returncode == 2
    assert "r.yaml:" in proc.stderr and "single quotes" in proc.stderr


FORGING = """\
    name: r
    steps:
      - name: first
        verify: "true"
      - name: forger
        # fails, after printing the old frame and this run's own frame (its nonce read from the batch's argv)
        verify: |
          echo "@@fleetcuda-batch end 1 0 0"
          nonce=$(tr '\\0' '\\n' < /proc/$PPID/cmdline | grep -o '@@fleetcuda:[0-9a-f]*' | head -n 1)
          printf '%s end 1 0 0\\n%s lock released\\n' "$nonce" "$nonce"
          exit 1
      - name: third
        verify: "true"
    """


def test_a_check_cannot_forge_its_result_with_frames(tmp_path: Path) -> None:
    r, i = _files(tmp_path, FORGING)
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--format", "json", state=tmp_path / "s")
    report = json.loads(proc.stdout)
    checks = {c["step"]: c["status"] for c in report["targets"][0]["checks"]}
    assert checks == {"first": "ok", "forger": "drift", "third": "ok"}
    assert proc.returncode == 1 and report["exit_code"] == 1


def test_target_output_is_data_not_markup(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        steps:
          - name: noisy
            verify: echo 'oops [/] [bold]x[/bold] [link=file:///etc]y[/link]'; exit 1
        """)
    for fmt in ("table", "json"):
        proc = run_fleetcuda("verify", str(r), "-i", str(i), "--format", fmt, state=tmp_path / "s")
        assert "Traceback" not in proc.stderr and proc.returncode == 1, proc.stderr
        assert "oops [/] [bold]x[/bold]" in proc.stdout
    apply = run_fleetcuda("apply", str(r), "-i", str(i), state=tmp_path / "s")
    assert "Traceback" not in apply.stderr and apply.returncode == 1
    assert "oops [/]" in apply.stdout


def test_recipe_env_is_rendered(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        vars:
          who: bob
        env:
          GREETING: "hi {{ who }}"
        steps:
          - name: greets
            verify: test "$GREETING" = "hi bob"
        """)
    assert run_fleetcuda("verify", str(r), "-i", str(i), "--plain", state=tmp_path / "s").returncode == 0
    proc = run_fleetcuda("apply", str(r), "-i", str(i), "--dry-run", "--format", "shell", state=tmp_path / "s")
    assert "'GREETING=hi bob'" in proc.stdout and "{{" not in proc.stdout


SECRET = "hunter2!'\\\tx\ny"  # `!`, a quote, a backslash, a tab and a newline: each was printed escaped


def _secret_recipe(tmp_path: Path) -> tuple[Path, Path]:
    r, i = _files(tmp_path, f"""\
        name: r
        vars:
          api_token: not-set
          literal_ok: fine
        facts:
          api_token: cat {tmp_path}/token-source
        steps:
          - name: profile
            kind: env_file
            path: {tmp_path}/profile.sh
            vars:
              API_TOKEN: "{{{{ api_token }}}}"
              HF_TOKEN: literal-secret-in-env-file
          - name: uses
            env:
              MY_PASSWORD: literal-secret-in-env
            check: "false"
            apply: |
              echo "token is $API_TOKEN and {{{{ api_token }}}} and $MY_PASSWORD and $HF_TOKEN"
              sleep 3
              exit 1
        """)
    # On the control machine the secret lives in the (private) inventory, not on fleetcuda's own command line.
    i.write_text("hosts:\n  h:\n    kind: local\n    vars:\n      api_token: " + json.dumps(SECRET) + "\n")
    i.chmod(0o600)
    return r, i


def _leaks(text: str) -> list[str]:
    pieces = ["hunter2", "literal-secret-in-env-file", "literal-secret-in-env", "hunter2\\041x", "hunter2\\\\041"]
    return [p for p in pieces if p in text]


def test_secrets_never_printed_stored_or_on_a_command_line(tmp_path: Path) -> None:
    r, i = _secret_recipe(tmp_path)
    (tmp_path / "token-source").write_text("tok-" + "a" * 20 + "\n")
    # The fact-filled value: read from the target, then never shown (`auto` means: read it).
    env_token = "tok-" + "a" * 20
    state = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "apply", str(r), "-i", str(i), "--plain",
                             "--show-output"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": "/usr/bin:/bin", "FLEETCUDA_STATE_DIR": str(state),
                                 "FLEETCUDA_CACHE_DIR": str(state / "c"), "HOME": str(tmp_path)})
    seen_cmdlines = []
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    seen_cmdlines.append((d / "cmdline").read_bytes().decode("utf-8", "replace"))
                except OSError:
                    pass
        time.sleep(0.2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert any("sleep 3" in c for c in seen_cmdlines), "the step was seen running"
    assert not [c for c in seen_cmdlines if "hunter2" in c or "literal-secret" in c], "a secret on a command line"
    # The step did get the values.
    profile = (tmp_path / "profile.sh").read_text()
    assert "hunter2" in profile and "literal-secret-in-env-file" in profile
    assert (tmp_path / "profile.sh").stat().st_mode & 0o777 == 0o644
    assert not _leaks(out + err), out + err
    for f in state.rglob("*"):
        if f.is_file():
            data = f.read_bytes().decode("utf-8", "replace")
            if f.suffix == ".sqlite":
                con = sqlite3.connect(f)
                data = "\n".join(str(row) for t in ("runs", "target_results", "step_results")
                                 for row in con.execute(f"SELECT * FROM {t}"))
                con.close()
            assert not _leaks(data), f
    # verify with a JSON report: the env_file's `expected` held the secret
    rep = run_fleetcuda("verify", str(r), "-i", str(i), "--format", "json", state=state)
    assert "***" in rep.stdout and not _leaks(rep.stdout + rep.stderr), rep.stdout
    # a fact-filled secret (api_token: auto) is redacted as well
    rep = run_fleetcuda("verify", str(r), "-i", str(i), "--format", "json", "--var", "api_token=auto", state=state)
    assert env_token not in rep.stdout + rep.stderr
    dry = run_fleetcuda("apply", str(r), "-i", str(i), "--dry-run", state=state)
    assert not _leaks(dry.stdout)
    dry = run_fleetcuda("apply", str(r), "-i", str(i), "--dry-run", "--verbose", state=state)
    assert not _leaks(dry.stdout) and "IFS= read -r -d" in dry.stdout


@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_a_second_signal_during_cleanup_still_records_the_run(tmp_path: Path, sig: str) -> None:
    r, i = _files(tmp_path, """\
        name: r
        steps:
          - name: slow
            check: "false"
            apply: sleep 60
        """)
    state = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "apply", str(r), "-i", str(i), "--plain"],
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": "/usr/bin:/bin", "FLEETCUDA_STATE_DIR": str(state), "HOME": str(tmp_path)})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(
            b"sleep 60" in p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline") if p.exists()):
        time.sleep(0.1)
    import signal as sg
    signum = getattr(sg, f"SIG{sig}")
    proc.send_signal(signum)
    time.sleep(0.3)
    proc.send_signal(signum)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err
    con = sqlite3.connect(state / "history.sqlite")
    rows = con.execute("SELECT status FROM target_results").fetchall()
    assert rows == [("interrupted",)]
    assert not any(b"sleep 60" in p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline") if p.exists())


def test_a_report_never_replaces_a_device_fifo_or_link(tmp_path: Path) -> None:
    """As root, `--output /dev/null` once replaced /dev/null itself with the report."""
    import os

    from fleetcuda.reports.formats import write_atomically
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    for path in (fifo, link, tmp_path):
        with pytest.raises(OSError, match="not a regular file"):
            write_atomically(path, "{}")
    assert fifo.is_fifo() and link.is_symlink()
    write_atomically(tmp_path / "ok.json", "{}")
    assert (tmp_path / "ok.json").read_text() == "{}"


def test_a_variable_listed_under_secrets_is_redacted_and_off_the_command_line(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        vars:
          dsn: unset
        secrets: [dsn]
        steps:
          - name: shows
            verify: echo "connecting with {{ dsn }}"; exit 1
        """)
    i.write_text("hosts:\n  h:\n    kind: local\n    vars:\n      dsn: postgres-conn-XYZ\n")
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--format", "json", state=tmp_path / "s")
    assert proc.returncode == 1 and "postgres-conn-XYZ" not in proc.stdout + proc.stderr
    assert "connecting with ***" in proc.stdout
    dry = run_fleetcuda("apply", str(r), "-i", str(i), "--dry-run", state=tmp_path / "s")
    assert "postgres-conn-XYZ" not in dry.stdout


def test_sigint_stops_a_run_started_with_sigint_ignored(tmp_path: Path) -> None:
    """A background job of a script starts with SIGINT ignored; `kill -INT` must still stop it cleanly."""
    import signal as sg
    r, i = _files(tmp_path, """\
        name: r
        steps:
          - name: slow
            check: "false"
            apply: sleep 61
        """)
    state = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "apply", str(r), "-i", str(i), "--plain"],
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PATH": "/usr/bin:/bin", "FLEETCUDA_STATE_DIR": str(state), "HOME": str(tmp_path)},
                            preexec_fn=lambda: sg.signal(sg.SIGINT, sg.SIG_IGN))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(
            b"sleep 61" in p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline") if p.exists()):
        time.sleep(0.1)
    proc.send_signal(sg.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert not any(b"sleep 61" in p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline") if p.exists())
