"""The lab's NVIDIA driver stand-ins (tests/lab/gpu_standin.py) fail the way the real parts do, here, outside the
lab: nvidia-smi without a driver, libraries that are real shared objects with NVIDIA's sonames and no CUDA."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO


def standin() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_standin_under_test", REPO / "tests" / "lab" / "gpu_standin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_nvidia_smi_standin_outside_a_lab_host_fails_as_without_a_driver(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(standin().SMI_STANDIN.replace("__LAB__", str(tmp_path / "lab")))
    smi.chmod(0o755)
    (tmp_path / "lab" / "hosts" / "a" / "driver").mkdir(parents=True)
    (tmp_path / "lab" / "hosts" / "a" / "driver" / "version").write_text("580.159.04\n")
    res = subprocess.run([str(smi), "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                         text=True)
    # This process is in no lab host's network namespace: no driver, as NVIDIA's nvidia-smi says it.
    assert res.returncode == 9
    assert res.stdout.startswith("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("ldconfig") is None and
                    not Path("/sbin/ldconfig").exists(), reason="needs gcc and ldconfig")
def test_the_library_standins_carry_nvidias_sonames_and_no_cuda(tmp_path: Path) -> None:
    built = standin().build_libs(tmp_path, "580.159.04")
    assert sorted(p.name for p in built.values()) == ["libcuda.so.580.159.04", "libnvidia-ml.so.580.159.04"]
    subprocess.run(["ldconfig", "-n", str(tmp_path)], check=True, env={"PATH": "/usr/sbin:/sbin:/usr/bin:/bin"})
    # ldconfig links the soname to the file, as on a host after the driver's installer.
    assert (tmp_path / "libcuda.so.1").resolve().name == "libcuda.so.580.159.04"
    assert (tmp_path / "libnvidia-ml.so.1").resolve().name == "libnvidia-ml.so.580.159.04"
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(built["libcuda.so"])], capture_output=True,
                             text=True).stdout
    assert "cuInit" not in symbols and "fleetcuda_lab_standin_not_a_driver" in symbols
