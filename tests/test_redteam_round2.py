"""Red team round 2: each test reproduces a broken promise through the real CLI (local hosts, real bash)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_fleetcuda


def _files(tmp_path: Path, recipe: str, inventory: str = "hosts:\n  h:\n    kind: local\n") -> tuple[Path, Path]:
    r = tmp_path / "r.yaml"
    r.write_text(textwrap.dedent(recipe))
    i = tmp_path / "i.yaml"
    i.write_text(inventory)
    return r, i


# Promise 1: a {{ }} value can never run a command. Each script below is ordinary bash; the value
# `a[$(touch PWNED)]` is inserted as "${fc_n}" where bash then evaluates it as arithmetic or as a
# variable name (an array subscript), which runs the command substitution.
INJECTION_CONTEXTS = {
    "arith_in_unquoted_heredoc": "cat <<EOF\n$(( {{ n }} + 1 ))\nEOF",
    "herestring_confuses_scanner": "cat <<<x\n(( {{ n }} > 0 )) || true",
    "assignment_to_declare_i_var": "declare -i k\nk={{ n }}",
    "test_v": "[ -v {{ n }} ] || true",
    "printf_v": "printf -v {{ n }} %s 1",
    "read_into_name": "read -r {{ n }} <<<'x' || true",
    "compound_array_assignment": "arr=([{{ n }}]=1)",
    "declare_name": "declare {{ n }}=1",
    "declare_nameref": "declare -n r={{ n }}; echo \"$r\"",
    "if_arith_without_space": "if(( {{ n }} )); then :; fi",
    "while_arith_without_space": "while(( {{ n }} )); do break; done",
    "for_arith_without_space": "for((i=0;i<{{ n }};i++)); do :; done",
    "wait_p": "true & wait -p {{ n }} $! || true",
}

# Strings bash itself evaluates later as code (no eval, no bash -c): the value is expanded into them when
# they are set, and the `$(...)` in it runs when bash evaluates them.
LATER_EVALUATED = {
    "trap_in_double_quotes": "trap \"echo {{ n }} >/dev/null\" EXIT",
    "ps4_with_xtrace": "PS4=\"+ {{ n }} \"; set -x; true",
    "alias_in_double_quotes": "shopt -s expand_aliases; alias a=\"echo {{ n }}\"\na >/dev/null",
    "mapfile_callback": "mapfile -C \"echo {{ n }}\" -c 1 arr <<<x",
}


@pytest.mark.parametrize("context", list(LATER_EVALUATED))
def test_redteam2_template_value_runs_command_in_string_bash_evaluates_later(context: str, tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    r, i = _files(tmp_path, "name: r\nvars:\n  n: \"1\"\nsteps:\n  - name: s\n    verify: "
                  + json.dumps(LATER_EVALUATED[context]) + "\n")
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", "--var", f"n=$(touch {pwned})",
                         state=tmp_path / "s", timeout=30)
    assert not pwned.exists(), f"{context}: the --var value ran a command (exit {proc.returncode})"


def test_redteam2_value_naming_an_env_variable_runs_its_subscript(tmp_path: Path) -> None:
    # A value with no `[` at all (`M`) used where bash reads a number evaluates the variable M as
    # arithmetic; M came in as data through the step's env:, holding `a[$(touch ...)]`.
    pwned = tmp_path / "pwned"
    r, i = _files(tmp_path, """\
        name: r
        vars:
          n: "1"
          m: "x"
        steps:
          - name: s
            env:
              M: "{{ m }}"
            verify: |
              declare -i k
              k={{ n }}
        """)
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", "--var", "n=M", "--var", f"m=a[$(touch {pwned})]",
                         state=tmp_path / "s", timeout=30)
    assert not pwned.exists(), f"the values ran a command (exit {proc.returncode})"


@pytest.mark.parametrize("context", list(INJECTION_CONTEXTS))
def test_redteam2_template_value_runs_command(context: str, tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    script = INJECTION_CONTEXTS[context]
    r, i = _files(tmp_path, "name: r\nvars:\n  n: \"1\"\nsteps:\n  - name: s\n    verify: "
                  + json.dumps(script) + "\n")
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", "--var", f"n=a[$(touch {pwned})]",
                         state=tmp_path / "s", timeout=30)
    assert not pwned.exists(), f"{context}: the --var value ran a command (exit {proc.returncode})"
    # Either it was refused at load (exit 2 naming the field) or it ran as data.
    assert proc.returncode in (0, 1, 2), proc.stdout + proc.stderr


# Promise 2: secrets. A variable named like a key (`hf_key`, `access_key`, `ssh_key`) is a secret by the
# promise's own words, but only `api_key`/`apikey`/`private_key` are recognised: its value is printed in the
# dry-run, travels on the command line and is stored in the log.
def test_redteam2_key_named_variable_is_printed_and_logged(tmp_path: Path) -> None:
    secret = "hfKeyValue-8c1d2e"
    r, i = _files(tmp_path, """\
        name: r
        vars:
          hf_key: unset
        steps:
          - name: s
            env:
              HF_KEY: "{{ hf_key }}"
            check: "false"
            apply: echo "{{ hf_key }}" >/dev/null
        """)
    dry = run_fleetcuda("apply", str(r), "-i", str(i), "--dry-run", "--var", f"hf_key={secret}", state=tmp_path / "s")
    assert dry.returncode == 0
    assert secret not in dry.stdout + dry.stderr, "the key's value is printed by --dry-run"


def test_redteam2_secret_in_module_field_is_on_a_process_command_line(tmp_path: Path) -> None:
    # pip_install's index_url carries a token; fleetcuda splices it into the `bash -c` script, so it is in
    # /proc/<pid>/cmdline of the target's bash for as long as the step runs.
    secret = "tok-" + "q" * 16
    fakepy = tmp_path / "fakepy"
    fakepy.write_text("#!/bin/bash\nsleep 3\nexit 1\n")
    fakepy.chmod(0o755)
    r, i = _files(tmp_path, f"""\
        name: r
        vars:
          api_token: unset
        steps:
          - name: p
            kind: pip_install
            python: {fakepy}
            packages: ["foo==1.0"]
            index_url: "https://mirror.example.invalid/{{{{ api_token }}}}/simple"
        """, "hosts:\n  h:\n    kind: local\n    vars:\n      api_token: " + secret + "\n")
    env = {"PATH": "/usr/bin:/bin", "FLEETCUDA_STATE_DIR": str(tmp_path / "s"), "HOME": str(tmp_path),
           "FLEETCUDA_CACHE_DIR": str(tmp_path / "c")}
    proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "apply", str(r), "-i", str(i), "--plain"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = set()
    deadline = time.monotonic() + 20
    while proc.poll() is None and time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    cmd = (d / "cmdline").read_bytes().decode("utf-8", "replace")
                except OSError:
                    continue
                if secret in cmd and "bash" in cmd:
                    seen.add(cmd.replace("\0", " ")[:200])
        time.sleep(0.1)
    proc.communicate(timeout=30)
    assert not seen, f"the token is on a command line while the step runs: {sorted(seen)[:2]}"


# Promise 3: a batched check forges another check's result. The check runs under the batch shell, can read
# the frame nonce from that shell's /proc/<pid>/cmdline and write frame lines straight into its stdout
# (/proc/<pid>/fd/1), unprefixed; killing the batch shell then stops the real frames from arriving.
def test_redteam2_batched_check_forges_another_checks_result(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        steps:
          - name: evil
            verify: |
              b=$(ps -o ppid= -p $PPID | tr -d ' ')
              n=$(tr '\\0' '\\n' < /proc/$b/cmdline | grep -o '@@fleetcuda:[0-9a-f]*' | head -1)
              printf '\\n%s end 0 0 5\\n%s begin 1\\n\\n%s end 1 0 5\\n' "$n" "$n" "$n" > /proc/$b/fd/1
              kill -9 $b
          - name: other
            verify: "false"
        """)
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", state=tmp_path / "s", timeout=30)
    assert "other: ok" not in proc.stdout, "a check that always fails is reported ok"
    # On a local host the check, root on this very machine, goes on to kill its parents, fleetcuda included when
    # the checks run one by one (as they do once the batch gave no closing frame): never a success, though.
    assert proc.returncode != 0, proc.stdout


def test_redteam2_batched_check_forges_its_own_result(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        steps:
          - name: a
            verify: "true"
          - name: evil
            verify: |
              b=$(ps -o ppid= -p $PPID | tr -d ' ')
              n=$(tr '\\0' '\\n' < /proc/$b/cmdline | grep -o '@@fleetcuda:[0-9a-f]*' | head -1)
              printf '\\n%s end 1 0 5\\n' "$n" > /proc/$b/fd/1
              exit 1
        """)
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", state=tmp_path / "s", timeout=30)
    assert proc.returncode == 1, "a check that exits 1 is reported as passing: " + proc.stdout


# Promise 5: target output is never interpreted as terminal control sequences. A check's output with an
# OSC "set window title", "clear screen" and colour sequences reaches the user's terminal raw, both in
# --show-output lines and in the failed step's output tail.
def test_redteam2_terminal_control_sequences_from_target_reach_the_terminal(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        steps:
          - name: mk
            verify: |
              printf 'esc:\\033]0;TITLE\\007 \\033[2J \\033[31mRED\\033[0m\\n'
              exit 1
        """)
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", "--show-output", state=tmp_path / "s", timeout=30)
    assert proc.returncode == 1
    assert "\x1b" not in proc.stdout + proc.stderr, "a raw ESC from the target is printed"
    tail = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", state=tmp_path / "s", timeout=30)
    assert "\x1b" not in tail.stdout + tail.stderr, "a raw ESC from the target is printed in the output tail"


# Promise 9: bad input exits 2. An empty --limit (as from an unset shell variable: --limit "$HOSTS") selects
# every target and applies to them, where a pattern that matches nothing is documented as an error.
@pytest.mark.parametrize("limit", ["", ",", " "])
def test_redteam2_empty_limit_selects_every_target(limit: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    r, i = _files(tmp_path, f"""\
        name: r
        steps:
          - name: s
            check: "false"
            apply: touch {marker}
        """)
    proc = run_fleetcuda("apply", str(r), "-i", str(i), "--plain", "--lock-wait", "15", "--limit", limit, state=tmp_path / "s", timeout=30)  # noqa: E501
    assert not marker.exists(), f"--limit {limit!r} applied the recipe to every target"
    assert proc.returncode == 2, proc.stdout + proc.stderr


def test_redteam2_state_dir_symlink_loop_is_an_internal_error(tmp_path: Path) -> None:
    r, i = _files(tmp_path, "name: r\nsteps:\n  - name: s\n    verify: \"true\"\n")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", state=loop, timeout=30)
    assert proc.returncode == 2, f"exit {proc.returncode}: {proc.stderr.strip()}"
    assert "FLEETCUDA_STATE_DIR" in proc.stderr


def _pids_with(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


# Promise 6: SIGTERM while the checks run batched (the first round trip) stops only the batch shell
# (`stopped 0 process(es) labelled fleetcuda-batch@...`): the check that was running, labelled with its
# own step, goes on running on the target after fleetcuda has exited 130.
def test_redteam2_sigterm_during_batched_checks_leaves_the_check_running(tmp_path: Path) -> None:
    marker = f"sleep 37.{os.getpid()}"
    r, i = _files(tmp_path, f"""\
        name: r
        steps:
          - name: a
            verify: "true"
          - name: slowcheck
            check: "{marker}; false"
            apply: "true"
        """)
    env = {**os.environ, "FLEETCUDA_STATE_DIR": str(tmp_path / "s"), "FLEETCUDA_CACHE_DIR": str(tmp_path / "c")}
    proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "apply", str(r), "-i", str(i), "--plain", "--lock-wait", "15"],  # noqa: E501
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 10
        while not _pids_with(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 130, out
        time.sleep(1)
        left = _pids_with(marker)
        assert not left, f"the interrupted check is still running after exit 130: pids {left}\n{out}"
    finally:
        for pid in _pids_with(marker):
            try:
                os.kill(pid, 9)
            except OSError:
                pass


# Promise 4/6 (reliability): one long output line of letters/digits (a base64 blob, a minified JSON,
# pip's \r progress bar) costs time quadratic in its length on the control machine, in the redactor's
# URL-credentials regex (formerly redact.URL_CREDENTIALS: `[A-Za-z][A-Za-z0-9+.-]*://` retried at every offset): 20 kB ~2 s, 60 kB ~15-20 s, 300 kB ~6 min, during which  # noqa: E501
# SIGTERM is not acted on (a `timeout 100` run took 7 minutes to end). A 50 kB line should take well under 5 s.
def test_redteam2_one_long_output_line_takes_quadratic_time(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        steps:
          - name: s
            verify: "head -c 50000 /dev/zero | tr '\\\\0' 'B'; echo; true"
        """)
    start = time.monotonic()
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", state=tmp_path / "s", timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert elapsed < 5, f"a 50 kB line took {elapsed:.1f} s"


# Promise 2: a secret with `!`, `'` or a tab, used in a module field (pip_install's index_url,
# apt_keyring's repo_url), is printed by --dry-run in its escaped form ($'...\041...\t...'), which the
# redactor (matching the raw value) does not recognise.
def test_redteam2_secret_in_module_field_leaks_escaped_in_dry_run(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        vars:
          api_token: x
        steps:
          - name: p
            kind: pip_install
            packages: ["foo==1.0"]
            index_url: "https://mirror.example.invalid/{{ api_token }}/simple"
        """)
    proc = run_fleetcuda("apply", str(r), "-i", str(i), "--dry-run", "--var", "api_token=Ab!cd'ef\tgh",
                         state=tmp_path / "s")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "Ab\\041cd" not in out and "ef\\tgh" not in out, "the secret is printed, escaped"


def test_redteam2_sigterm_is_not_acted_on_while_a_long_line_is_redacted(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        steps:
          - name: s
            verify: "head -c 400000 /dev/zero | tr '\\\\0' 'B'; echo; true"
        """)
    env = {**os.environ, "FLEETCUDA_STATE_DIR": str(tmp_path / "s"), "FLEETCUDA_CACHE_DIR": str(tmp_path / "c")}
    proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "verify", str(r), "-i", str(i), "--plain"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(3)
    proc.terminate()
    try:
        proc.communicate(timeout=12)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("SIGTERM was not acted on within 12 s (the run is stuck redacting one 400 kB line)")
    # 130 if the signal came while it ran; 0 if one 400 kB line no longer takes it 3 s to get through.
    assert proc.returncode in (0, 130)


# Promise 3, against the `done`-frame fix: the check forges the closing frame too, then kills the batch shell,
# so the forged frames are the last ones and the batch "reached" its end.
def test_redteam2_batched_check_forges_results_and_the_done_frame(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        steps:
          - name: evil
            verify: |
              b=$(ps -o ppid= -p $PPID | tr -d ' ')
              n=$(tr '\\0' '\\n' < /proc/$b/cmdline | grep -o '@@fleetcuda:[0-9a-f]*' | head -1)
              f='\\n%s end 0 0 5\\n%s begin 1\\n\\n%s end 1 0 5\\n\\n%s done 2\\n'
              printf "$f" "$n" "$n" "$n" "$n" > /proc/$b/fd/1
              kill -9 $b
          - name: other
            verify: "false"
        """)
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", state=tmp_path / "s", timeout=30)
    assert "other: ok" not in proc.stdout, "a check that always fails is reported ok"
    assert proc.returncode != 0, proc.stdout  # (the local check goes on to kill fleetcuda itself: root here)


# Promise 2 (after the key fix): `pwd`, the usual short form of password (db_pwd, MYSQL_PWD), is not a
# secret name: its value is printed by --dry-run.
def test_redteam2_pwd_named_variable_is_printed(tmp_path: Path) -> None:
    secret = "dbPwdValue-4711"
    r, i = _files(tmp_path, """\
        name: r
        vars:
          db_pwd: unset
        steps:
          - name: s
            check: "false"
            apply: echo "{{ db_pwd }}" >/dev/null
        """)
    dry = run_fleetcuda("apply", str(r), "-i", str(i), "--dry-run", "--var", f"db_pwd={secret}", state=tmp_path / "s")
    assert dry.returncode == 0
    assert secret not in dry.stdout + dry.stderr, "the db_pwd value is printed by --dry-run"


# Promise 5 (after the printable fix): a Unicode bidi override (U+202E RIGHT-TO-LEFT OVERRIDE) from the
# target reaches the terminal and reverses how the rest of the line is displayed (Trojan-Source style).
def test_redteam2_bidi_override_from_target_reaches_the_terminal(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        steps:
          - name: mk
            verify: |
              printf 'status: \\xe2\\x80\\xaekcatta\\n'
              exit 1
        """)
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", "--show-output", state=tmp_path / "s", timeout=30)
    assert proc.returncode == 1
    assert "\u202e" not in proc.stdout + proc.stderr, "a bidi override from the target is printed raw"


# Promise 2: a secret through a filter in a module field (`{{ api_token | dashed }}` in index_url) is
# printed by --dry-run and written to the run's log: only the unfiltered value is masked.
def test_redteam2_filtered_secret_in_module_field_is_printed_and_logged(tmp_path: Path) -> None:
    fakepy = tmp_path / "fakepy"
    fakepy.write_text("#!/bin/bash\nexit 1\n")
    fakepy.chmod(0o755)
    r, i = _files(tmp_path, f"""\
        name: r
        vars:
          api_token: unset
        steps:
          - name: p
            kind: pip_install
            python: {fakepy}
            packages: ["foo==1.0"]
            index_url: "https://mirror.example.invalid/{{{{ api_token | dashed }}}}/simple"
        """)
    var = "api_token=tok.en.secretvalue"
    dry = run_fleetcuda("apply", str(r), "-i", str(i), "--dry-run", "--var", var, state=tmp_path / "s")
    assert "tok-en-secretvalue" not in dry.stdout + dry.stderr, "the filtered secret is printed by --dry-run"
    run_fleetcuda("apply", str(r), "-i", str(i), "--plain", "--lock-wait", "15", "--var", var, state=tmp_path / "s2",
                  timeout=30)
    logs = [p for p in (tmp_path / "s2").rglob("*.log") if "tok-en-secretvalue" in p.read_text(errors="replace")]
    assert not logs, f"the filtered secret is in {logs}"


# Promise 9 (after the empty --limit fix): an exclusion that matches nothing (`!typo`, or a bare `!`) is not an
# error and selects every target; a limit that selects no target at all (`h,!h`) "verifies" nothing and exits 0.
@pytest.mark.parametrize("limit", ["!no-such-host", "!"])
def test_redteam2_exclusion_matching_nothing_selects_every_target(limit: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    r, i = _files(tmp_path, f"""\
        name: r
        steps:
          - name: s
            check: "false"
            apply: touch {marker}
        """)
    proc = run_fleetcuda("apply", str(r), "-i", str(i), "--plain", "--lock-wait", "15", "--limit", limit,
                         state=tmp_path / "s", timeout=30)
    assert not marker.exists(), f"--limit {limit!r} applied the recipe to every target"
    assert proc.returncode == 2, proc.stdout + proc.stderr


def test_redteam2_limit_selecting_no_target_exits_0(tmp_path: Path) -> None:
    r, i = _files(tmp_path, "name: r\nsteps:\n  - name: s\n    verify: \"false\"\n")
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", "--limit", "h,!h", state=tmp_path / "s", timeout=30)
    assert proc.returncode != 0, "a verify of zero targets reports success: " + proc.stdout
