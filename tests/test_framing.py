"""One framing protocol for everything a remote program reports, read by one parser into typed records, and
a target's own output (a version string, a path, a check's output) can never forge one of them: not without
the nonce, and not with it either."""

from __future__ import annotations

import importlib
import json
import os
import secrets
import subprocess
from pathlib import Path

import pytest

from fleetcuda.plan.command import Invocation, quote
from fleetcuda.plan.inventory import load_inventory
from fleetcuda.remote import framing
from fleetcuda.run import doctor, fingerprint
from fleetcuda.run.locks import TargetLock, lock_state
from tests.test_remote_programs import FAKE_SITE, _plan, fake_python

NONCE = "0123456789abcdef"
OTHER = "fedcba9876543210"
FP = {"package": "causal-conv1d", "version": "1.7.0", "python": "3.11", "abi": "cpython-311-x86_64-linux-gnu",
      "platform": "linux-x86_64", "glibc": "2.36", "torch": "2.11.0+cu128", "torch_cuda": "12.8", "cxx11_abi": "1",
      "nvcc": "12.8", "archs": "upstream"}


def forged(kind: str, nonce: str, *fields: str) -> str:
    return f"\n@@fleetcuda:{nonce} {kind} {' '.join(fields)}\n"


@pytest.fixture
def emitter(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FLEETCUDA_NONCE", NONCE)
    emit = importlib.reload(importlib.import_module("fleetcuda.remote.emit"))
    assert emit.take_nonce() == NONCE and "FLEETCUDA_NONCE" not in os.environ  # no subprocess inherits it
    return emit


def test_the_python_emitter_writes_what_the_parser_reads(emitter, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    print("partial line without a newline", end="")
    emitter.emit_json("fingerprint", FP)
    emitter.emit("wheel", "/tmp/fleetcuda-wheel.Ab12Cd/x.whl", "a" * 64)
    out = capsys.readouterr().out
    assert framing.read(out, NONCE) == [framing.FingerprintRecord(FP),
                                        framing.WheelRecord("/tmp/fleetcuda-wheel.Ab12Cd/x.whl", "a" * 64)]
    assert framing.read(out, OTHER) == []


@pytest.mark.parametrize("nonce", [NONCE, OTHER])
def test_a_value_that_mimics_a_frame_stays_a_value(emitter, capsys: pytest.CaptureFixture[str], nonce: str) -> None:  # type: ignore[no-untyped-def]
    """A package version string holding a whole frame (this run's nonce or another's), or a path with spaces."""
    evil = {**FP, "torch": "2.11" + forged("wheel", nonce, "/tmp/fleetcuda-wheel.Ab12Cd/evil.whl", "b" * 64)
            + forged("fingerprint", nonce, json.dumps({**FP, "torch": "forged"})),
            "platform": "linux x86_64\u2028| @@fleetcuda:" + nonce + " done 0"}
    emitter.emit_json("fingerprint", evil)
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1
    assert framing.read(out, NONCE) == [framing.FingerprintRecord(evil)]
    assert fingerprint.parse(out, NONCE)["torch"] == evil["torch"]  # type: ignore[index]
    assert fingerprint.parse_wheel(out, NONCE) is None


def test_the_emitter_refuses_a_field_that_could_split(emitter) -> None:  # type: ignore[no-untyped-def]
    for bad in ("two words", "line\nbreak", "", "tab\t"):
        with pytest.raises(ValueError, match="frame field"):
            emitter.emit("wheel", bad, "x")


def test_without_a_nonce_a_program_reports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEETCUDA_NONCE", raising=False)
    emit = importlib.reload(importlib.import_module("fleetcuda.remote.emit"))
    emit.take_nonce()
    with pytest.raises(SystemExit, match="no frame nonce"):
        emit.emit("done", "0")


def test_a_checks_output_cannot_forge_a_frame_even_with_the_nonce() -> None:
    """The shell side: what runs inside a frame is payload, every line prefixed, whatever nonce it names."""
    forgery = f"hi{forged('end', NONCE, '0', '0', '0')}@@fleetcuda:{NONCE} done 1"
    script = "\n".join([
        framing.frame("begin", "0"),
        f"printf '%s' {quote(forgery)} | {framing.PAYLOAD}",
        framing.frame("end", "0", "1", "5"),
        framing.frame("done", "1"),
    ])
    out = subprocess.run(["bash", "-c", f"fcn={NONCE}\n{script}"], capture_output=True, text=True, check=True).stdout
    records = framing.read(out, NONCE)
    assert records == [framing.CheckBegin(0, forgery), framing.CheckEnd(0, 1, 5), framing.Done(1)]


def test_malformed_frames_are_no_records() -> None:
    lines = [f"@@fleetcuda:{NONCE} {rest}" for rest in (
        "end x 0 0", "end 0 0", "begin", "done many", "fingerprint {not json", "fingerprint [1]",
        f"fingerprint {json.dumps({**FP, 'torch': 2}, separators=(',', ':'))}", "wheel onlypath", "doctor {} {}",
        "unknown 1", "fact")]
    assert framing.read("\n".join(lines), NONCE) == []
    # An rc that is not a number is a failure, not a pass.
    assert framing.read(f"@@fleetcuda:{NONCE} end 3 ? 7", NONCE) == [framing.CheckEnd(3, 255, 7)]


def test_without_a_nonce_only_this_processs_nonces_count() -> None:
    mine = framing.new_nonce()
    stranger = secrets.token_hex(8)
    text = json.dumps(FP, separators=(",", ":"))
    assert fingerprint.parse(forged("fingerprint", mine, text)) == FP
    assert fingerprint.parse(forged("fingerprint", stranger, text)) is None
    assert fingerprint.parse(f"| @@fleetcuda:{mine} fingerprint {text}") is None


def test_the_nonce_goes_on_stdin_only_to_scripts_that_frame() -> None:
    plain = Invocation("echo hi")
    assert framing.with_nonce(plain, NONCE) is plain
    framed = framing.with_nonce(Invocation(framing.frame("done", "0"), secret_vars={"fcs_0": "s3cret"}), NONCE)
    assert framed.secret_vars == {"fcn": NONCE, "fcs_0": "s3cret"} and framed.stdin == f"{NONCE}\0s3cret\0"
    assert NONCE not in framed.full_script()


def test_a_fake_torch_cannot_forge_a_wheel_or_a_fingerprint(tmp_path: Path) -> None:
    """Through the planned command: torch's version holds this run's nonce and a whole wheel frame; at import it
    prints frames with a guessed nonce. Only the program's own report is read, with the version as a value."""
    python = fake_python(tmp_path, {**FAKE_SITE})
    plan = _plan(tmp_path, str(python))
    version = "2.11.0" + forged("wheel", plan.nonce, "/tmp/fleetcuda-wheel.Ab12Cd/evil.whl", "c" * 64)
    (tmp_path / "site/torch/__init__.py").write_text(
        f"__version__ = {version!r}\n"
        f"print({forged('fingerprint', OTHER, json.dumps(FP, separators=(',', ':')))!r})\n"
        "from torch import _C, cuda, version\n")
    [step] = [s for s in plan.steps if s.shared is not None]
    cmd = step.shared.fingerprint
    res = subprocess.run(list(cmd.argv), input=cmd.stdin, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    fp = fingerprint.parse(res.stdout)
    assert fp is not None and fp["torch"] == version and fp["archs"] == "90"
    assert fingerprint.parse_wheel(res.stdout) is None


def test_doctor_believes_its_own_frames_only(tmp_path: Path) -> None:
    """torch's version string carries a doctor frame with doctor's own nonce; transformers prints one at import."""
    version = "2.11.0" + forged("doctor", doctor._NONCE, json.dumps({"torch": {"version": "forged"}}))
    python = fake_python(tmp_path, {
        **FAKE_SITE,
        "torch/__init__.py": f"__version__ = {version!r}\nfrom torch import _C, cuda, version\n",
        "transformers/__init__.py": f"__version__ = '4.57.1'\nprint({forged('gate', OTHER, '{}')!r})\n"})
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  box:\n    kind: local\n    python: {python}\n")
    cmd = doctor.command(load_inventory(inv).targets[0], str(tmp_path))
    res = subprocess.run(list(cmd.argv), input=cmd.stdin, capture_output=True, text=True, timeout=120)
    doctors = [r for r in framing.read(res.stdout, doctor._NONCE) if isinstance(r, framing.DoctorRecord)]
    assert len(doctors) == 1, res.stdout
    report = doctor.parse(res.stdout)
    assert report["torch"]["version"] == version
    assert report["transformers"]["version"] == "4.57.1"


def test_a_lock_owner_file_cannot_forge_a_lock_state(tmp_path: Path) -> None:
    """The holder's name is said in the lock's own frame, one sanitised line: a second line naming this run's
    nonce (`released`) is not a frame."""
    vmid = 900000000 + secrets.randbelow(99999999)  # a lock nobody else uses
    lock = TargetLock("me@box pid 1 since 2026-01-01T00:00:00Z machine m boot b start 1", wait_s=0)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = ["bash", "-c", f"IFS= read -r -d '' fcn\n{lock.acquire(vmid)}"]
    held = subprocess.run(run, input=NONCE + "\0", env=env, capture_output=True, text=True, timeout=30)
    assert lock_state(framing.parse(held.stdout, NONCE)) == ("held", [])
    try:
        lockdir = next(p for p in (Path("/run/lock"), Path("/run"), tmp_path / ".cache")
                       if (p / f"fleetcuda-apply-{vmid}").is_dir() or (p / f"fleetcuda-apply-{vmid}.lock").is_dir())
        owner = next(lockdir.glob(f"fleetcuda-apply-{vmid}*")) / "owner"
        owner.write_text(f"intruder{forged('lock', NONCE, 'released')}")
        other = TargetLock("someone else", wait_s=0)
        busy = subprocess.run(["bash", "-c", f"IFS= read -r -d '' fcn\n{other.acquire(vmid)}"], input=NONCE + "\0",
                              env=env, capture_output=True, text=True, timeout=30)
        assert busy.returncode == 75
        assert [r.state for r in framing.read(busy.stdout, NONCE)] == ["busy"]
        word, fields = lock_state(framing.parse(busy.stdout, NONCE))
        assert word == "busy" and fields[1:] == ["intruder"]
    finally:
        subprocess.run(["bash", "-c", f"IFS= read -r -d '' fcn\n{lock.release(vmid)}"], input=NONCE + "\0", env=env,
                       capture_output=True, text=True, timeout=30)
        for p in (Path("/run/lock"), Path("/run"), tmp_path / ".cache"):
            for d in p.glob(f"fleetcuda-apply-{vmid}*"):
                subprocess.run(["rm", "-rf", "--", str(d)], check=False)


def test_records_are_frozen() -> None:
    [rec] = framing.read(f"@@fleetcuda:{NONCE} lock held", NONCE)
    with pytest.raises(AttributeError):
        rec.state = "released"  # type: ignore[misc]
