"""Build once per ABI fingerprint, without the lab: the program that reads a target's fingerprint (run by a real
Python against a torch stand-in), the control machine's wheel cache, and the broker that lets one target build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fleetcuda.run import fingerprint
from fleetcuda.run.wheelcache import BuildBroker, CacheEntry, Problem, WheelCache
from tests.conftest import run_fleetcuda

PY = f"{sys.version_info[0]}.{sys.version_info[1]}"
FP = {"package": "causal-conv1d", "version": "1.7.0", "python": "3.11", "abi": "cpython-311-x86_64-linux-gnu",
      "platform": "linux-x86_64", "glibc": "2.36", "torch": "2.11.0+cu128", "torch_cuda": "12.8", "cxx11_abi": "1",
      "nvcc": "12.8", "archs": "upstream"}


@pytest.fixture
def target_env(tmp_path: Path) -> dict[str, str]:
    """A torch stand-in and an nvcc that prints what NVIDIA's prints, for the fingerprint program."""
    torch = tmp_path / "site" / "torch"
    torch.mkdir(parents=True)
    (torch / "__init__.py").write_text("__version__ = '2.11.0+cu128'\nfrom torch import _C, version\n")
    (torch / "version.py").write_text("cuda = '12.8'\n")
    (torch / "_C.py").write_text("_GLIBCXX_USE_CXX11_ABI = True\n")
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    nvcc.chmod(0o755)
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "site"), "CUDA_HOME": str(tmp_path / "cuda"),
            "PYTHONDONTWRITEBYTECODE": "1",  # torch is rewritten within the second: no stale .pyc
            "FLEETCUDA_BUILD_RECORDS": str(tmp_path / "records")}


NONCE = "0123456789abcdef"


def program(env: dict[str, str], mode: str, *args: str, archs: str = "upstream") -> subprocess.CompletedProcess[str]:
    """The program as it is sent: its text on stdin, the nonce in its environment."""
    return subprocess.run([sys.executable, "-", mode, "causal-conv1d", "1.7.0", archs, *args],
                          input=fingerprint.TARGET_PROGRAM, env={**env, "FLEETCUDA_NONCE": NONCE},
                          capture_output=True, text=True, timeout=60)


def test_the_target_program_reads_the_fingerprint(target_env: dict[str, str]) -> None:
    out = program(target_env, "show", archs="90")
    assert out.returncode == 0, out.stderr
    fp = fingerprint.parse(out.stdout, NONCE)
    assert fp is not None
    assert fp["torch"] == "2.11.0+cu128" and fp["torch_cuda"] == "12.8" and fp["cxx11_abi"] == "1"
    assert fp["nvcc"] == "12.8" and fp["archs"] == "90"  # the release, not the patch build
    assert fp["python"] == PY and fp["abi"].startswith("cpython-")
    no_nvcc = program({**target_env, "CUDA_HOME": "/nonexistent"}, "show")
    assert fingerprint.parse(no_nvcc.stdout, NONCE)["nvcc"] == "none"  # type: ignore[index]


def test_record_then_compare_names_what_changed(target_env: dict[str, str], tmp_path: Path) -> None:
    assert program(target_env, "compare").stdout.startswith("no build record for causal-conv1d here")
    assert program(target_env, "record", json.dumps({"source": "built here"})).returncode == 0
    [rec] = (tmp_path / "records").iterdir()
    assert rec.stat().st_mode & 0o777 == 0o600
    assert json.loads(rec.read_text())["source"] == "built here"
    same = program(target_env, "compare")
    assert same.returncode == 0 and "was built for this ABI (torch 2.11.0+cu128" in same.stdout
    # torch upgraded under the built extension
    (tmp_path / "site" / "torch" / "__init__.py").write_text("__version__ = '2.12.0+cu130'\nfrom torch import _C, "
                                                             "version\n")
    (tmp_path / "site" / "torch" / "version.py").write_text("cuda = '13.0'\n")
    stale = program(target_env, "compare")
    assert stale.returncode == 1
    assert stale.stdout.strip() == ("stale build: causal-conv1d 1.7.0 was built for another ABI: "
                                    "torch 2.11.0+cu128 -> 2.12.0+cu130; torch_cuda 12.8 -> 13.0")


def test_a_wheel_for_another_fingerprint_is_refused_before_install(target_env: dict[str, str]) -> None:
    assert program(target_env, "matches", json.dumps(fingerprint.parse(program(target_env, "show").stdout, NONCE)))\
        .returncode == 0
    other = {**FP, "nvcc": "13.0", "python": PY}
    out = program(target_env, "matches", json.dumps(other))
    assert out.returncode == 1 and "the wheel was built for another ABI than this target's" in out.stderr
    assert "nvcc 13.0 -> 12.8" in out.stderr


def test_every_field_is_part_of_the_key() -> None:
    base = fingerprint.key(FP)
    assert fingerprint.key(dict(reversed(list(FP.items())))) == base
    for field in fingerprint.FIELDS:
        assert fingerprint.key({**FP, field: FP[field] + "x"}) != base, field


def test_parsing_takes_only_well_formed_frames_with_the_nonce() -> None:
    good = f"@@fleetcuda:{NONCE} fingerprint {json.dumps(FP, separators=(',', ':'))}"
    assert fingerprint.parse(f"noise\n{good}\n", NONCE) == FP
    assert fingerprint.parse(good, "fedcba9876543210") is None  # another run's
    assert fingerprint.parse(f"@@fleetcuda-fingerprint {json.dumps(FP)}", NONCE) is None  # the old marker
    assert fingerprint.parse(f"@@fleetcuda:{NONCE} fingerprint {{not json", NONCE) is None
    assert fingerprint.parse(f"@@fleetcuda:{NONCE} fingerprint {json.dumps({**FP, 'torch': None})}", NONCE) is None
    sha = "a" * 64
    kept = "/tmp/fleetcuda-wheel.Ab12Cd/causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl"
    assert fingerprint.parse_wheel(f"x\n@@fleetcuda:{NONCE} wheel {kept} {sha}\n", NONCE) == (kept, sha)
    assert fingerprint.parse_wheel(f"@@fleetcuda:{NONCE} wheel {kept} abc", NONCE) is None
    assert fingerprint.parse_wheel(f"| @@fleetcuda:{NONCE} wheel {kept} {sha}", NONCE) is None  # a payload line
    # The directory is removed afterwards: a line that names anything but the build's own is not taken.
    for elsewhere in ("/usr/lib/x.whl", "/tmp/fleetcuda-wheel.Ab12Cd/../../usr/x.whl", "/tmp/w/c.whl"):
        assert fingerprint.parse_wheel(f"@@fleetcuda:{NONCE} wheel {elsewhere} {sha}", NONCE) is None, elsewhere


def _wheel(tmp_path: Path, name: str = "causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl") -> Path:
    path = tmp_path / "in" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(os.urandom(4096))
    return path


def test_the_cache_stores_privately_and_refuses_a_damaged_wheel(tmp_path: Path) -> None:
    cache = WheelCache(tmp_path / "cache")
    assert cache.lookup(FP) is None
    entry = cache.store(_wheel(tmp_path), FP, {"built_on": "lab-a/200"})
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
    assert entry.wheel.stat().st_mode & 0o777 == 0o600 and (entry.path / "provenance.json").stat().st_mode & 0o777 \
        == 0o600
    found = cache.lookup(FP)
    assert isinstance(found, CacheEntry) and found.sha256 == entry.sha256 and found.provenance["built_on"] == \
        "lab-a/200"
    assert cache.lookup({**FP, "torch": "2.12.0"}) is None
    entry.wheel.write_bytes(entry.wheel.read_bytes()[:100])
    damaged = cache.lookup(FP)
    assert isinstance(damaged, Problem) and "not the recorded" in damaged.why
    # Storing again replaces the broken entry.
    assert isinstance(cache.lookup(FP), Problem)
    cache.store(_wheel(tmp_path), FP, {"built_on": "lab-b/300"})
    again = cache.lookup(FP)
    assert isinstance(again, CacheEntry) and again.provenance["built_on"] == "lab-b/300"


def test_prune_removes_broken_then_old_then_all(tmp_path: Path) -> None:
    cache = WheelCache(tmp_path / "cache")
    keep = cache.store(_wheel(tmp_path), FP, {})
    old = cache.store(_wheel(tmp_path), {**FP, "archs": "90"}, {})
    broken = cache.store(_wheel(tmp_path), {**FP, "archs": "120"}, {})
    (broken.path / "provenance.json").unlink()
    leftover = cache.incoming()
    data = json.loads((old.path / "provenance.json").read_text())
    data["last_used"] = "2020-01-01T00:00:00Z"
    (old.path / "provenance.json").write_text(json.dumps(data))

    would = cache.prune(dry_run=True)
    assert {p for p, _ in would} == {broken.path, leftover} and broken.path.exists()
    assert {p for p, _ in cache.prune()} == {broken.path, leftover}
    assert not broken.path.exists() and not leftover.exists()
    assert [p for p, _ in cache.prune(older_than_days=30)] == [old.path]
    assert [e.path for e in cache.entries()] == [keep.path]  # type: ignore[union-attr]
    assert [p for p, _ in cache.prune(everything=True)] == [keep.path]
    assert cache.entries() == []


def test_one_target_builds_the_others_wait_then_install(tmp_path: Path) -> None:
    cache = WheelCache(tmp_path / "cache")
    broker = BuildBroker(cache)
    roles: dict[str, str] = {}
    waited: list[str] = []

    def target(name: str) -> None:
        turn = broker.turn(FP, name, lambda: False, on_wait=waited.append)
        roles[name] = turn.role
        if turn.role == "build":
            time.sleep(0.5)  # the others must be waiting by now
            wheel = _wheel(tmp_path, f"w-{name.replace('/', '-')}.whl")
            broker.finished(FP, cache.store(wheel, FP, {"built_on": name}), name)

    threads = [threading.Thread(target=target, args=(f"h/{i}",), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    builders = [n for n, r in roles.items() if r == "build"]
    assert len(builders) == 1 and sorted(roles.values()).count("install") == 5
    assert set(waited) == set(builders) and len(waited) == 5
    # Another fingerprint is built on its own, not waited for.
    assert broker.turn({**FP, "torch": "2.12.0"}, "h/9", lambda: False).role == "build"


def test_waiters_build_for_themselves_when_the_build_gives_no_wheel(tmp_path: Path) -> None:
    broker = BuildBroker(WheelCache(tmp_path / "cache"))
    assert broker.turn(FP, "h/0", lambda: False).role == "build"
    results: list[str] = []
    waiter = threading.Thread(target=lambda: results.append(broker.turn(FP, "h/1", lambda: False).note), daemon=True)
    waiter.start()
    time.sleep(0.3)
    broker.finished(FP, None, "h/0", "the build failed on h/0")
    waiter.join(5)
    assert results == ["the build on h/0 gave no wheel (the build failed on h/0); building here"]
    cancelled = threading.Event()
    assert broker.turn({**FP, "archs": "90"}, "h/2", cancelled.is_set).role == "build"
    cancelled.set()
    assert broker.turn({**FP, "archs": "90"}, "h/3", cancelled.is_set).role == "cancelled"


def test_the_install_of_a_cached_wheel_runs_as_its_own_step() -> None:
    """The install command is planned whole, but for the run-time values it reads from shell variables: it must
    carry its own step's label, timeout and environment, and the wheel it is given."""
    from fleetcuda.plan.inventory import load_inventory
    from fleetcuda.plan.planner import base_values, install_command, make_plan
    from fleetcuda.plan.recipe import load_recipe

    recipe = load_recipe("recipes/gdn-fastpath.yaml")
    [target] = load_inventory("inventories/lab.yaml").select("lab-a/200")
    plan = make_plan(recipe, target, base_values(recipe, target, {}))
    [step] = [s for s in plan.steps if s.shared is not None]
    install = install_command(target, step, "/tmp/fleetcuda-wheel.abcdef/x.whl", "a" * 64, json.dumps(FP), "{}")
    assert "fc_wheel=/tmp/fleetcuda-wheel.abcdef/x.whl" in install.display and "a" * 64 in install.display
    assert step.name == "causal-conv1d" and install.label == step.apply.label == "fleetcuda:causal-conv1d"
    assert "timeout -k 10 7200" in install.display and "MAX_JOBS=2" in install.display
    assert "CAUSAL_CONV1D_FORCE_BUILD=TRUE" in install.display and "CUDA_HOME=/usr/local/cuda-12.8" in install.display


def test_dry_run_shows_the_wheel_build_and_share_builds_false_the_old_install(tmp_path: Path) -> None:
    args = ("apply", "recipes/gdn-fastpath.yaml", "-i", "inventories/lab.yaml", "--limit", "lab-a/200", "--dry-run",
            "--format", "shell")
    shared = run_fleetcuda(*args, state=tmp_path, check=True).stdout
    assert "pip wheel --disable-pip-version-check --no-input --no-build-isolation --no-cache-dir --no-deps" in shared
    assert "@@fleetcuda:${fcn} wheel $whl $sha" in shared and "stale=" in shared
    assert "causal-conv1d (sdist_build): fingerprint (read-only, if the check fails" in shared
    alone = run_fleetcuda(*args, "--var", "share_builds=false", state=tmp_path, check=True).stdout
    assert "pip wheel" not in alone and "wheel $whl" not in alone
    assert "--no-build-isolation --no-cache-dir --no-deps --force-reinstall" in alone


def test_cache_commands_on_an_empty_and_a_filled_cache(tmp_path: Path) -> None:
    assert "no wheels cached in" in run_fleetcuda("cache", "list", state=tmp_path, check=True).stdout
    cache = WheelCache(tmp_path / "wheel-cache")  # where run_fleetcuda points FLEETCUDA_CACHE_DIR
    entry = cache.store(_wheel(tmp_path), FP, {"built_on": "lab-a/200", "built_at": "2026-11-30T00:00:00Z"})
    listing = json.loads(run_fleetcuda("cache", "list", "--format", "json", state=tmp_path, check=True).stdout)
    [row] = listing["entries"]
    assert row["sha256"] == entry.sha256 and row["built_on"] == "lab-a/200" and row["fingerprint"] == FP
    table = run_fleetcuda("cache", "list", state=tmp_path, check=True).stdout
    assert entry.key in table and "lab-a/200" in table
    bad = run_fleetcuda("cache", "prune", "--older-than", "-1", state=tmp_path)
    assert bad.returncode == 2 and "--older-than" in bad.stderr
