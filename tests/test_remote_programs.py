"""The programs fleetcuda sends to targets are real files of fleetcuda/remote/, sent exactly as they are:
listed once by name and digest, checked (Python through its own main(), shell with bash -n), and found
verbatim in every script that carries them."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fleetcuda import remote
from fleetcuda.plan.command import STOP_SCRIPT, stop_invocation
from fleetcuda.plan.inventory import load_inventory
from fleetcuda.plan.planner import base_values, batch_command, install_command, make_plan
from fleetcuda.plan.recipe import load_recipe
from fleetcuda.remote import framing
from fleetcuda.run import fingerprint
from fleetcuda.run.locks import TargetLock
from tests.conftest import REPO

PACKAGE = REPO / "fleetcuda" / "remote"
HEREDOC = re.compile(r"<<'FLEETCUDA_PY'\n(.*?)^FLEETCUDA_PY$", re.S | re.M)
EMITTER = re.compile(r"# >>> fleetcuda frame emitter\n.*?# <<< fleetcuda frame emitter\n", re.S)


def test_the_catalog_is_the_files_byte_for_byte() -> None:
    catalog = remote.catalog()
    assert set(catalog) == {"fingerprint", "import_check", "arch_patch", "doctor_probe", "fast_path_gate", "pyserver",
                            "gpu_passthrough", "gpu_container_probe", "detect_archs", "fetch", "lock", "stop",
                            "discover_probe"}
    for name, prog in catalog.items():
        filename, language = remote.PROGRAMS[name]
        assert prog.text == (PACKAGE / filename).read_text(), name
        assert prog.sha256 == hashlib.sha256(prog.text.encode()).hexdigest()
        assert prog.language == language == ("python" if filename.endswith(".py") else "bash")
    with pytest.raises(dataclasses.FrozenInstanceError):
        catalog["stop"].text = "rm -rf /"  # type: ignore[misc]
    with pytest.raises(KeyError, match="no remote program 'nope'"):
        remote.program("nope")


@pytest.mark.parametrize("name", [n for n, (_, lang) in remote.PROGRAMS.items() if lang == "bash"])
def test_shell_scripts_parse(name: str) -> None:
    path = PACKAGE / remote.PROGRAMS[name][0]
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    if shutil.which("shellcheck"):
        res = subprocess.run(["shellcheck", "-s", "bash", "-e", "SC2154", str(path)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout


def test_every_python_program_carries_the_one_emitter_or_none() -> None:
    canonical = EMITTER.search((PACKAGE / "emit.py").read_text())
    assert canonical is not None
    for filename, language in remote.PROGRAMS.values():
        if language != "python":
            continue
        text = (PACKAGE / filename).read_text()
        copies = EMITTER.findall(text)
        assert copies in ([], [canonical.group()]), f"{filename}: its emitter is not emit.py's"
        assert ("emit(" in text or "emit_json(" in text) == bool(copies), filename
        assert "def main(argv)" in text and 'sys.exit(main(sys.argv[1:]))' in text, filename


def test_the_fingerprint_program_and_the_control_side_agree_on_the_fields() -> None:
    prog = importlib.import_module("fleetcuda.remote.fingerprint")
    assert prog.FIELDS == fingerprint.FIELDS


def test_the_fingerprint_program_run_by_hand_records_and_reports_no_frame(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a nonce (a dry-run line pasted by hand) the build still records; what it prints is no report."""
    site = tmp_path / "site"
    for name, text in FAKE_SITE.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("FLEETCUDA_BUILD_RECORDS", str(tmp_path / "records"))
    monkeypatch.delenv("FLEETCUDA_NONCE", raising=False)
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    prog = importlib.import_module("fleetcuda.remote.fingerprint")
    try:
        assert prog.main(["record", "causal-conv1d", "1.7.0", "90", '{"source": "by hand"}']) == 0
        printed = json.loads(capsys.readouterr().out)
        assert prog.main(["compare", "causal-conv1d", "1.7.0", "90"]) == 0
        assert "causal-conv1d 1.7.0 was built for this ABI (torch 2.11.0+cu128" in capsys.readouterr().out
    finally:  # the fake torch must not stay imported for other tests
        for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
            del sys.modules[name]
    assert printed["torch"] == "2.11.0+cu128" and printed["nvcc"] == "none"
    [rec] = (tmp_path / "records").iterdir()
    assert json.loads(rec.read_text())["source"] == "by hand"
    assert fingerprint.parse(json.dumps(printed)) is None


def _plan(tmp_path: Path, python: str = "/opt/venv/bin/python"):  # type: ignore[no-untyped-def]
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  gpu-box:\n    kind: local\n    python: {python}\n")
    recipe, target = load_recipe(REPO / "recipes/gdn-fastpath.yaml"), load_inventory(inv).targets[0]
    values = base_values(recipe, target, {"cuda_version": "12.8", "max_jobs": "2", "python_xy": "3.11",
                                          "distro": "debian12", "cuda_archs": "90"})
    return make_plan(recipe, target, values, run_id="abcd1234", nonce="0123456789abcdef")


def _scripts(plan) -> list[str]:  # type: ignore[no-untyped-def]
    out = []
    for step in plan.steps:
        for cmd in (step.check, step.apply, step.verify):
            if cmd is not None:
                out.append(cmd.argv[-2])
        if step.shared is not None:
            out += [step.shared.fingerprint.argv[-2], step.shared.build.argv[-2],
                    install_command(plan.target, step, "/tmp/fleetcuda-wheel.abcdef/x.whl", "a" * 64, "{}",
                                    "{}").argv[-2]]
    return out


def test_every_inlined_program_is_the_catalog_text_exactly(tmp_path: Path) -> None:
    """What a dry run relies on: each heredoc body is one catalog text, whole, never a formatted variant."""
    plan = _plan(tmp_path)
    texts = {p.text: n for n, p in remote.catalog().items()}
    seen: set[str] = set()
    for script in _scripts(plan):
        for body in HEREDOC.findall(script):
            assert body in texts, body[:200]
            seen.add(texts[body])
    assert seen == {"fingerprint", "import_check", "arch_patch", "fast_path_gate", "gpu_passthrough"}
    sdist = next(s for s in plan.steps if s.name == "causal-conv1d")
    assert sdist.apply is not None and remote.program("detect_archs").text in sdist.apply.argv[-2]
    keyring = next(s for s in plan.steps if s.name == "cuda-keyring")
    assert keyring.apply is not None and remote.program("fetch").text in keyring.apply.argv[-2]
    # The programs' parameters are on their command lines (argv), not in their text.
    assert "- record causal-conv1d 1.7.0 \"$archs\"" in sdist.apply.argv[-2]


def test_lock_and_stop_scripts_are_sent_as_the_files(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    lock = TargetLock("me@box pid 1 since 2026-01-01T00:00:00Z machine m boot b start 1", wait_s=5)
    probes = [(s.index, s.pre_probe) for s in plan.steps if s.pre_probe is not None]
    batch = batch_command(plan, probes, lock).argv[-2]  # type: ignore[arg-type]
    assert batch.count(remote.program("lock").text) == 2  # acquire, then release if nothing is to change
    assert lock.acquire(7).endswith("fleetcuda_lock_acquire fleetcuda-apply-7 "
                                    "'me@box pid 1 since 2026-01-01T00:00:00Z machine m boot b start 1' 5 900")
    assert STOP_SCRIPT == remote.program("stop").text
    assert stop_invocation("fleetcuda:x@abcd1234").script.endswith(STOP_SCRIPT)


def test_lock_frames_are_the_shell_emitters() -> None:
    """lock.sh prints its frames as framing.frame does, so one parser reads them."""
    text = remote.program("lock").text
    for words in (("lock", "held"), ("lock", "busy", "$lockdir", "$holder"), ("lock", "stale", "$holder"),
                  ("lock", "$word")):
        assert framing.frame(*words) in text, words


def test_the_import_check_runs_through_its_main(capsys: pytest.CaptureFixture[str]) -> None:
    prog = importlib.import_module("fleetcuda.remote.import_check")
    pytest_version = importlib.metadata.version("pytest")
    assert prog.main([f"pytest=={pytest_version}", "json"]) == 0
    assert capsys.readouterr().out == f"pytest: {pytest_version}\n"
    assert prog.main(["pytest==0.0.1 no-such-dist", "json no_such_module"]) == 1
    out = capsys.readouterr().out
    assert f"pytest: found {pytest_version}, want 0.0.1" in out and "no-such-dist: not installed (want any)" in out
    assert "import no_such_module: ModuleNotFoundError" in out


def test_the_arch_patch_runs_through_its_main(tmp_path: Path) -> None:
    prog = importlib.import_module("fleetcuda.remote.arch_patch")
    setup = tmp_path / "setup.py"
    setup.write_text("ext_modules = []\n# arch=compute_90,code=sm_90\nsetup(\n)\n")
    assert prog.main([str(setup), "90"]) == 0
    assert "def _fleetcuda_keep_archs(args, keep=['90']):" in setup.read_text()
    with pytest.raises(SystemExit, match="does not build for sm_120"):
        prog.main([str(setup), "120"])


FAKE_SITE = {
    "torch/__init__.py": "__version__ = '2.11.0+cu128'\nfrom torch import _C, cuda, version\n",
    "torch/version.py": "cuda = '12.8'\n",
    "torch/_C.py": "_GLIBCXX_USE_CXX11_ABI = True\n",
    "torch/cuda.py": "def is_available():\n    return False\n",
    "transformers/__init__.py": "__version__ = '4.57.1'\n",
    "transformers/models/__init__.py": "",
    "transformers/models/qwen3_next/__init__.py": "",
    "transformers/models/qwen3_next/modeling_qwen3_next.py": "is_fast_path_available = False\n",
}


def fake_python(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / "site" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "site" / name).write_text(text)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} PYTHONDONTWRITEBYTECODE=1 exec {sys.executable} "
                      '"$@"\n')
    python.chmod(0o755)
    return python


def test_the_gate_reports_to_doctor_in_a_frame(tmp_path: Path) -> None:
    """Doctor runs the recipe's gate program (--gate-only) and reads its `gate` frame."""
    python = fake_python(tmp_path, FAKE_SITE)
    res = subprocess.run([str(python), "-", "--gate-only"], input=remote.program("fast_path_gate").text,
                         env={"PATH": "/usr/bin:/bin", "FLEETCUDA_NONCE": "0123456789abcdef",
                              "REQUIRE_TRANSFORMERS": "false"}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "skip transformers 4.57.1 modeling_qwen3_next: is_fast_path_available needs a GPU" in res.stdout
    [gate] = framing.read(res.stdout, "0123456789abcdef")
    assert isinstance(gate, framing.GateRecord)
    assert gate.report["modules"]["transformers.models.qwen3_next.modeling_qwen3_next"] == {
        "style": "flag", "is_fast_path_available": False}


def test_doctor_runs_its_probe_and_the_gate_in_one_round_trip(tmp_path: Path) -> None:
    from fleetcuda.run import doctor

    python = fake_python(tmp_path, FAKE_SITE)
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  box:\n    kind: local\n    python: {python}\n")
    target = load_inventory(inv).targets[0]
    cmd = doctor.command(target, str(tmp_path))
    assert "0123456789abcdef" not in " ".join(cmd.argv) and doctor._NONCE not in " ".join(cmd.argv)
    res = subprocess.run(list(cmd.argv), input=cmd.stdin, capture_output=True, text=True, timeout=120)
    report = doctor.parse(res.stdout)
    assert report["torch"]["version"] == "2.11.0+cu128", res.stdout + res.stderr
    assert report["transformers"]["version"] == "4.57.1"
    found = {f.check: f for f in doctor.findings(report)}
    assert found["transformers 4.57.1 modeling_qwen3_next"].value == "is_fast_path_available=False"
    assert found["transformers 4.57.1 modeling_qwen3_next"].status == "fail"
    assert found["causal_conv1d"].status == "fail" and "No module named 'causal_conv1d'" in found["causal_conv1d"].value
    assert doctor.parse("@@fleetcuda-doctor begin\n{}\n@@fleetcuda-doctor end\n")["error"].startswith(
        "no report from the target")


def test_a_planned_fingerprint_command_reports_through_the_plans_nonce(tmp_path: Path) -> None:
    """The shared build's fingerprint: its nonce on stdin (never the command line), its report in a frame that
    fingerprint.parse reads as the engine calls it (without a nonce)."""
    python = fake_python(tmp_path, FAKE_SITE)
    plan = _plan(tmp_path, str(python))
    [step] = [s for s in plan.steps if s.shared is not None]
    cmd = step.shared.fingerprint
    assert plan.nonce not in " ".join(cmd.argv) and cmd.stdin.startswith(plan.nonce + "\0")
    res = subprocess.run(list(cmd.argv), input=cmd.stdin, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    fp = fingerprint.parse(res.stdout)
    assert fp is not None and fp["torch"] == "2.11.0+cu128" and fp["archs"] == "90"
    assert fingerprint.parse(res.stdout.replace(plan.nonce, "fedcba9876543210")) is None  # not one of ours


def test_the_programs_ship_in_the_wheel(tmp_path: Path) -> None:
    # Built from a copy: setuptools leaves build/ and *.egg-info next to the sources.
    src, out = tmp_path / "src", tmp_path / "wheel"
    shutil.copytree(REPO / "fleetcuda", src / "fleetcuda", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(out), str(src)], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
                             capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    [whl] = out.glob("fleetcuda-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for filename, _ in remote.PROGRAMS.values():
        assert f"fleetcuda/remote/{filename}" in names, filename
    assert "fleetcuda/remote/emit.py" in names
