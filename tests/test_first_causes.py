"""Issue 25, points 5 and 7: the first failure names the real cause, and the defaults are safe.

In-process (`cli.main(argv, env)`) on a local host or the fake connector: what a user reads."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_cli_inprocess import Cli, write
from tests.test_cli_inprocess import cli as _cli_fixture

cli = _cli_fixture  # the same fixture, under its name

ROOT = Path(__file__).resolve().parent.parent
FLAGSHIP = ROOT / "recipes" / "gdn-fastpath.yaml"


def _no_torch_python() -> bool:
    exe = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    return exe is not None and subprocess.run([exe, "-c", "import torch"], capture_output=True).returncode != 0


@pytest.mark.skipif(not _no_torch_python(), reason="needs a python3 on the system PATH without torch")
@pytest.mark.parametrize("venv", [None, "bare"])
def test_flagship_without_torch_fails_first_with_the_preflights_message(cli: Cli, tmp_path: Path,
                                                                        venv: str | None) -> None:
    """A container without torch: its cuda_version fact reads `none`. The first failure is the preflight's own
    message (which venv; no `venv:` set for the target), never `cuda_version 'none' is not a CUDA version`."""
    inv = "hosts:\n  box:\n    kind: local\n"
    if venv:  # a venv without torch
        subprocess.run([shutil.which("python3", path="/usr/bin:/bin"), "-m", "venv", "--without-pip",
                        str(tmp_path / venv)], check=True)
        inv += f"    venv: {tmp_path / venv}\n"
    inventory = write(tmp_path / "inv.yaml", inv)
    for mode in (["apply", "--check"], ["verify"]):
        r = cli(*mode, str(FLAGSHIP), "-i", inventory, "--plain")
        text = r.out + r.err
        assert r.code != 0, text
        assert "is not a CUDA version" not in text.split("preflight", 1)[0], text
        if venv:
            assert f"torch is not importable in {tmp_path / venv}, the venv of box" in text, text
        else:
            assert "no `venv:` set for box in the inventory" in text, text
            assert "torch is not importable in /usr" not in text, text


def test_could_not_look_inside_is_unknown_with_its_reason_never_missing(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_passthrough whose look inside the container fails: its libraries are unknown (with why), in its own
    lines, in its frame and in doctor's table; never `has no libcuda.so` / `missing`."""
    import io

    from rich.console import Console

    from fleetcuda.remote import framing
    from fleetcuda.run import doctor
    from tests.test_gpu_passthrough import Host, load

    host = Host(tmp_path)
    nonce = framing.new_nonce()
    monkeypatch.setenv("FLEETCUDA_NONCE", nonce)
    probe = ["sh", "-c", "echo 'container 200 is not running' >&2; exit 2"]
    rc = load().main(["--container-probe", json.dumps(probe), "--proc-version", str(host.proc),
                      "--pct-config", json.dumps(["sh", "-c", f"cat {host.conf}", "200"]), "--cuda-version", "13.0"])
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith(framing.MARK)]
    assert rc == 1
    assert "FAIL could not look inside the container: container 200 is not running" in lines
    assert not [ln for ln in lines if "has no libcuda.so" in ln or "has no libnvidia-ml.so" in ln], lines
    assert ("unknown the container's libcuda.so: not known (could not look inside the container: container 200 is "
            "not running)") in lines
    assert lines[-1] == "FAIL could not look inside the container: container 200 is not running"
    report = doctor.gpu_report(out, nonce)
    found = {f.check: f for f in doctor.gpu_findings(report)}
    assert found["libcuda.so"].status == "unknown"
    assert found["libcuda.so"].value == "unknown: could not look inside the container: container 200 is not running"
    buf = io.StringIO()
    doctor.render({"pve/200": list(found.values())}, Console(file=buf, width=300))
    assert "missing" not in buf.getvalue() and "unknown" in buf.getvalue()


APT_NO_DNS = "".join(
    f"Err:{i} http://deb.debian.org/debian bookworm/main amd64 pkg{i} amd64 1.0\n"
    f"  Temporary failure resolving 'deb.debian.org'\n" for i in range(10)) + "".join(
    f"E: Failed to fetch http://deb.debian.org/debian/pool/main/p/pkg{i}.deb  Temporary failure resolving "
    f"'deb.debian.org'\n" for i in range(10)) + (
    "E: Unable to fetch some archives, maybe run apt-get update or try with --fix-missing?\n")
PIP_TLS = ("WARNING: Retrying (Retry(total=4)) after connection broken by 'SSLError(SSLCertVerificationError(1, "
           "'[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed'))': /simple/einops/\n"
           "Could not fetch URL https://pypi.org/simple/einops/: There was a problem confirming the ssl certificate: "
           "HTTPSConnectionPool(host='pypi.org', port=443): Max retries exceeded (Caused by SSLError(...))\n"
           "ERROR: Could not find a version that satisfies the requirement einops (from versions: none)\n")
PIP_REFUSED = ("WARNING: Retrying (Retry(total=4)) after connection broken by 'NewConnectionError('<...>: Failed to "
               "establish a new connection: [Errno 111] Connection refused')': /simple/einops/\n"
               "ERROR: Could not find a version that satisfies the requirement einops (from versions: none)\n")


@pytest.mark.parametrize(("kind", "output", "said"), [
    ("apt", APT_NO_DNS, "network (name resolution): cannot resolve the name of deb.debian.org"),
    ("pip", PIP_TLS, "network (TLS): TLS to pypi.org failed"),
    ("pip", PIP_REFUSED, "network (unreachable mirror): cannot reach its mirror (index)"),
])
def test_a_network_failure_is_said_in_one_line_and_not_retried(tmp_path: Path, kind: str, output: str,
                                                               said: str) -> None:
    from fleetcuda.connectors.fake import exit_with
    from fleetcuda.results import StepStatus
    from tests.run_support import Sleeps, log_of, make_engine

    step = ("  - name: net\n    kind: apt_packages\n    packages: [g++]\n    retries: 2\n" if kind == "apt" else
            "  - name: net\n    kind: pip_install\n    packages: [einops]\n    retries: 2\n")
    sleeps = Sleeps()
    engine, fake = make_engine(tmp_path, step, inventory="hosts:\n  h:\n    kind: local\n    venv: /v\n",
                               sleep=sleeps)
    fake.on(step="net", phase="check", reply=exit_with(1))
    fake.on(step="net", phase="apply", reply=exit_with(100 if kind == "apt" else 1, output))
    [result] = engine.run()
    [sr] = result.steps
    assert sr.status == StepStatus.FAILED
    assert said in sr.detail and sr.detail.endswith("; not retried"), sr.detail
    assert len(sr.tail) <= 3, sr.tail  # the distinct lines it rests on, not 20 raw ones
    assert len(fake.calls_for(step="net", phase="apply")) == 1 and sleeps.waits == []
    assert "retrying" not in log_of(engine, "h")


@pytest.mark.parametrize(("script", "said"), [
    ("echo 'Traceback (most recent call last):'; echo '  File \"setup.py\", line 9, in <module>'; "
     "echo \"ModuleNotFoundError: No module named 'torch'\"; echo 'error: metadata-generation-failed'; exit 1",
     "the control machine's Python ({py}) lacks torch: preparing the sdist causal-conv1d==1.7.0 runs its setup.py"),
    ("echo '{py}: No module named pip' >&2; exit 1", "the control machine's Python ({py}) has no pip"),
])
def test_wheelhouse_build_says_what_the_control_machine_lacks(cli: Cli, tmp_path: Path, script: str,
                                                               said: str) -> None:
    py = tmp_path / "python"
    # A stand-in interpreter: `-m pip download` behaves as pip does on a machine without torch (or pip).
    py.write_text("#!/bin/sh\ncase \"$*\" in *--no-binary*) " + script.format(py=py) + " ;; esac\nexit 0\n")
    py.chmod(0o755)
    r = cli("wheelhouse", "build", str(FLAGSHIP), str(tmp_path / "wh"), "--python", str(py))
    assert r.code == 1, r
    assert said.format(py=py) in r.err, r.err
    assert "push" not in r.err, r.err


@pytest.mark.parametrize("argv", [
    ["apply", str(FLAGSHIP), "--dry-run"], ["verify", str(FLAGSHIP)], ["doctor"], ["trust", "pve1"],
    ["export", "ansible", str(FLAGSHIP), "-o", "out"],
])
def test_without_an_inventory_it_exits_2_saying_where_one_comes_from(cli: Cli, tmp_path: Path, argv: list[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """No -i, no $FLEETCUDA_INVENTORY, no ~/.config/fleetcuda/inventory.yaml: exit 2, never the docs' example
    (whose 10.1.2.6 may exist in someone's network). Run from the repository, where that example is."""
    monkeypatch.chdir(ROOT)
    cli.tmp = ROOT  # the command's cwd: the example inventory is right there
    r = cli(*argv)
    assert r.code == 2, r
    assert "pass -i FILE, set FLEETCUDA_INVENTORY, or write" in r.err, r.err
    assert str(ROOT / "home" / ".config" / "fleetcuda" / "inventory.yaml") in r.err, r.err  # the env's home
    assert "10.1.2.6" not in r.out + r.err


def test_the_inventory_comes_from_the_variable_then_the_default_path(cli: Cli, tmp_path: Path) -> None:
    inv = "hosts:\n  box:\n    kind: local\n"
    default = tmp_path / "home" / ".config" / "fleetcuda" / "inventory.yaml"
    default.parent.mkdir(parents=True)
    write(default, inv.replace("box", "fromdefault"))
    r = cli("apply", str(FLAGSHIP), "--dry-run", "--format", "json")
    assert r.code == 0 and "fromdefault" in r.out, r
    cli.environ["FLEETCUDA_INVENTORY"] = str(write(tmp_path / "env.yaml", inv.replace("box", "fromvariable")))
    r = cli("apply", str(FLAGSHIP), "--dry-run", "--format", "json")
    assert r.code == 0 and "fromvariable" in r.out and "fromdefault" not in r.out, r


def _fake_systemctl(tmp_path: Path, cli: Cli, enabled: bool) -> Path:
    """A `systemctl` first on the environment's PATH that logs its argv and says the timer is enabled (or not)."""
    bindir, calls = tmp_path / "sbin", tmp_path / "systemctl.calls"
    bindir.mkdir()
    write(bindir / "systemctl", f"#!/bin/sh\necho \"$*\" >> {calls}\ncase \"$1\" in is-enabled|is-active) "
                                f"exit {0 if enabled else 1} ;; esac\nexit 0\n").chmod(0o755)
    cli.environ["PATH"] = f"{bindir}:{cli.environ['PATH']}"
    return calls


@pytest.mark.parametrize("enabled", [True, False])
def test_schedule_remove_systemd_undoes_install_timer_included(cli: Cli, tmp_path: Path, enabled: bool) -> None:
    units = tmp_path / "units"
    units.mkdir()
    recipe = write(tmp_path / "r.yaml", "name: r\nsteps:\n  - name: s\n    verify: 'true'\n")
    inv = write(tmp_path / "i.yaml", "hosts:\n  h:\n    kind: local\n")
    assert cli("schedule", "install", recipe, "-i", inv, "--systemd", "--unit-dir", units).code == 0
    calls = _fake_systemctl(tmp_path, cli, enabled)
    r = cli("schedule", "remove", "--systemd", "--unit-dir", units)
    assert r.code == 0, r
    assert not list(units.iterdir())
    said = calls.read_text().splitlines() if calls.exists() else []
    if enabled:  # the timer `activate with:` enabled is stopped and disabled, and systemd forgets the units
        assert "disable --now fleetcuda-verify-nightly.timer" in said and said[-1] == "daemon-reload", said
        assert "stopped and disabled fleetcuda-verify-nightly.timer" in r.out
    else:
        assert not [c for c in said if c.startswith("disable")], said


def test_schedule_install_print_writes_nothing_and_units_pin_home_and_state(cli: Cli, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = write(tmp_path / "r.yaml", "name: r\nsteps:\n  - name: s\n    verify: 'true'\n")
    inv = write(tmp_path / "i.yaml", "hosts:\n  h:\n    kind: local\n")
    units = tmp_path / "units"
    units.mkdir()
    # No crontab on PATH: --print must not touch it (nor the state directory, nor the unit directory).
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    cron = cli("schedule", "install", recipe, "-i", inv, "--print")
    assert cron.code == 0, cron
    assert cron.out.startswith("would install into the crontab: 0 3 * * * ")
    assert f"HOME={tmp_path / 'home'} FLEETCUDA_STATE_DIR={cli.state} " in cron.out
    unit = cli("schedule", "install", recipe, "-i", inv, "--print", "--systemd", "--unit-dir", units)
    assert unit.code == 0, unit
    assert f"# would write {units / 'fleetcuda-verify-nightly.service'}" in unit.out
    assert f'Environment="HOME={tmp_path / "home"}"' in unit.out
    assert f'Environment="FLEETCUDA_STATE_DIR={cli.state}"' in unit.out
    assert "OnCalendar=*-*-* 03:00:00" in unit.out
    assert not list(units.iterdir()) and not cli.state.exists()


def test_schedule_puts_the_prometheus_file_where_node_exporter_reads_it(cli: Cli, tmp_path: Path) -> None:
    recipe = write(tmp_path / "r.yaml", "name: r\nsteps:\n  - name: s\n    verify: 'true'\n")
    inv = write(tmp_path / "i.yaml", "hosts:\n  h:\n    kind: local\n")
    textfiles = tmp_path / "node-exporter"
    textfiles.mkdir()
    r = cli("schedule", "install", recipe, "-i", inv, "--print", "--textfile-dir", textfiles)
    assert r.code == 0 and f"prometheus={textfiles / 'fleetcuda_nightly.prom'}" in r.out, r
    missing = cli("schedule", "install", recipe, "-i", inv, "--print", "--textfile-dir", tmp_path / "nope")
    assert missing.code == 2 and "--textfile-dir" in missing.err, missing


def test_an_unknown_key_says_the_exact_trust_command_and_trust_takes_several_hosts(sshd_lab: object,
                                                                                  tmp_path: Path) -> None:
    """Through the real CLI and the loopback sshd: verify on a host whose key is unknown prints the exact
    command; run as printed it records the key and verify connects; `trust A B` trusts both hosts in turn."""
    import os
    import shlex
    import sys

    from tests.test_ssh_trust import host_pub, inventory

    env = {**os.environ, "FLEETCUDA_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "200"}

    def run(*argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fleetcuda", *argv], capture_output=True, text=True, env=env,
                              cwd=ROOT, input=stdin, timeout=120)

    kh = tmp_path / "known_hosts"
    kh.write_text("")
    inv = inventory(sshd_lab, tmp_path / "inv.yaml", kh)  # type: ignore[arg-type]
    recipe = write(tmp_path / "r.yaml", "name: r\nsteps:\n  - name: s\n    verify: 'true'\n")
    first = run("verify", str(recipe), "-i", str(inv), "--plain")
    assert first.returncode == 3, first.stdout + first.stderr
    said = first.stdout + first.stderr
    command = f"fleetcuda trust -i {inv} target --fingerprint SHA256:"
    assert command in said, said
    line = said[said.index(command):].split()[:7]  # fleetcuda trust -i INV target --fingerprint FP
    fixed = run(*line[1:])
    assert fixed.returncode == 0 and "recorded in" in fixed.stdout, fixed.stdout + fixed.stderr
    again = run("verify", str(recipe), "-i", str(inv), "--plain")
    assert again.returncode == 0, again.stdout + again.stderr
    # Two hosts, one command: each key shown and confirmed in turn (on a terminal; here `script` gives one).
    kh2 = tmp_path / "kh2"
    text = inv.read_text().replace("  target:", "  a:").replace(str(kh), str(kh2))
    text += text.split("hosts:\n", 1)[1].replace("  a:", "  b:")
    two = write(tmp_path / "two.yaml", text)
    if shutil.which("script") is None:
        pytest.skip("needs script(1) for a terminal")
    cmd = shlex.join([sys.executable, "-m", "fleetcuda", "trust", "a", "b", "-i", str(two)])
    both = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, text=True, env=env, cwd=ROOT,
                          input="y\ny\n", timeout=120)
    assert both.returncode == 0, both.stdout + both.stderr
    assert both.stdout.count("recorded in") == 2 or "already trusted" in both.stdout, both.stdout
    assert host_pub(sshd_lab)[1] in kh2.read_text()  # type: ignore[arg-type]
