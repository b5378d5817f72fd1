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
