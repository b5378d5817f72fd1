"""Build once, install everywhere, against the lab: one causal-conv1d build per ABI fingerprint, the wheel brought
back to the control machine's cache and installed (pct push, no index) on every other target with that fingerprint.

The lab must be up (tests/run brings it up). Containers are reset to bare here.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_fleetcuda
from tests.test_lab_e2e import GDN, INV, PIP, TARGETS, ct, lab_is_up, reset, steps_with  # noqa: F401

pytestmark = pytest.mark.lab
RECORD = "/var/lib/fleetcuda/builds/causal-conv1d@root_venv.json"
BUILT = re.compile(r"^\S+ (\S+) causal-conv1d: changed \(built here and cached for fingerprint (\w+)", re.M)
INSTALLED = re.compile(r"^\S+ (\S+) causal-conv1d: changed \(installed the wheel built on (\S+) for fingerprint (\w+)",
                       re.M)


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("build-once")


def cache_entries(state: Path) -> list[dict]:
    out = run_fleetcuda("cache", "list", "--format", "json", state=state, check=True)
    return json.loads(out.stdout)["entries"]


def record(target: str) -> dict:
    return json.loads(ct(target, f"cat {RECORD}").stdout)


def run_log(out: subprocess.CompletedProcess[str], target: str) -> str:
    return (Path(out.stdout.split("logs: ")[-1].split()[0]) / (target.replace("/", "_") + ".log")).read_text()


def test_one_build_per_fingerprint_across_containers_and_hosts(state: Path) -> None:
    reset()
    # Host b (labops, through sudo): its two containers share one build; the wheel comes back through
    # `pct pull --user labops` and SFTP.
    first = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", "lab-b", state=state)
    assert first.returncode == 0, first.stdout
    built = BUILT.findall(first.stdout)
    assert len(built) == 1, first.stdout
    builder, key = built[0]
    installed = INSTALLED.findall(first.stdout)
    assert installed == [(t, builder, key) for t in ("lab-b/300", "lab-b/301") if t != builder]
    other = installed[0][0]
    assert "waiting for the build on " + builder in first.stdout
    # The build ran only where it was built: the stand-in's compile lines are in one log.
    assert "fleetcuda: building causal_conv1d-1.7.0.tar.gz" in run_log(first, builder)
    assert "fleetcuda: building causal_conv1d-1.7.0.tar.gz" not in run_log(first, other)

    [entry] = cache_entries(state)
    assert entry["status"] == "ok" and entry["built_on"] == builder and entry["key"] == key
    assert entry["fingerprint"]["torch"] == "2.11.0+cu128" and entry["fingerprint"]["nvcc"] == "12.8"
    assert entry["fingerprint"]["abi"] == "cpython-311-x86_64-linux-gnu" and entry["installs"] == 1
    wheel = Path(entry["path"]) / entry["wheel"]
    assert wheel.stat().st_mode & 0o777 == 0o600 and Path(entry["path"]).stat().st_mode & 0o777 == 0o700
    for target in ("lab-b/300", "lab-b/301"):
        rec = record(target)
        assert rec["fingerprint"] == entry["fingerprint"]
        assert (rec.get("wheel_sha256") or entry["sha256"]) == entry["sha256"]
        assert rec["source"] == ("built here" if target == builder else "control machine cache")
    # Host a's containers: a fingerprint the cache already has, so no build at all in this run.
    second = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", "lab-a", state=state)
    assert second.returncode == 0, second.stdout
    assert BUILT.findall(second.stdout) == []
    assert sorted(INSTALLED.findall(second.stdout)) == [("lab-a/200", builder, key), ("lab-a/201", builder, key)]
    for target in ("lab-a/200", "lab-a/201"):
        info = ct(target, "/root/venv/bin/python -c 'from causal_conv1d import _build_info as b; "
                          "print(b.TORCH_VERSION)'").stdout.strip()
        assert info == "2.11.0+cu128"
    assert cache_entries(state)[0]["installs"] == 3
    # The wheel went to host a once, for both of its containers.
    logs = [run_log(second, t) for t in ("lab-a/200", "lab-a/201")]
    assert sum(log.count(f"# uploaded {entry['wheel']} to lab-a:") for log in logs) == 1
    # No staging left anywhere: not on the hosts, not in the containers.
    assert not list(Path("/tmp").glob("fleetcuda-push.*"))
    for target in TARGETS:
        assert ct(target, "ls -d /tmp/fleetcuda-wheel.* /tmp/fleetcuda-build.* 2>/dev/null", check=False).stdout == ""
    assert run_fleetcuda("verify", GDN, "-i", INV, "--plain", state=state).returncode == 0


def test_a_stale_fingerprint_is_drift_and_apply_reinstalls_from_the_cache(state: Path) -> None:
    # As if the wheel had been built against an older torch than the one the venv has now.
    target = "lab-a/201"
    ct(target, f"sed -i 's/\"torch\": \"2.11.0+cu128\"/\"torch\": \"2.10.0+cu128\"/' {RECORD}")
    out = run_fleetcuda("verify", GDN, "-i", INV, "--plain", "--format", "json", state=state)
    assert out.returncode == 1
    report = json.loads(out.stdout)
    drift = {(t["target"], s["step"]): s for t in report["targets"] for s in t["checks"] if s["status"] == "drift"}
    assert set(drift) == {(target, "causal-conv1d")}, drift
    assert drift[(target, "causal-conv1d")]["found"] == (
        "stale build: causal-conv1d 1.7.0 was built for another ABI: torch 2.10.0+cu128 -> 2.11.0+cu128")

    fixed = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", target, state=state)
    assert fixed.returncode == 0, fixed.stdout
    assert steps_with("changed", fixed.stdout) == {(target, "causal-conv1d")}
    assert BUILT.findall(fixed.stdout) == [] and len(INSTALLED.findall(fixed.stdout)) == 1
    assert record(target)["fingerprint"]["torch"] == "2.11.0+cu128"
    assert run_fleetcuda("verify", GDN, "-i", INV, "--plain", "--limit", target, state=state).returncode == 0


def test_a_torch_upgrade_makes_the_build_stale(state: Path) -> None:
    target = "lab-b/301"
    ct(target, f"{PIP} --force-reinstall --no-deps torch==2.11.0+cu130")
    try:
        out = run_fleetcuda("verify", GDN, "-i", INV, "--plain", "--limit", target, state=state)
        assert out.returncode == 1
        assert (target, "causal-conv1d") in steps_with("drift", out.stdout)
        assert "torch 2.11.0+cu128 -> 2.11.0+cu130; torch_cuda 12.8 -> 13.0" in out.stdout
    finally:
        ct(target, f"{PIP} --force-reinstall --no-deps torch==2.11.0+cu128")


def test_each_fingerprint_builds_once_and_a_damaged_cache_entry_is_not_installed(state: Path,
                                                                                 tmp_path: Path) -> None:
    # Two fingerprints in one run: containers of host a build for sm_90 only, those of host b as upstream
    # says. The cached upstream wheel is damaged first: it must be rebuilt, not installed.
    [entry] = cache_entries(state)
    wheel = Path(entry["path"]) / entry["wheel"]
    wheel.write_bytes(wheel.read_bytes()[:-10])
    inventory = tmp_path / "lab-archs.yaml"
    text = Path(INV).read_text()
    inventory.write_text(text.replace("  lab-a:\n", "  lab-a:\n    vars:\n      cuda_archs: \"90\"\n", 1))
    for target in TARGETS:
        ct(target, "/root/venv/bin/pip uninstall -y -q causal-conv1d")
    out = run_fleetcuda("apply", GDN, "-i", str(inventory), "--plain", state=state)
    assert out.returncode == 0, out.stdout
    built = dict(BUILT.findall(out.stdout))
    assert len(built) == 2 and len(set(built.values())) == 2, out.stdout
    by_host = {t.split("/")[0]: t for t in built}
    assert set(by_host) == {"lab-a", "lab-b"}
    installs = INSTALLED.findall(out.stdout)
    assert sorted(t for t, _, _ in installs) == sorted(set(TARGETS) - set(built))
    for t, builder, key in installs:
        assert builder.split("/")[0] == t.split("/")[0] and built[builder] == key
    assert "cached wheel not used: " + entry["wheel"] + " has sha256" in run_log(out, by_host["lab-b"])
    archs = "/root/venv/bin/python -c 'from causal_conv1d import _build_info as b; print(b.ARCHS)'"
    assert ct("lab-a/201", archs).stdout.strip() == "['sm_90']"
    assert ct("lab-b/300", archs).stdout.strip() != "['sm_90']"
    entries = cache_entries(state)
    assert sorted(e["fingerprint"]["archs"] for e in entries) == ["90", "upstream"]
    assert all(e["status"] == "ok" for e in entries)


def test_cache_prune(state: Path) -> None:
    entries = cache_entries(state)
    broken = Path(entries[0]["path"]) / "provenance.json"
    broken.write_text("{")
    dry = run_fleetcuda("cache", "prune", "--dry-run", state=state, check=True)
    assert f"would remove {broken.parent}: broken: provenance.json is unreadable" in dry.stdout
    assert broken.exists()
    pruned = run_fleetcuda("cache", "prune", state=state, check=True)
    assert "1 entry removed" in pruned.stdout and not broken.parent.exists()
    assert len(cache_entries(state)) == 1
    kept = run_fleetcuda("cache", "prune", "--older-than", "1", state=state, check=True)
    assert "0 entries removed" in kept.stdout
    run_fleetcuda("cache", "prune", "--all", state=state, check=True)
    assert cache_entries(state) == []
    table = run_fleetcuda("cache", "list", state=state, check=True)
    assert "no wheels cached in" in table.stdout


def test_without_sharing_every_target_builds(state: Path) -> None:
    for target in ("lab-b/300", "lab-b/301"):
        ct(target, "/root/venv/bin/pip uninstall -y -q causal-conv1d")
    out = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", "lab-b", "--var", "share_builds=false",
                        state=state)
    assert out.returncode == 0, out.stdout
    assert BUILT.findall(out.stdout) == [] and INSTALLED.findall(out.stdout) == []
    assert steps_with("changed", out.stdout) == {("lab-b/300", "causal-conv1d"), ("lab-b/301", "causal-conv1d")}
    for target in ("lab-b/300", "lab-b/301"):
        assert "fleetcuda: building causal_conv1d-1.7.0.tar.gz" in run_log(out, target)
    assert cache_entries(state) == []


def test_when_the_awaited_build_fails_each_target_builds_for_itself(state: Path) -> None:
    # sm_89 is not offered by causal-conv1d's setup.py: the build fails wherever it runs.
    for target in ("lab-b/300", "lab-b/301"):
        ct(target, "/root/venv/bin/pip uninstall -y -q causal-conv1d")
    out = run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", "lab-b", "--var", "cuda_archs=89",
                        state=state)
    assert out.returncode == 1
    logs = {t: run_log(out, t) for t in ("lab-b/300", "lab-b/301")}
    alone = [t for t, text in logs.items() if "gave no wheel" in text]
    assert len(alone) == 1, out.stdout
    [builder] = set(logs) - set(alone)
    assert f"# the build on {builder} gave no wheel (the build failed on {builder}); building here" in logs[alone[0]]
    for text in logs.values():
        assert "setup.py does not build for sm_89" in text
    assert cache_entries(state) == []
    assert run_fleetcuda("apply", GDN, "-i", INV, "--plain", "--limit", "lab-b", state=state).returncode == 0
