"""The GPU passthrough check against the lab: the real CLI, real SSH to the lab hosts, `pct config` and
`pct exec` of the pct stand-in, and the NVIDIA driver's stand-ins (tests/lab/gpu_standin.py: nvidia-smi per lab
host, the libraries in the containers; no device nodes, so the lab sets gpu_devices_required: false).

    sudo tests/lab/labctl.py up      # installs the stand-ins (and the pve configs `pct config` reads)
    pytest tests/test_lab_gpu_passthrough.py

Read-only, but for one lab host's stand-in driver version, changed to show a host upgrade and put back.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO, run_fleetcuda
from tests.test_lab_e2e import INV, LAB, lab_is_up  # noqa: F401  (lab_is_up: autouse fixture)

GDN = "recipes/gdn-fastpath.yaml"
RECIPE = """\
name: gpu
vars:
  cuda_version: "12.8"
  check_gpu: true
  gpu_devices_required: true
steps:
  - name: gpu-passthrough
    kind: gpu_passthrough
    when: check_gpu
    cuda_version: "{{ cuda_version }}"
    require_devices: "{{ gpu_devices_required }}"
"""
DRIVER = "580.159.04"

pytestmark = pytest.mark.lab


def standin() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_standin", REPO / "tests" / "lab" / "gpu_standin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "gpu.yaml"
    path.write_text(RECIPE)
    return path


def verify(recipe: Path, state: Path, limit: str, *extra: str) -> tuple[int, dict[str, dict]]:
    out = run_fleetcuda("verify", str(recipe), "-i", INV, "--limit", limit, "--format", "json", "--no-history",
                        *extra, state=state)
    checks = {t["target"]: t["checks"][0] for t in json.loads(out.stdout)["targets"]}
    return out.returncode, checks


def test_containers_with_passthrough_pass_against_the_standin_driver(recipe: Path, state: Path) -> None:
    rc, checks = verify(recipe, state, "lab-a/200,lab-a/201,lab-b/300")
    assert rc == 0, checks
    for target, check in checks.items():
        assert check["status"] == "ok", (target, check)
        assert check["found"] == (f"ok   host driver {DRIVER}, the container: libcuda.so {DRIVER}, libnvidia-ml.so "
                                  f"{DRIVER}, CUDA 12.8 supported"), target
        assert check["expected"].startswith("host driver = the container's libcuda/libnvidia-ml version")


def test_the_container_without_passthrough_fails_and_says_what_to_add(recipe: Path, state: Path) -> None:
    rc, checks = verify(recipe, state, "lab-b/301", "--var", "check_gpu=true")
    assert rc != 0
    check = checks["lab-b/301"]
    assert check["status"] == "drift"
    assert check["found"].startswith("FAIL container 301 has no GPU passthrough in its config: add "
                                     "`dev0: /dev/nvidia0`")
    # The nodes: said, not required here (the lab has no GPU), and truthfully absent.
    assert any("/dev/nvidia0: not in the container (ENOENT)" in ln and "(not required" in ln
               for ln in check["output_tail"])


def test_device_nodes_required_fail_in_the_gpu_less_lab(recipe: Path, state: Path) -> None:
    rc, checks = verify(recipe, state, "lab-a/200", "--var", "gpu_devices_required=true")
    assert rc != 0
    assert checks["lab-a/200"]["found"].startswith("FAIL /dev/nvidia")
    assert "(ENOENT)" in checks["lab-a/200"]["found"]


def test_a_host_driver_upgrade_is_drift_with_what_to_do(recipe: Path, state: Path) -> None:
    gpu = standin()
    gpu.set_driver("a", "590.44.01")
    try:
        rc, checks = verify(recipe, state, "lab-a/200")
    finally:
        gpu.set_driver("a", DRIVER)
    assert rc != 0
    check = checks["lab-a/200"]
    assert check["status"] == "drift"
    assert check["found"] == (
        "FAIL host driver 590.44.01 but the container's libcuda.so is 580.159.04: the host driver was upgraded; "
        "reinstall the container's NVIDIA user-space libraries at exactly 590.44.01 (the same driver .run with "
        "--no-kernel-module, or the distro's packages of that version), then restart the container")


def test_the_flagship_recipe_runs_it_early_on_the_host(state: Path) -> None:
    out = run_fleetcuda("apply", GDN, "-i", INV, "--limit", "lab-b/300", "--dry-run", "--format", "json", state=state,
                        check=True)
    (target,) = json.loads(out.stdout)["targets"]
    names = [s["name"] for s in target["steps"]]
    assert names[:3] == ["preflight", "gpu-passthrough", "host-toolchain"]
    gpu = target["steps"][1]
    assert gpu["runs_on"] == "host" and gpu["scripts"]["verify"]["runs_on"] == "host"
    # lab-b's user reaches pct through sudo -n; the host step itself runs as that user.
    assert '"sudo", "-n", "--", "/usr/sbin/pct", "config", "300"' in gpu["scripts"]["verify"]["script"]


def test_doctor_shows_the_driver_and_the_libraries(state: Path) -> None:
    out = run_fleetcuda("doctor", "-i", INV, "--limit", "lab-b/300", "--format", "json", state=state)
    findings = {f["check"]: f for f in json.loads(out.stdout)["lab-b/300"]["findings"]}
    assert findings["host NVIDIA driver"] == {"check": "host NVIDIA driver", "value": DRIVER, "status": "ok"}
    assert findings["libcuda.so"]["value"] == DRIVER and findings["libcuda.so"]["status"] == "ok"
    assert findings["GPU passthrough"]["status"] == "ok"
