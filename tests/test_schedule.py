"""Nightly job: exact crontab line and unit files, quoting that survives cron/sh and systemd, idempotence."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from fleetcuda.run.schedule import (
    ScheduleError,
    cron_line,
    install_cron,
    install_systemd,
    remove_cron,
    remove_systemd,
    show_cron,
    show_systemd,
    systemd_quote,
    systemd_units,
)

ARGV = ["/opt/fleetcuda/bin/fleetcuda", "verify", "/etc/fleetcuda/gdn fastpath.yaml", "-i", "/etc/fleetcuda/lab.yaml",
        "--plain", "--format", "json", "--output", "/var/lib/fleetcuda/verify-%Y.json"]
NASTY = ["recipe with space.yaml", "it's", '"dq"', "$HOME", "${HOME}", "`id`", "$(id)", "a;b", ";", "*", "100%",
         "%d%%", "", "ü → ∞", "-x", "#not-a-comment", "~", "back\\slash", "!bang", "a\tb", "x&y|z>w<v"]


# -- cron ---------------------------------------------------------------------------------------


def test_cron_line_exact() -> None:
    line = cron_line(ARGV, log_path="/var/log/fleetcuda/verify.log", name="nightly")
    assert line == (
        "0 3 * * * umask 077; /opt/fleetcuda/bin/fleetcuda verify '/etc/fleetcuda/gdn fastpath.yaml' "
        "-i /etc/fleetcuda/lab.yaml --plain --format json --output /var/lib/fleetcuda/verify-\\%Y.json "
        "</dev/null >>/var/log/fleetcuda/verify.log 2>&1 # fleetcuda-verify:nightly")
    assert cron_line(["/usr/bin/fleetcuda", "verify", "r.yaml"], log_path="/var/log/my log", at=" 30  2 * * 1-5 ",
                     name="lab.b_2", cwd="/srv/fleet cuda") == (
        "30 2 * * 1-5 umask 077; cd '/srv/fleet cuda' && /usr/bin/fleetcuda verify r.yaml "
        "</dev/null >>'/var/log/my log' 2>&1 # fleetcuda-verify:lab.b_2")


def cron_command(line: str) -> tuple[str, str | None]:
    """What cron hands to /bin/sh -c, and the stdin it feeds: crontab(5)'s % rule, as cronie implements it."""
    command = line.split(None, 5)[5]
    out: list[str] = []
    escaped = False
    for i, ch in enumerate(command):
        if escaped:
            if ch == "%":
                out[-1] = "%"
            else:
                out.append(ch)
            escaped = False
            continue
        if ch == "%":
            return "".join(out), command[i + 1:].replace("%", "\n")
        escaped = ch == "\\"
        out.append(ch)
    return "".join(out), None


def test_cron_line_survives_cron_and_sh(tmp_path: Path) -> None:
    exe = tmp_path / "bin dir" / "fleetcuda"
    exe.parent.mkdir()
    # Writes each argument NUL-terminated to stdout (the log), then whether stdin had anything.
    exe.write_text("#!/bin/sh\nfor a; do printf '%s\\0' \"$a\"; done\nif read -r x; then echo STDIN; fi\n")
    exe.chmod(0o755)
    log = tmp_path / "logs" / "verify.log"
    log.parent.mkdir()
    argv = [str(exe), *NASTY]
    line = cron_line(argv, log_path=str(log))
    command, stdin = cron_command(line)
    assert stdin is None, "an unescaped % would cut the command short"
    for shell in ("/bin/sh", "/bin/bash", "/usr/bin/dash"):
        if not Path(shell).exists():
            continue
        log.unlink(missing_ok=True)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SHELL": shell}
        subprocess.run([shell, "-c", command], env=env, check=True, cwd=tmp_path, timeout=30,
                       stdin=subprocess.DEVNULL if shell != "/bin/sh" else None)
        assert log.read_bytes().split(b"\0") == [a.encode() for a in NASTY] + [b""], shell
        assert stat.S_IMODE(log.stat().st_mode) == 0o600  # umask 077


@pytest.mark.parametrize("at", ["0 3 * * ", "0 3 * * * *", "0 3 * * ;rm", "0 3 * * $(x)", "0 3 % * *", "@daily",
                                "0 3\n* * *", ""])
def test_cron_at_must_be_five_safe_fields(at: str) -> None:
    with pytest.raises(ValueError, match="5 cron fields"):
        cron_line(ARGV, log_path="/var/log/x.log", at=at)


def test_cron_line_refuses_what_cron_cannot_run() -> None:
    with pytest.raises(ValueError, match="absolute path"):
        cron_line(["fleetcuda", "verify"], log_path="/var/log/x.log")
    with pytest.raises(ValueError, match="absolute path"):
        cron_line(ARGV, log_path="verify.log")
    with pytest.raises(ValueError, match="newline"):
        cron_line([*ARGV, "a\nb"], log_path="/var/log/x.log")
    with pytest.raises(ValueError, match="backslash followed by %"):
        cron_line([*ARGV, "a\\%b"], log_path="/var/log/x.log")
    with pytest.raises(ValueError, match="job name"):
        cron_line(ARGV, log_path="/var/log/x.log", name="bad name")
    with pytest.raises(ValueError, match="empty"):
        cron_line([], log_path="/var/log/x.log")


@pytest.fixture
def fake_crontab(tmp_path: Path) -> tuple[str, Path]:
    """A crontab(1) stand-in keeping the table in a file: -l prints it (or "no crontab for"), - replaces it."""
    store = tmp_path / "crontab.txt"
    script = tmp_path / "crontab"
    script.write_text(f"""#!/bin/sh
store='{store}'
case "$1" in
  -l) if [ -f "$store" ]; then cat "$store"; else echo "no crontab for $(id -un)" >&2; exit 1; fi ;;
  -) cat > "$store.new" && mv "$store.new" "$store" ;;
  *) echo "usage: crontab [-l | -]" >&2; exit 2 ;;
esac
""")
    script.chmod(0o755)
    return str(script), store


def test_install_cron_twice_leaves_one_entry(fake_crontab: tuple[str, Path]) -> None:
    crontab, store = fake_crontab
    assert show_cron("nightly", crontab_cmd=crontab) is None  # "no crontab for" reads as empty
    line = cron_line(ARGV, log_path="/var/log/fleetcuda/verify.log", name="nightly")
    assert install_cron(line, "nightly", crontab_cmd=crontab) is True
    assert install_cron(line, "nightly", crontab_cmd=crontab) is False
    assert store.read_text() == line + "\n"
    assert show_cron("nightly", crontab_cmd=crontab) == line


def test_install_replaces_in_place_and_remove_keeps_other_entries(fake_crontab: tuple[str, Path]) -> None:
    crontab, store = fake_crontab
    others = ["MAILTO=ops@example.com", "# backups", "15 1 * * * /usr/local/bin/backup # fleetcuda-verify:nightly2"]
    store.write_text("\n".join(others) + "\n")
    old = cron_line(ARGV, log_path="/var/log/a.log", name="nightly")
    install_cron(old, "nightly", crontab_cmd=crontab)
    store.write_text(store.read_text() + "0 5 * * * /bin/true\n")
    new = cron_line(ARGV, log_path="/var/log/b.log", at="30 4 * * *", name="nightly")
    assert install_cron(new, "nightly", crontab_cmd=crontab) is True
    assert store.read_text().splitlines() == [*others, new, "0 5 * * * /bin/true"]
    assert show_cron("nightly2", crontab_cmd=crontab) == others[2]

    assert remove_cron("nightly", crontab_cmd=crontab) is True
    assert store.read_text().splitlines() == [*others, "0 5 * * * /bin/true"]
    assert remove_cron("nightly", crontab_cmd=crontab) is False
    assert store.read_text().splitlines() == [*others, "0 5 * * * /bin/true"]


def test_install_cron_checks_the_line_and_reports_crontab_errors(fake_crontab: tuple[str, Path],
                                                                  tmp_path: Path) -> None:
    crontab, _ = fake_crontab
    line = cron_line(ARGV, log_path="/var/log/a.log", name="nightly")
    with pytest.raises(ValueError, match="fleetcuda-verify:other"):
        install_cron(line, "other", crontab_cmd=crontab)
    broken = tmp_path / "broken-crontab"
    broken.write_text("#!/bin/sh\necho 'crontab: permission denied' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(ScheduleError, match="permission denied"):
        install_cron(line, "nightly", crontab_cmd=str(broken))
    with pytest.raises(ScheduleError, match="not found"):
        show_cron("nightly", crontab_cmd=str(tmp_path / "no-such-crontab"))


# -- systemd ------------------------------------------------------------------------------------

SERVICE = """\
# Written by fleetcuda (fleetcuda-verify:nightly); `fleetcuda schedule` replaces or removes it.
[Unit]
Description=fleetcuda verify (nightly)
Wants=network-online.target
After=network-online.target

[Service]
Type=oneshot
ExecStart=/opt/fleetcuda/bin/fleetcuda verify "/etc/fleetcuda/gdn fastpath.yaml" -i /etc/fleetcuda/lab.yaml \
--plain --format json --output "/var/lib/fleetcuda/verify-%%Y.json"
StandardInput=null
Nice=10
IOSchedulingClass=idle
UMask=0077
"""

TIMER = """\
# Written by fleetcuda (fleetcuda-verify:nightly); `fleetcuda schedule` replaces or removes it.
[Unit]
Description=Timer for fleetcuda verify (nightly)

[Timer]
OnCalendar=*-*-* 03:00:00
Persistent=true
RandomizedDelaySec=15min
Unit=fleetcuda-verify-nightly.service

[Install]
WantedBy=timers.target
"""


def test_systemd_units_exact() -> None:
    assert systemd_units("nightly", ARGV) == (SERVICE, TIMER)
    service, timer = systemd_units("lab", ["/usr/bin/fleetcuda", "verify"], "Mon..Fri 02:30", nice=5,
                                   randomized_delay="30min", user="fleet", working_directory="/srv/fleetcuda")
    assert "ExecStart=/usr/bin/fleetcuda verify\n" in service
    assert "Nice=5\n" in service and "User=fleet\nWorkingDirectory=/srv/fleetcuda\n" in service
    assert "OnCalendar=Mon..Fri 02:30\n" in timer and "RandomizedDelaySec=30min\n" in timer
    assert "Unit=fleetcuda-verify-lab.service\n" in timer


def systemd_exec_argv(value: str) -> list[str]:
    """ExecStart= as systemd reads it: words unquoted and C-unescaped, then %% -> % and $$ -> $ in each."""
    escapes = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'", ";": ";"}
    words: list[str] = []
    i, n = 0, len(value)
    while True:
        while i < n and value[i] in " \t":
            i += 1
        if i >= n:
            return words
        word: list[str] = []
        quote: str | None = None
        while i < n and (quote or value[i] not in " \t"):
            c = value[i]
            if c == "\\":
                if value[i + 1] == "x":
                    word.append(chr(int(value[i + 2:i + 4], 16)))
                    i += 4
                else:
                    word.append(escapes[value[i + 1]])
                    i += 2
            elif quote is None and c in "\"'":
                quote, i = c, i + 1
            elif c == quote:
                quote, i = None, i + 1
            else:
                assert quote or c not in ";", "an unquoted ; separates commands"
                word.append(c)
                i += 1
        assert quote is None, "unterminated quote"
        text = "".join(word)
        for special in "%$":
            parts = text.split(special * 2)
            assert all(special not in p for p in parts), f"unescaped {special} in {text!r}"
            text = special.join(parts)
        words.append(text)


def test_systemd_exec_start_round_trips() -> None:
    argv = ["/opt/fleet cuda/bin/fleetcuda", *NASTY, "ctl\x01\x7f"]
    quoted = " ".join(systemd_quote(a) for a in argv)
    assert systemd_exec_argv(quoted) == argv
    assert systemd_quote("plain-word_1.2/x=y:z,w+v@u") == "plain-word_1.2/x=y:z,w+v@u"
    assert systemd_quote("") == '""'
    assert systemd_quote("$HOME 100%") == '"$$HOME 100%%"'


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_analyze_accepts_the_units(tmp_path: Path) -> None:
    exe = tmp_path / "fleetcuda"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    result = install_systemd("nightly", [str(exe), *NASTY], tmp_path)
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(result.service_path),
                           str(result.timer_path)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"})
    assert proc.returncode == 0, proc.stderr
    assert "fleetcuda-verify-nightly" not in proc.stderr, proc.stderr


def test_install_systemd_idempotent_private_of_nothing_and_injectable(tmp_path: Path) -> None:
    result = install_systemd("nightly", ARGV, tmp_path)
    assert result.changed and not result.activated
    assert result.service_path == tmp_path / "fleetcuda-verify-nightly.service"
    assert result.timer_path == tmp_path / "fleetcuda-verify-nightly.timer"
    assert result.service_path.read_text() == SERVICE and result.timer_path.read_text() == TIMER
    for path in (result.service_path, result.timer_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert result.activate_command == "systemctl daemon-reload && systemctl enable --now fleetcuda-verify-nightly.timer"

    calls: list[list[str]] = []
    again = install_systemd("nightly", ARGV, tmp_path, activate=True, systemctl=["systemctl", "--user"],
                            runner=calls.append)
    assert not again.changed and again.activated
    assert calls == [["systemctl", "--user", "daemon-reload"],
                     ["systemctl", "--user", "enable", "--now", "fleetcuda-verify-nightly.timer"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleetcuda-verify-nightly.service",
                                                          "fleetcuda-verify-nightly.timer"]
    changed = install_systemd("nightly", ARGV, tmp_path, on_calendar="*-*-* 04:00:00")
    assert changed.changed and "OnCalendar=*-*-* 04:00:00\n" in changed.timer_path.read_text()

    assert set(show_systemd("nightly", tmp_path)) == {result.service_path, result.timer_path}
    (tmp_path / "other.service").write_text("[Service]\n")
    calls.clear()
    assert remove_systemd("nightly", tmp_path, deactivate=True, runner=calls.append) == [result.timer_path,
                                                                                         result.service_path]
    assert calls == [["systemctl", "disable", "--now", "fleetcuda-verify-nightly.timer"],
                     ["systemctl", "daemon-reload"]]
    assert [p.name for p in tmp_path.iterdir()] == ["other.service"]
    assert show_systemd("nightly", tmp_path) == {}
    assert remove_systemd("nightly", tmp_path) == []


@pytest.mark.parametrize("on_calendar", ["", "daily; rm -rf /", "03:00\n[Service]", "*-*-*\n03:00:00", "$(id)",
                                         "%H:00", "a" * 201])
def test_on_calendar_is_validated(on_calendar: str) -> None:
    with pytest.raises(ValueError, match="OnCalendar"):
        systemd_units("nightly", ARGV, on_calendar)


def test_systemd_units_validate_their_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="absolute path"):
        systemd_units("nightly", ["fleetcuda", "verify"])
    with pytest.raises(ValueError, match="Nice"):
        systemd_units("nightly", ARGV, nice=40)
    with pytest.raises(ValueError, match="RandomizedDelaySec"):
        systemd_units("nightly", ARGV, randomized_delay="15min\nExecStartPre=/bin/sh")
    with pytest.raises(ValueError, match="User"):
        systemd_units("nightly", ARGV, user="root\nUser=x")
    with pytest.raises(ValueError, match="job name"):
        systemd_units("../evil", ARGV)
    with pytest.raises(ScheduleError, match="does not exist"):
        install_systemd("nightly", ARGV, tmp_path / "missing")
