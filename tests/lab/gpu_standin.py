"""Lab stand-ins for NVIDIA's driver, for the GPU passthrough check (fleetcuda/remote/gpu_passthrough.py).

The lab machine has no GPU and no NVIDIA driver: no /proc/driver/nvidia/version, no kernel module behind major
195. What stands in, failing the way the real parts fail:

- the host's driver: /usr/local/bin/nvidia-smi, a stand-in named so in its output. Inside a lab host's network
  namespace it answers `--query-gpu=driver_version` from LAB/hosts/<host>/driver/version (one line per GPU, as
  NVIDIA's does); with no such file, and anywhere else on this machine, it fails as nvidia-smi does when no
  driver is loaded (exit 9, "couldn't communicate with the NVIDIA driver"). Any other query fails the same way:
  nothing else of a driver is stood in. The product reads /proc/driver/nvidia/version first and falls back to
  nvidia-smi, as on any host whose /proc has no NVIDIA entry; nothing in it knows about the lab.
- the container's user-space libraries: real ELF shared objects libcuda.so.<version> and
  libnvidia-ml.so.<version> with NVIDIA's sonames (libcuda.so.1, libnvidia-ml.so.1), registered with ldconfig in
  each running container, as the driver's .run with --no-kernel-module leaves them. They export no CUDA symbol:
  anything that calls into them fails, as a library without its kernel module would.
- device nodes: none. The lab's containers have no /dev/nvidia*, and a node made here would not open (ENXIO:
  no driver behind major 195). So the lab sets `gpu_devices_required: false` (inventories/lab.yaml): the check
  says what it found of the nodes but does not require them; the driver, the libraries and the container
  configs' passthrough lines (read by the pct stand-in's `pct config`) are checked for real.

    install(hosts)   # from labctl up: the nvidia-smi stand-in, each host's driver version, the containers' libs
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

LAB = Path(os.environ.get("FLEETCUDA_LAB_ROOT", "/var/lib/fleetcuda-lab"))
NVIDIA_SMI = Path("/usr/local/bin/nvidia-smi")
DRIVER = "580.159.04"  # the H200 machine's driver, so that the lab and that machine agree
LIB_DIR = "/usr/lib/x86_64-linux-gnu"
LIBS = {"libcuda.so": "libcuda.so.1", "libnvidia-ml.so": "libnvidia-ml.so.1"}

SMI_STANDIN = '''#!/usr/bin/python3
"""nvidia-smi (fleetcuda lab stand-in, tests/lab/gpu_standin.py): the driver version of the lab host whose
network namespace this runs in, from LAB/hosts/<host>/driver/version; elsewhere, or for any other query, it fails
as NVIDIA's nvidia-smi does without a loaded driver."""
import os
import sys
from pathlib import Path

LAB = Path("__LAB__")
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
             "latest NVIDIA driver is installed and running.")


def host():
    mine = os.stat("/proc/self/ns/net").st_ino
    for d in sorted((LAB / "hosts").glob("*")):
        try:
            if os.stat(Path("/run/netns") / f"fclab-{d.name}").st_ino == mine:
                return d
        except OSError:
            continue
    return None


def main(argv):
    d = host()
    version = d / "driver" / "version" if d is not None else None
    if version is None or not version.is_file() or argv != ["--query-gpu=driver_version", "--format=csv,noheader"]:
        print(NO_DRIVER)
        return 9
    lines = [ln.strip() for ln in version.read_text().splitlines() if ln.strip()]
    for line in lines[1:] or lines:  # one line per GPU; the file: the version, then optionally one line per GPU
        print(lines[0])
    return 0


sys.exit(main(sys.argv[1:]))
'''

STUB_C = ("/* fleetcuda lab stand-in for NVIDIA's %s: a shared object with its soname and no CUDA in it. */\n"
          "int fleetcuda_lab_standin_not_a_driver(void) { return 0; }\n")


def run(*argv: str | Path, input: bytes | None = None) -> None:
    proc = subprocess.run([str(a) for a in argv], input=input, capture_output=True)
    if proc.returncode != 0:
        said = (proc.stdout + proc.stderr).decode(errors="replace")
        raise SystemExit(f"gpu_standin: {' '.join(map(str, argv))} failed ({proc.returncode}):\n{said}")


def install_smi() -> None:
    NVIDIA_SMI.parent.mkdir(parents=True, exist_ok=True)
    NVIDIA_SMI.write_text(SMI_STANDIN.replace("__LAB__", str(LAB)))
    NVIDIA_SMI.chmod(0o755)


def set_driver(host: str, version: str | None) -> None:
    """A lab host's driver version (None: no driver); what an upgrade on the host changes."""
    path = LAB / "hosts" / host / "driver" / "version"
    if version is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(version + "\n")


def build_libs(out: Path, version: str) -> dict[str, Path]:
    """ELF stubs named like the driver's files, with its sonames."""
    made = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, soname in LIBS.items():
            src = Path(tmp) / f"{name}.c"
            src.write_text(STUB_C % name)
            lib = out / f"{name}.{version}"
            run("gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", lib, src)
            made[name] = lib
    return made


def install_libs(netns: str, lxcpath: Path, vmid: int, version: str, built: dict[str, Path]) -> None:
    """Into a running container, as NVIDIA's installer leaves them: the files, then ldconfig's links."""
    attach = ["nsenter", f"--net=/run/netns/{netns}", "lxc-attach", "-P", str(lxcpath), "-n", str(vmid), "--"]
    for name, lib in built.items():
        dest = f"{LIB_DIR}/{name}.{version}"
        # Older stand-ins of another version go: a reinstall replaces them, as the driver's installer does.
        run(*attach, "sh", "-c", f"rm -f {LIB_DIR}/{name}.[0-9]* && cat > {dest}.tmp && chmod 0755 {dest}.tmp "
                                 f"&& mv {dest}.tmp {dest}", input=lib.read_bytes())
    run(*attach, "ldconfig")


def install_base(base: Path, version: str, built: dict[str, Path]) -> None:
    """Into the containers' shared base image too, so that a container reset to bare (labctl reset empties its
    overlay) still has them, as a Proxmox template made with the driver's libraries would."""
    for name, lib in built.items():
        dest = base / LIB_DIR.lstrip("/") / f"{name}.{version}"
        for old in dest.parent.glob(f"{name}.[0-9]*"):
            old.unlink()
        dest.write_bytes(lib.read_bytes())
        dest.chmod(0o755)
    run("chroot", base, "/sbin/ldconfig")


def install(hosts: list, version: str = DRIVER) -> None:
    """From labctl up: each host's driver at `version`, the same libraries in its containers' base image and in
    each of its running containers."""
    install_smi()
    with tempfile.TemporaryDirectory() as tmp:
        built = build_libs(Path(tmp), version)
        for base in sorted({host.base for host in hosts}):
            install_base(base, version, built)
        for host in hosts:
            set_driver(host.name, version)
            for vmid in host.running:
                install_libs(host.netns, host.dir / "lxc", vmid, version, built)
