"""The red team's findings where a user meets them: over real sshd and `pct exec` into real LXC containers
(hosts with zsh and bash login shells, sudo), through the real CLI. tests/test_cli_promises.py has the same
promises on a local host, and the fuzzing of templates in every quoting context."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_fleetcuda
from tests.test_lab_e2e import INV, LAB, ct, lab_is_up  # noqa: F401  (the fixture skips/fails without a lab)

pytestmark = pytest.mark.lab
TARGETS = "lab-a/200,lab-b/300"  # a zsh login shell as root, and bash with sudo -n


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def _inventory(tmp_path: Path, extra_vars: str = "") -> Path:
    text = (REPO / INV).read_text()
    if extra_vars:
        text = text.replace("vars:\n", "vars:\n" + extra_vars, 1)
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_no_value_runs_in_a_container_in_any_quoting_context(tmp_path: Path) -> None:
    r = _recipe(tmp_path, """\
        name: r
        vars:
          x: "12.8"
        steps:
          - name: contexts
            verify: |
              set -e
              echo "release 12.8," | grep -q "release {{ x }},"
              test "$(echo {{ x }})" = "`printf %s "{{ x }}"`"
              cat <<EOF | grep -qF -- {{ x }}
              {{ x }}
              EOF
              [[ {{ x }} == {{ x }} ]]
        """)
    for value in ["$(touch /tmp/pwned)", "`touch /tmp/pwned`", "'; touch /tmp/pwned; '", '"; touch /tmp/pwned; #',
                  "x\ntouch /tmp/pwned\n", "!!; touch /tmp/pwned"]:
        proc = run_fleetcuda("verify", str(r), "-i", INV, "--limit", TARGETS, "--plain", "--var", f"x={value}",
                             state=tmp_path / "s")
        if value[0] in "$`":  # an expansion: refused at load (tests/test_arith_values.py)
            assert proc.returncode == 2, proc.stdout + proc.stderr
        elif "\n" not in value:  # (grep reads a pattern with newlines as several patterns)
            assert proc.returncode == 1, proc.stdout  # drift: the value is not 12.8; and nothing ran
        for target in TARGETS.split(","):
            assert ct(target, "test ! -e /tmp/pwned", check=False).returncode == 0, (target, value)
    ok = run_fleetcuda("verify", str(r), "-i", INV, "--limit", TARGETS, "--plain", state=tmp_path / "s")
    assert ok.returncode == 0, ok.stdout


def test_secrets_reach_the_step_but_no_command_line_and_no_output(tmp_path: Path) -> None:
    secret = "s3cr3t!'\\\t\"$ (id);x;"
    inv = _inventory(tmp_path, "  hf_token: " + json.dumps(secret) + "\n")
    r = _recipe(tmp_path, """\
        name: r
        vars:
          hf_token: unset
        steps:
          - name: token-file
            kind: env_file
            path: /etc/profile.d/fc-test-token.sh
            vars:
              HF_TOKEN: "{{ hf_token }}"
          - name: uses-token
            env:
              TOKEN: "{{ hf_token }}"
            check: test -f /tmp/fc-token-used
            apply: |
              printf '%s' "$TOKEN" > /tmp/fc-token-seen
              printf '%s' {{ hf_token }} > /tmp/fc-token-seen-template
              echo "the token is $TOKEN"
              sleep 4
              touch /tmp/fc-token-used
        """)
    for target in TARGETS.split(","):
        ct(target, "rm -f /tmp/fc-token-* /etc/profile.d/fc-test-token.sh")
    state = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "apply", str(r), "-i", str(inv), "--limit", TARGETS,
                             "--plain", "--show-output"], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            env={"PATH": "/usr/bin:/bin", "FLEETCUDA_STATE_DIR": str(state), "HOME": str(tmp_path)})
    # While the step runs, every process of both containers (seen from the host) and of the host itself.
    cmdlines: list[bytes] = []
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        for f in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                cmdlines.append(f.read_bytes())
            except OSError:
                pass
        time.sleep(0.3)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert any(b"sleep 4" in c for c in cmdlines)
    assert not [c for c in cmdlines if b"s3cr3t" in c]
    for target in TARGETS.split(","):
        assert ct(target, "cat /tmp/fc-token-seen").stdout == secret
        assert ct(target, "cat /tmp/fc-token-seen-template").stdout == secret
        assert ct(target, ". /etc/profile.d/fc-test-token.sh; printf %s \"$HF_TOKEN\"").stdout == secret
    assert "s3cr3t" not in out and "the token is ***" in out
    report = run_fleetcuda("verify", str(r), "-i", str(inv), "--limit", TARGETS, "--format", "json", state=state)
    assert report.returncode == 0 and "s3cr3t" not in report.stdout + report.stderr
    for f in state.rglob("*"):
        if f.is_file():
            assert b"s3cr3t" not in f.read_bytes(), f
    for target in TARGETS.split(","):
        ct(target, "rm -f /tmp/fc-token-* /etc/profile.d/fc-test-token.sh")


def test_a_check_in_a_container_cannot_forge_its_result(tmp_path: Path) -> None:
    r = _recipe(tmp_path, """\
        name: r
        steps:
          - name: first
            verify: "true"
          - name: forger
            verify: |
              echo "@@fleetcuda-batch end 1 0 0"
              nonce=$(tr '\\0' '\\n' < /proc/$PPID/cmdline | grep -o '@@fleetcuda:[0-9a-f]*' | head -n 1)
              printf '\\n%s end 1 0 0\\n' "$nonce"
              echo 'and some [/] markup [bold]'
              exit 1
        """)
    proc = run_fleetcuda("verify", str(r), "-i", INV, "--limit", TARGETS, "--format", "json", state=tmp_path / "s")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    for target in report["targets"]:
        assert {c["step"]: c["status"] for c in target["checks"]} == {"first": "ok", "forger": "drift"}
    table = run_fleetcuda("verify", str(r), "-i", INV, "--limit", TARGETS, state=tmp_path / "s")
    assert table.returncode == 1 and "some [/] markup [bold]" in table.stdout


def _procs(last_arg: bytes | None = None, script_has: bytes | None = None) -> list[int]:
    """Processes (of every container too: the host sees them all) by their last argument or script."""
    found = []
    for f in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = f.read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if len(args) >= 2 and (last_arg is None or args[-1] == last_arg) and \
                (script_has is None or script_has in args[-2]):
            found.append(int(f.parent.name))
    return found


def test_stopping_a_run_never_touches_another_runs_processes(tmp_path: Path) -> None:
    """Another run's step of the same name (and a step named `stop`) survive our Ctrl-C."""
    import signal
    r = _recipe(tmp_path, """\
        name: r
        steps:
          - name: stop
            check: test -f /tmp/fc-stop-done
            apply: sleep 60; touch /tmp/fc-stop-done
        """)
    target = "lab-a/201"
    ct(target, "rm -f /tmp/fc-stop-done")
    # What another fleetcuda run's step looks like in the container: bash with that step's label as $0.
    ct(target, "nohup bash -c 'sleep 300; true' fleetcuda:stop@0therrun >/dev/null 2>&1 &")
    assert _procs(b"fleetcuda:stop@0therrun")
    proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "apply", str(r), "-i", INV, "--limit", target,
                             "--plain"], cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={"PATH": "/usr/bin:/bin", "FLEETCUDA_STATE_DIR": str(tmp_path / "s"),
                                 "HOME": str(tmp_path)})
    deadline = time.monotonic() + 60
    while not _procs(script_has=b"sleep 60; touch"):
        assert time.monotonic() < deadline, "the step never started"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=90)[0]
    assert proc.returncode == 130, out
    # (its bash, `timeout` and what it started: each carries the label, as $0 or in its environment)
    assert re.search(r"interrupted during stop: stopped [1-9]\d* process\(es\)", out), out
    assert not _procs(script_has=b"sleep 60; touch")  # ours is gone
    theirs = _procs(b"fleetcuda:stop@0therrun")
    assert theirs  # theirs is not
    for pid in theirs:
        os.kill(pid, 9)


def test_a_held_lock_is_refreshed_and_never_taken_over_while_its_run_lives(tmp_path: Path) -> None:
    r = _recipe(tmp_path, """\
        name: r
        steps:
          - name: long
            check: test -f /tmp/fc-long-done
            apply: sleep 8; touch /tmp/fc-long-done
        """)
    target = "lab-b/301"
    ct(target, "rm -f /tmp/fc-long-done")
    env = {"PATH": "/usr/bin:/bin", "FLEETCUDA_STATE_DIR": str(tmp_path / "s"), "HOME": str(tmp_path),
           "FLEETCUDA_LOCK_REFRESH_S": "1"}
    first = subprocess.Popen([sys.executable, "-m", "fleetcuda", "apply", str(r), "-i", INV, "--limit", target,
                              "--plain"], cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=env)
    deadline = time.monotonic() + 60
    while ct(target, "test -d /run/lock/fleetcuda-apply-301", check=False).returncode != 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # As if the lock had not been touched for a day: the live run's refresh makes it fresh again.
    ct(target, "touch -d '1 day ago' /run/lock/fleetcuda-apply-301")
    time.sleep(2.5)
    age = int(ct(target, "echo $(( $(date +%s) - $(stat -c %Y /run/lock/fleetcuda-apply-301) ))").stdout)
    assert age < 5
    second = run_fleetcuda("apply", str(r), "-i", INV, "--limit", target, "--plain", state=tmp_path / "s2")
    assert second.returncode == 1 and "locked" in second.stdout, second.stdout
    out = first.communicate(timeout=60)[0]
    assert first.returncode == 0, out


def test_a_url_password_holding_quotes_reaches_the_container_on_stdin_only(tmp_path: Path) -> None:
    """Issue 22.4(c): a URL's password holding `"` and `'` is a secret: it arrives exactly (its sha256), over SSH,
    the login shell and `pct exec`, and no process's command line, no output, log or report holds it."""
    import hashlib

    password = "pa\"ss'wordXY9lab"
    url = f"https://user:{password}@pypi.example.invalid/simple"
    digest = hashlib.sha256(url.encode()).hexdigest()
    r = _recipe(tmp_path, f"""\
        name: r
        vars:
          index: {json.dumps(url)}
        steps:
          - name: url
            verify: |
              sleep 3
              printf %s "{{{{ index }}}}" | sha256sum | grep -q {digest}
        """)
    state = tmp_path / "s"
    env = {**os.environ, "FLEETCUDA_STATE_DIR": str(state), "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "verify", str(r), "-i", INV, "--limit", TARGETS,
                             "--plain", "--report", f"json={tmp_path / 'report.json'}"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    while proc.poll() is None:  # every process of this machine, the lab's hosts and containers included
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if b"wordXY9lab" in (d / "cmdline").read_bytes():
                        seen.append((d / "cmdline").read_bytes())
                except OSError:
                    pass
        time.sleep(0.05)
    out, err = proc.communicate()
    assert proc.returncode == 0, out + err  # it arrived exactly, on both targets
    assert not seen, seen[:1]
    kept = "".join(p.read_text(errors="replace") for p in [*state.rglob("*.log"), tmp_path / "report.json"])
    assert "wordXY9lab" not in out + err + kept
