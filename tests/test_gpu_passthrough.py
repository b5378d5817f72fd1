"""The GPU passthrough check (fleetcuda/remote/gpu_passthrough.py) through its main(), with a stand-in /proc
version file, container config and container probe output; and its container probe (gpu_container_probe.sh)
run for real on this GPU-less machine."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import stat
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from fleetcuda import remote
from fleetcuda.remote import framing
from tests.conftest import REPO

PACKAGE = REPO / "fleetcuda" / "remote"
DRIVER = "580.159.04"
PROC = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {v}  Release Build  (dvs-builder@U22-I3-AF03-09-1)"
        "  Thu Oct 16 10:51:49 UTC 2025\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14+deb12u1)\n")
PVE_DEV = ("arch: amd64\ncores: 8\ndev0: /dev/nvidia0,gid=44\ndev1: /dev/nvidiactl\ndev2: /dev/nvidia-uvm\n"
           "hostname: train-a0\nmemory: 16384\n")
PVE_CGROUP = ("arch: amd64\nlxc.cgroup2.devices.allow: c 195:* rwm\nlxc.cgroup2.devices.allow: c 508:* rwm\n"
              "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n"
              "lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file\n"
              "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file\n")
PVE_NONE = "arch: amd64\ncores: 4\nhostname: train-b1\n"


def libs(version: str) -> str:
    d = "/usr/lib/x86_64-linux-gnu"
    return "".join(f"lib {n} {how} {d}/{n}.1 {d}/{n}.{version}\n" for n in ("libcuda.so", "libnvidia-ml.so")
                   for how in ("ldconfig", "file"))


NODES_OK = ("node /dev/nvidiactl char 195:255 ok\nnode /dev/nvidia-uvm char 508:0 ok\n"
            "node /dev/nvidia0 char 195:0 ok\n")


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_passthrough_under_test", PACKAGE / "gpu_passthrough.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Host:
    """A stand-in host: its /proc version file (or none), a container config, what the container probe prints."""

    def __init__(self, root: Path):
        self.root = root
        self.proc = root / "proc-driver-nvidia-version"
        self.proc.write_text(PROC.format(v=DRIVER))
        self.conf = root / "200.conf"
        self.conf.write_text(PVE_DEV)
        self.probe = root / "probe.out"
        self.probe.write_text(libs(DRIVER) + NODES_OK)

    def run(self, capsys: pytest.CaptureFixture[str], *extra: str, container: bool = True,
            cuda: str = "13.0") -> tuple[int, list[str]]:
        argv = ["--container-probe", json.dumps(["cat", str(self.probe)]), "--proc-version", str(self.proc),
                "--cuda-version", cuda, *extra]
        if container:
            # Like `pct config 200`: the vmid is its last word.
            argv += ["--pct-config", json.dumps(["sh", "-c", f"cat {self.conf}", "200"])]
        rc = load().main(argv)
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
        return rc, lines


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path)


def test_a_matching_container_passes_and_says_what_it_found(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    rc, lines = host.run(capsys)
    assert rc == 0, lines
    assert f"ok   host driver {DRIVER} (from {host.proc})" in lines
    assert "ok   the container's libcuda.so is 580.159.04" in lines
    assert "ok   /dev/nvidia0: char 195:0, opens read-write" in lines
    assert "info config: dev0: /dev/nvidia0,gid=44" in lines
    assert "ok   host driver 580.159.04 supports CUDA 13.0" in lines
    assert lines[-1] == ("ok   host driver 580.159.04, the container: libcuda.so 580.159.04, libnvidia-ml.so "
                         "580.159.04, CUDA 13.0 supported")


def test_cgroup_and_mount_lines_are_passthrough_too(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    host.conf.write_text(PVE_CGROUP)
    rc, lines = host.run(capsys)
    assert rc == 0, lines
    assert "ok   container 200's config passes 3 NVIDIA device nodes through" in lines


def test_a_host_driver_upgrade_is_a_mismatch_that_says_what_to_do(host: Host,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    host.probe.write_text(libs("575.57.08") + NODES_OK)
    rc, lines = host.run(capsys)
    assert rc == 1
    assert lines[-1] == (
        "FAIL host driver 580.159.04 but the container's libcuda.so is 575.57.08: the host driver was upgraded; "
        "reinstall the container's NVIDIA user-space libraries at exactly 580.159.04 (the same driver .run with "
        "--no-kernel-module, or the distro's packages of that version), then restart the container")
    assert any(ln.startswith("FAIL host driver 580.159.04 but the container's libnvidia-ml.so is 575.57.08")
               for ln in lines)


def test_missing_libraries(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    host.probe.write_text(NODES_OK)
    rc, lines = host.run(capsys)
    assert rc == 1
    assert lines[-1].startswith("FAIL the container has no libcuda.so (the NVIDIA user-space driver libraries): "
                                "install the container's NVIDIA user-space libraries at exactly 580.159.04")


def test_a_missing_node(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    host.probe.write_text(libs(DRIVER) + NODES_OK.replace("node /dev/nvidia-uvm char 508:0 ok",
                                                          "node /dev/nvidia-uvm absent"))
    rc, lines = host.run(capsys)
    assert rc == 1
    assert lines[-1] == ("FAIL /dev/nvidia-uvm: not in the container (ENOENT): pass it through in the container's "
                         "config, then restart the container")


def test_a_node_the_cgroup_denies(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    host.probe.write_text(libs(DRIVER) + NODES_OK.replace("195:0 ok", "195:0 Operation not permitted"))
    rc, lines = host.run(capsys)
    assert rc == 1
    assert lines[-1].startswith("FAIL /dev/nvidia0: char 195:0 present but opening it is denied (EPERM): the "
                                "container's device cgroup does not allow it")
    host.probe.write_text(libs(DRIVER) + NODES_OK.replace("195:0 ok", "195:0 Permission denied"))
    rc, lines = host.run(capsys)
    assert rc == 1 and "(EACCES)" in lines[-1]


def test_a_node_without_a_driver_behind_it(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    host.probe.write_text(libs(DRIVER) + NODES_OK.replace("195:0 ok", "195:0 No such device or address"))
    rc, lines = host.run(capsys)
    assert rc == 1
    assert lines[-1] == ("FAIL /dev/nvidia0: char 195:0 present but no driver behind it (ENXIO): the host's NVIDIA "
                         "kernel module is not loaded (modprobe nvidia nvidia-uvm, or reboot after a driver upgrade)")
    # Not required (a machine without a GPU, like the lab): said, and the verdict does not count it.
    rc, lines = host.run(capsys, "--require-devices", "false")
    assert rc == 0, lines
    assert any(ln.startswith("info /dev/nvidia0: char 195:0 present but no driver behind it (ENXIO)")
               and ln.endswith("(not required: --require-devices false)") for ln in lines)


def test_a_driver_too_old_for_cuda_13(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    host.proc.write_text(PROC.format(v="575.57.08"))
    host.probe.write_text(libs("575.57.08") + NODES_OK)
    rc, lines = host.run(capsys)
    assert rc == 1
    assert lines[-1].startswith("FAIL host driver 575.57.08 is too old for CUDA 13.0 (CUDA 13.x needs 580.65.6 or "
                                "newer, a 580-series driver): upgrade the host's driver")
    rc, lines = host.run(capsys, cuda="12.8")
    assert rc == 0, lines
    assert "ok   host driver 575.57.08 supports CUDA 12.8" in lines
    host.proc.write_text(PROC.format(v="550.54.14"))
    host.probe.write_text(libs("550.54.14") + NODES_OK)
    rc, lines = host.run(capsys, cuda="12.8")
    assert rc == 0  # minor version compatibility: it runs, with a warning
    assert any(ln.startswith("WARN host driver 550.54.14 runs CUDA 12.8 through minor version compatibility")
               for ln in lines)


def test_no_passthrough_lines(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    host.conf.write_text(PVE_NONE)
    rc, lines = host.run(capsys)
    assert rc == 1
    assert lines[-1].startswith("FAIL container 200 has no GPU passthrough in its config: add `dev0: /dev/nvidia0`")
    host.conf.write_text("lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n")
    rc, lines = host.run(capsys)
    assert rc == 1 and "its device cgroup does not allow them" in lines[-1]
    # A machine without containers has no config to read: not asked for.
    rc, lines = host.run(capsys, container=False)
    assert rc == 0 and lines[-1].startswith("ok   host driver 580.159.04, this machine: libcuda.so 580.159.04")


def test_the_driver_from_nvidia_smi_when_proc_has_none(host: Host, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = host.root / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho {DRIVER}\necho {DRIVER}\n")
    smi.chmod(0o755)
    host.proc.unlink()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    rc, lines = host.run(capsys)
    assert rc == 0, lines
    assert f"ok   host driver {DRIVER} (from nvidia-smi)" in lines
    # nvidia-smi without a loaded driver, as NVIDIA's says it.
    smi.write_text("#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
                   " Make sure that the latest NVIDIA driver is installed and running.\"\nexit 9\n")
    rc, lines = host.run(capsys)
    assert rc == 1
    assert lines[-1].startswith("FAIL the host's NVIDIA driver does not answer (nvidia-smi: NVIDIA-SMI has failed")
    smi.unlink()
    rc, lines = host.run(capsys)
    assert rc == 1 and "nvidia-smi is not installed" in lines[-1]


def test_it_reports_one_gpu_frame_given_a_nonce(host: Host, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    nonce = framing.new_nonce()
    monkeypatch.setenv("FLEETCUDA_NONCE", nonce)
    load().main(["--container-probe", json.dumps(["cat", str(host.probe)]), "--proc-version", str(host.proc),
                 "--pct-config", json.dumps(["sh", "-c", f"cat {host.conf}", "200"]), "--cuda-version", "13.0"])
    assert "FLEETCUDA_NONCE" not in os.environ
    found = [r for r in framing.read(capsys.readouterr().out, nonce) if isinstance(r, framing.GpuRecord)]
    assert len(found) == 1
    assert found[0].report["driver"] == DRIVER and found[0].report["ok"] is True
    assert found[0].report["libs"] == {"libcuda.so": DRIVER, "libnvidia-ml.so": DRIVER}


def test_the_container_probe_on_this_gpu_less_machine() -> None:
    """The probe for real: no /dev/nvidia* here, which it says; it creates nothing."""
    res = subprocess.run(["bash", str(PACKAGE / "gpu_container_probe.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    assert res.returncode == 0, res.stderr
    if not Path("/dev/nvidia0").exists():
        assert "node /dev/nvidia0 absent" in res.stdout.splitlines()
        assert not Path("/dev/nvidia0").exists()
    assert "'" not in remote.program("gpu_container_probe").text  # the dry run finds it in a JSON argument


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_the_container_probe_sees_nodes_without_a_driver_as_enxio(tmp_path: Path) -> None:
    """Real NVIDIA device numbers on a machine without NVIDIA's driver: opening them fails ENXIO, as on a host
    whose module is not loaded. (A private mount namespace with its own /dev.)"""
    script = ("mount -t tmpfs none /dev && mknod /dev/nvidia0 c 195 0 && mknod /dev/nvidiactl c 195 255 && "
              f"touch /dev/nvidia-uvm && exec bash {PACKAGE / 'gpu_container_probe.sh'}")
    res = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True)
    if res.returncode != 0 and "mount" in res.stderr:
        pytest.skip(f"no private mount namespace here: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "node /dev/nvidia0 char 195:0 No such device or address" in lines
    assert "node /dev/nvidiactl char 195:255 No such device or address" in lines
    assert "node /dev/nvidia-uvm other regular-empty-file" in lines
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)  # the machine's own /dev is untouched


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit, match="--container-probe is required"):
        load().main(["--cuda-version", "13.0"])
    with pytest.raises(SystemExit, match="is a JSON list of words"):
        load().main(["--container-probe", '"cat"'])


def test_doctor_runs_it_on_the_host_and_says_what_it_found(tmp_path: Path) -> None:
    from fleetcuda.plan.inventory import load_inventory
    from fleetcuda.run import doctor

    inv = tmp_path / "i.yaml"
    inv.write_text("hosts:\n  pve:\n    address: 10.0.0.1\n    user: ops\n    sudo: true\n    containers:\n"
                   "      200: {venv: /root/venv}\n      201: {venv: /root/venv, vars: {check_gpu: false}}\n"
                   "  box:\n    kind: local\n")
    with_gpu, without, local = load_inventory(inv).targets
    cmd = doctor.gpu_command(with_gpu, "13.0")
    assert cmd is not None and cmd.argv[:2] == ("/usr/bin/env", "-i")  # on the host: no pct exec around it
    assert '"sudo", "-n", "--", "/usr/sbin/pct", "config", "200"' in cmd.argv[-2]
    assert doctor.gpu_command(without, "13.0") is None  # check_gpu: false
    # A machine without containers: the check for real, here (no NVIDIA driver on this machine, or the H200's).
    cmd = doctor.gpu_command(local, "13.0")
    assert cmd is not None
    res = subprocess.run(list(cmd.argv), input=cmd.stdin, capture_output=True, text=True, timeout=120)
    found = {f.check: f for f in doctor.gpu_findings(doctor.gpu_report(res.stdout))}
    if Path("/proc/driver/nvidia/version").exists():
        assert found["host NVIDIA driver"].status == "ok"
    else:
        assert found["host NVIDIA driver"].status == "fail" and found["GPU passthrough"].status == "fail"
        assert found["libcuda.so"].value == "missing"
    report = {"driver": DRIVER, "libs": {"libcuda.so": "575.57.08", "libnvidia-ml.so": "575.57.08"},
              "failures": ["host driver 580.159.04 but the container's libcuda.so is 575.57.08: ..."]}
    found = {f.check: f for f in doctor.gpu_findings(report)}
    assert (found["libcuda.so"].value, found["libcuda.so"].status) == ("575.57.08", "fail")
    assert found["GPU passthrough"].value.startswith("host driver 580.159.04 but")
    assert doctor.gpu_report("no frames")["error"].startswith("the GPU passthrough check did not report")


def lib_lines(version: str, flags: str, d: str = "/usr/lib/x86_64-linux-gnu", real: str | None = None) -> str:
    """The probe's ldconfig lines for both libraries: `name.1` in `d`, resolving to `real` or `name.version`."""
    return "".join(f"lib {n} ldconfig {d}/{n}.1 {real or f'{d}/{n}.{version}'} {flags}\n"
                   for n in ("libcuda.so", "libnvidia-ml.so"))


def test_the_loaders_abi_is_judged_not_an_i386_copy_listed_first() -> None:
    mod = load()
    entries = mod.parse_probe(lib_lines("575.57.08", "libc6", "/usr/lib/i386-linux-gnu")
                              + lib_lines(DRIVER, "libc6,x86-64,OSABI:Linux3.2.0"))[0]["libcuda.so"]
    assert mod.lib_version("libcuda.so", entries, machine="x86_64") == (DRIVER, ["575.57.08", DRIVER], None)
    # The loader takes the first entry of its ABI, however many follow.
    entries = mod.parse_probe(lib_lines("575.57.08", "libc6,x86-64") + lib_lines(DRIVER, "libc6,x86-64",
                                                                                  "/opt/z"))[0]["libcuda.so"]
    assert mod.lib_version("libcuda.so", entries, machine="x86_64")[0] == "575.57.08"


def test_a_dangling_loader_link_fails_though_a_stale_copy_is_right(host: Host,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    arch = load().LDCONFIG_ARCH.get(platform.machine(), "x")
    host.probe.write_text(lib_lines(DRIVER, f"libc6,{arch}", real="dangling") + libs(DRIVER).replace(
        "ldconfig", "file").replace("/usr/lib/x86_64-linux-gnu", "/usr/local/nvidia/lib64") + NODES_OK)
    rc, lines = host.run(capsys)
    assert rc == 1, lines
    assert lines[-1] == ("FAIL the container's libcuda.so.1, the one the loader uses, is /usr/lib/x86_64-linux-gnu/"
                         "libcuda.so.1, a dangling link: the file it points to no longer exists (also found: "
                         f"{DRIVER}): run ldconfig there, or reinstall the container's NVIDIA user-space libraries "
                         f"at exactly {DRIVER} (the same driver .run with --no-kernel-module, or the distro's "
                         "packages of that version), then restart the container")
    host.probe.write_text(lib_lines(DRIVER, f"libc6,{arch}", real="absent") + NODES_OK)
    rc, lines = host.run(capsys)
    assert rc == 1 and any("listed by ldconfig but not there (a stale ldconfig cache)" in ln for ln in lines), lines


def test_the_probe_says_a_dangling_link_and_keeps_ldconfigs_order(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "libcuda.so.1").symlink_to("libcuda.so.580.65.06")  # its target is gone
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "libcuda.so.575.57.08").write_text("")
    (tmp_path / "z" / "libcuda.so.1").symlink_to("libcuda.so.575.57.08")
    ldconfig = tmp_path / "bin" / "ldconfig"
    ldconfig.write_text("#!/bin/sh\ncat <<'EOF'\n"
                        f"\tlibcuda.so.1 (libc6,x86-64, OS ABI: Linux 3.2.0) => {tmp_path}/z/libcuda.so.1\n"
                        f"\tlibcuda.so.1 (libc6,x86-64) => {tmp_path}/a/libcuda.so.1\n"
                        f"\tlibcuda.so.1 (libc6) => {tmp_path}/gone/libcuda.so.1\nEOF\n")
    ldconfig.chmod(0o755)
    res = subprocess.run(["bash", str(PACKAGE / "gpu_container_probe.sh")], capture_output=True, text=True,
                         env={"PATH": f"{tmp_path}/bin:/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert [ln for ln in res.stdout.splitlines() if ln.startswith("lib libcuda.so ldconfig ")] == [
        f"lib libcuda.so ldconfig {tmp_path}/z/libcuda.so.1 {tmp_path}/z/libcuda.so.575.57.08 "
        "libc6,x86-64,OSABI:Linux3.2.0",
        f"lib libcuda.so ldconfig {tmp_path}/a/libcuda.so.1 dangling libc6,x86-64",
        f"lib libcuda.so ldconfig {tmp_path}/gone/libcuda.so.1 absent libc6"]


def test_dev_entries_by_default_key_or_path_key() -> None:
    conf = ("dev0: path=/dev/nvidia0,gid=44\ndev1: mode=0666,path=/dev/nvidiactl\ndev2: /dev/nvidia-uvm,uid=0\n"
            "dev3: /dev/dri/card0\ndev4: gid=44\n")
    lines, paths, _ = load().passthrough(conf)
    assert paths == {"/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"}
    assert lines == conf.splitlines()[:3]


def test_a_cuda_version_of_a_major_only_is_checked(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    rc, lines = host.run(capsys, cuda="13")
    assert rc == 0 and f"ok   host driver {DRIVER} supports CUDA 13" in lines, lines
    host.proc.write_text(PROC.format(v="575.57.08"))
    host.probe.write_text(libs("575.57.08") + NODES_OK)
    rc, lines = host.run(capsys, cuda="13")
    assert rc == 1
    assert lines[-1].startswith("FAIL host driver 575.57.08 is too old for CUDA 13 (CUDA 13.x needs 580.65.6")


@pytest.mark.parametrize("cuda", ["thirteen", "cu130", "13.x", "13."])
def test_a_cuda_version_it_cannot_read_fails(host: Host, capsys: pytest.CaptureFixture[str], cuda: str) -> None:
    rc, lines = host.run(capsys, cuda=cuda)
    assert rc == 1
    assert lines[-1] == (f"FAIL CUDA version {cuda!r} cannot be read, so whether the driver supports it is unknown: "
                         "give it as torch and nvcc name it, X.Y (12.8) or X (13)")


def test_no_cuda_version_is_not_checked_and_passes(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    rc, lines = host.run(capsys, cuda="")
    assert rc == 0
    assert "info CUDA version not given: whether the driver supports it is not checked" in lines


def test_the_step_refuses_an_unreadable_cuda_version_at_plan_time(tmp_path: Path) -> None:
    from fleetcuda.errors import InputError
    from tests.test_host_steps import LOCAL, plan_for

    with pytest.raises(InputError, match="cuda_version 'cu130' is not a CUDA version") as err:
        plan_for(tmp_path, LOCAL, "  - name: gpu\n    kind: gpu_passthrough\n    cuda_version: cu130\n")
    assert err.value.line == 3
    plan_for(tmp_path, LOCAL, "  - name: gpu\n    kind: gpu_passthrough\n    cuda_version: '13'\n")
