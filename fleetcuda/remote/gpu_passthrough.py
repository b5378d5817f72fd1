"""Whether a container can use the host's NVIDIA GPUs, run on the host by the recipe's `gpu_passthrough` step
(`on: host`) and by `fleetcuda doctor`. Read-only.

    python3 - --container-probe JSON [--pct-config JSON] [--cuda-version X.Y|X] [--require-devices true|false]

- the host's driver version: /proc/driver/nvidia/version, else `nvidia-smi --query-gpu=driver_version`;
- the container config's passthrough lines, from the argv `--pct-config` gives (`[sudo -n] pct config VMID`;
  absent for a machine without containers): `devN: /dev/nvidia...` (or `devN: path=/dev/nvidia...`) entries,
  or `lxc.cgroup2.devices.allow` with `lxc.mount.entry` binds;
- what the container sees, from the argv `--container-probe` gives (gpu_container_probe.sh inside the
  container, through `[sudo -n] pct exec VMID -- env -i ... bash -c`): libcuda.so / libnvidia-ml.so, judged by
  the `.1` the dynamic loader uses (the first `ldconfig -p` entry for this machine's ABI; a dangling link is
  broken, not a version), and each /dev/nvidia* node: present, a character device, openable;
- whether the driver supports the CUDA version torch and nvcc use (`--cuda-version`; one it cannot read fails).

Each line says `ok`, `FAIL`, `WARN`, `info` or `unknown` (what could not be looked at, with why: never
reported as missing); the last line is the verdict, with what to do when it fails.
Exit status 0 only if the host driver equals the container's libraries, the nodes open (unless
--require-devices false), the config passes the nodes through (for containers) and the driver supports the
CUDA version. Given a frame nonce (FLEETCUDA_NONCE), it also reports its findings as one `gpu` frame.
"""

import json
import os
import platform
import re
import shutil
import subprocess
import sys

PROC_VERSION = "/proc/driver/nvidia/version"
NVIDIA_MAJOR = 195  # /dev/nvidia0.. and /dev/nvidiactl; nvidia-uvm's major is given out at load time
LIBS = ("libcuda.so", "libnvidia-ml.so")
# The word `ldconfig -p` puts in an entry's flags for this machine's own ABI (`libc6,x86-64`): the loader of a
# 64-bit program takes the first entry of a soname with it, never an i386 copy. Unknown machines: any entry.
LDCONFIG_ARCH = {"x86_64": "x86-64", "aarch64": "AArch64"}
CUDA_VERSION = re.compile(r"(\d+)(?:\.(\d+)(?:\.\d+)?)?")
# NVIDIA's table of toolkit and driver versions (Linux x86_64): the oldest driver of a CUDA major (minor
# version compatibility), and the driver each minor release shipped with (its full support).
MAJOR_MIN = {12: (525, 60, 13), 13: (580, 65, 6)}
MINOR_FULL = {(12, 0): (525, 60, 13), (12, 1): (530, 30, 2), (12, 2): (535, 54, 3), (12, 3): (545, 23, 6),
              (12, 4): (550, 54, 14), (12, 5): (555, 42, 2), (12, 6): (560, 28, 3), (12, 8): (570, 26),
              (12, 9): (575, 51, 3), (13, 0): (580, 65, 6)}
ERRNO = {"No such file or directory": "ENOENT", "Permission denied": "EACCES", "Operation not permitted": "EPERM",
         "No such device or address": "ENXIO", "No such device": "ENODEV"}
REINSTALL = ("reinstall the container's NVIDIA user-space libraries at exactly {v} (the same driver .run with "
             "--no-kernel-module, or the distro's packages of that version), then restart the container")


# >>> fleetcuda frame emitter
_NONCE = ""


def take_nonce():
    """Read (and remove from the environment) the nonce the shell gave this program."""
    global _NONCE
    _NONCE = os.environ.pop("FLEETCUDA_NONCE", "")
    return _NONCE


def emit(kind, *fields):
    """Print one frame line `@@fleetcuda:<nonce> <kind> <fields...>`. No field holds whitespace, so nothing a
    field carries (a version string, a path) can start a line of its own, let alone a frame."""
    if not _NONCE:
        sys.exit("fleetcuda: no frame nonce (FLEETCUDA_NONCE): this program reports to fleetcuda only")
    for field in (kind, *fields):
        if not field or any(c.isspace() for c in field):
            raise ValueError(f"a frame field must be a non-empty word: {field!r}")
    sys.stdout.write(f"\n@@fleetcuda:{_NONCE} {' '.join((kind, *fields))}\n")
    sys.stdout.flush()


def emit_json(kind, value):
    """One frame whose one field is `value` as JSON: ASCII only, no whitespace (a space is \\u0020)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    emit(kind, text.replace(" ", "\\u0020"))
# <<< fleetcuda frame emitter


def version_tuple(text):
    return tuple(int(p) for p in text.split("."))


def run(argv, timeout=60):
    """(exit status, stdout, stderr) of an argv, run without a shell; 127 when it cannot be started."""
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                           errors="replace")
    except FileNotFoundError as exc:
        return 127, "", str(exc)
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]} did not answer within {timeout} s"
    return p.returncode, p.stdout, p.stderr


def host_driver(proc_version):
    """(version, where it was read, error)."""
    try:
        with open(proc_version, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        text = None
    except OSError as exc:
        return None, proc_version, f"cannot read {proc_version}: {exc.strerror}"
    if text is not None:
        m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)\s", text)
        if m:
            return m.group(1), proc_version, None
        return None, proc_version, f"{proc_version} names no driver version: {text.strip()[:120]!r}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, None, (f"no NVIDIA driver on the host: {proc_version} does not exist and nvidia-smi is not "
                            "installed; install the host's NVIDIA driver (and reboot or load its module)")
    rc, out, err = run([smi, "--query-gpu=driver_version", "--format=csv,noheader"])
    versions = sorted({v.strip() for v in out.splitlines() if v.strip()})
    if rc != 0 or not versions:
        said = " ".join((err.strip() or out.strip() or f"exit {rc}").split())[:200]
        return None, "nvidia-smi", (f"the host's NVIDIA driver does not answer (nvidia-smi: {said}); load its "
                                    "kernel module (modprobe nvidia) or reboot after installing the driver")
    if len(versions) > 1 or not re.fullmatch(r"\d+\.\d+(?:\.\d+)?", versions[0]):
        return None, "nvidia-smi", f"nvidia-smi reports driver versions {', '.join(versions)}"
    return versions[0], "nvidia-smi", None


def dev_path(value):
    """The device path of a `devN` property string: its default key (`/dev/nvidia0,gid=44`) or `path=`
    (the same rule as fleetcuda/plan/pve.py, copied: this program is one standard-library file)."""
    for part in value.split(","):
        name, eq, rest = part.partition("=")
        if not eq:
            return name.strip()
        if name.strip() == "path":
            return rest.strip()
    return None


def passthrough(config_text):
    """The config's lines that pass NVIDIA devices through, and the device paths they name."""
    lines, paths, majors = [], set(), set()
    for raw in config_text.splitlines():
        line = raw.strip()
        if line.startswith("["):  # a snapshot's section: not the running config
            break
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        path = dev_path(value) if re.fullmatch(r"dev\d+", key) else None
        if path is not None and path.startswith("/dev/nvidia"):
            lines.append(line)
            paths.add(path)
        elif key in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow"):
            m = re.fullmatch(r"c\s+(\d+|\*):\S+\s+\S*r\S*", value)
            if m:
                majors.add(m.group(1))
                lines.append(line)
        elif key == "lxc.mount.entry" and value.startswith("/dev/nvidia"):
            lines.append(line)
            paths.add(value.split()[0])
    return lines, paths, majors


def parse_probe(text):
    libs = {name: [] for name in LIBS}  # name -> [(how, path, real, ldconfig flags or "")], in the probe's order
    nodes = {}  # path -> (state, major, minor, error)
    for line in text.splitlines():
        words = line.split(" ")
        if words[0] == "lib" and len(words) in (5, 6) and words[1] in libs:
            flags = words[5] if len(words) == 6 and words[5] != "-" else ""
            libs[words[1]].append((words[2], words[3], words[4], flags))
        elif words[0] == "node" and len(words) >= 3:
            if words[2] == "char" and len(words) >= 5 and ":" in words[3]:
                major, _, minor = words[3].partition(":")
                nodes[words[1]] = ("char", int(major), int(minor), " ".join(words[4:]))
            else:
                nodes[words[1]] = (words[2], None, None, " ".join(words[3:]))
    return libs, nodes


def loader_entry(name, entries, machine=None):
    """The `name.1` entry the dynamic loader uses: the first `ldconfig -p` entry of that soname for this
    machine's ABI (the cache's order is the loader's), else the first file of that name in the library dirs."""
    arch = LDCONFIG_ARCH.get(machine if machine is not None else platform.machine())
    sonames = [e for e in entries if os.path.basename(e[1]) == name + ".1"]
    for how in ("ldconfig", "file"):
        for entry in sonames:
            if entry[0] == how and (how == "file" or arch is None or not entry[3] or arch in entry[3].split(",")):
                return entry
    return None


def lib_version(name, entries, machine=None):
    """(version of the file the loader's `name.1` resolves to, every version found, what is wrong with the
    loader's `name.1` when it resolves to no file: its path and `dangling` or `absent`)."""
    pattern = re.compile(re.escape(name) + r"\.(\d+\.\d+(?:\.\d+)?)")
    found = set()
    for _, _, real, _ in entries:
        m = pattern.fullmatch(os.path.basename(real))
        if m:
            found.add(m.group(1))
    entry = loader_entry(name, entries, machine)
    if entry is not None and entry[2] in ("dangling", "absent"):
        return None, sorted(found), (entry[1], entry[2])
    m = pattern.fullmatch(os.path.basename(entry[2])) if entry is not None else None
    if m:
        return m.group(1), sorted(found), None
    return (next(iter(found)) if len(found) == 1 else None), sorted(found), None


class Report:
    def __init__(self):
        self.failures = []  # (rank, message): the lowest rank is what the verdict says
        self.lines = []

    def say(self, state, what, rank=9):
        print(f"{state:<4} {what}")
        if state == "FAIL":
            self.failures.append((rank, what))


def parse_args(argv):
    opts = {"container_probe": None, "pct_config": None, "cuda_version": "", "require_devices": "true",
            "proc_version": PROC_VERSION}
    i = 0
    while i < len(argv):
        key = argv[i]
        name = key[2:].replace("-", "_") if key.startswith("--") else None
        if name not in opts or i + 1 >= len(argv):
            raise SystemExit(f"gpu_passthrough: bad argument {key!r}")
        opts[name] = argv[i + 1]
        i += 2
    if opts["container_probe"] is None:
        raise SystemExit("gpu_passthrough: --container-probe is required")
    for name in ("container_probe", "pct_config"):
        if opts[name] is not None:
            value = json.loads(opts[name])
            if not (isinstance(value, list) and value and all(isinstance(w, str) for w in value)):
                raise SystemExit(f"gpu_passthrough: --{name.replace('_', '-')} is a JSON list of words")
            opts[name] = value
    return opts


def main(argv):
    opts = parse_args(argv)
    take_nonce()
    container = opts["pct_config"] is not None  # a container, reached through pct; else this machine itself
    where = "the container" if container else "this machine"
    restart = ", then restart the container" if container else ""
    rep = Report()
    findings = {"container": container}

    driver, source, error = host_driver(opts["proc_version"])
    findings["driver"] = driver
    if driver:
        rep.say("ok", f"host driver {driver} (from {source})")
    else:
        rep.say("FAIL", error, rank=0)

    if container:
        rc, out, err = run(opts["pct_config"])
        vmid = opts["pct_config"][-1]
        if rc != 0:
            said = " ".join((err.strip() or out.strip() or f"exit {rc}").split())[:200]
            rep.say("FAIL", f"cannot read the container's config (pct config {vmid}: {said})", rank=1)
        else:
            lines, paths, majors = passthrough(out)
            findings["passthrough"] = lines
            for line in lines:
                rep.say("info", f"config: {line}")
            wanted = {"/dev/nvidiactl", "/dev/nvidia-uvm"}
            missing = sorted(wanted - paths) + ([] if any(re.fullmatch(r"/dev/nvidia\d+", p) for p in paths)
                                                else ["/dev/nvidia0"])
            mounts = [ln for ln in lines if ln.startswith("lxc.mount.entry")]
            if not lines:
                rep.say("FAIL", f"container {vmid} has no GPU passthrough in its config: add `dev0: /dev/nvidia0`, "
                        "`dev1: /dev/nvidiactl`, `dev2: /dev/nvidia-uvm` (pct set --devN, Proxmox 8.1+) or "
                        "`lxc.cgroup2.devices.allow: c 195:* rwm` with `lxc.mount.entry` binds of each "
                        "/dev/nvidia* node, then restart the container", rank=1)
            elif mounts and not majors & {str(NVIDIA_MAJOR), "*"}:
                rep.say("FAIL", f"container {vmid} binds /dev/nvidia* but its device cgroup does not allow "
                        f"them: add `lxc.cgroup2.devices.allow: c {NVIDIA_MAJOR}:* rwm` (and nvidia-uvm's major, "
                        "see /proc/devices), then restart the container", rank=1)
            elif missing:
                rep.say("FAIL", f"container {vmid}'s config passes through no {', '.join(missing)}: add them "
                        "(devN: entries or lxc.mount.entry binds), then restart the container", rank=1)
            else:
                rep.say("ok", f"container {vmid}'s config passes {len(paths)} NVIDIA device nodes through")

    rc, out, err = run(opts["container_probe"], timeout=120)
    unknown = None  # why what is inside is not known: never reported as missing
    if rc != 0:
        said = " ".join((err.strip() or out.strip() or f"exit {rc}").split())[:200]
        unknown = f"could not look inside {where}: {said}"
        rep.say("FAIL", unknown, rank=1)
        findings["unknown"] = unknown
        libs, nodes = {name: [] for name in LIBS}, {}
    else:
        libs, nodes = parse_probe(out)

    findings["libs"] = {}
    for name in LIBS:
        if unknown is not None:
            findings["libs"][name] = None
            rep.say("unknown", f"{where}'s {name}: not known ({unknown})")
            continue
        version, versions, broken = lib_version(name, libs[name])
        findings["libs"][name] = version
        fix = "run ldconfig there" + (f", or {REINSTALL.format(v=driver)}" if driver else "")
        if broken is not None:
            path, how = broken
            what = ("a dangling link: the file it points to no longer exists" if how == "dangling"
                    else "listed by ldconfig but not there (a stale ldconfig cache)")
            rep.say("FAIL", f"{where}'s {name}.1, the one the loader uses, is {path}, {what}"
                    + (f" (also found: {', '.join(versions)})" if versions else "") + f": {fix}", rank=2)
        elif version is None:
            if versions:
                rep.say("FAIL", f"{where} has {name} at {', '.join(versions)} but no {name}.1 link to one of "
                        f"them: {fix}", rank=2)
            else:
                rep.say("FAIL", f"{where} has no {name} (the NVIDIA user-space driver libraries): "
                        + REINSTALL.format(v=driver or "the host driver's version").replace("reinstall", "install", 1),
                        rank=2)
        elif driver and version != driver:
            hint = ("the host driver was upgraded" if version_tuple(version) < version_tuple(driver)
                    else "the container's libraries are newer than the host's driver")
            rep.say("FAIL", f"host driver {driver} but {where}'s {name} is {version}: {hint}; "
                    + REINSTALL.format(v=driver), rank=2)
        else:
            others = [v for v in versions if v != version]
            rep.say("ok", f"{where}'s {name} is {version}" + (f" (also found: {', '.join(others)})" if others else ""))

    devices_required = opts["require_devices"].strip().lower() not in ("false", "0", "no", "off")
    findings["nodes"] = {}
    for path, (state, major, minor, detail) in sorted(nodes.items()):
        findings["nodes"][path] = state if state != "char" else detail
        problem = None
        if state == "absent":
            problem = (f"{path}: not in {where} (ENOENT): " + ("pass it through in the container's config"
                       + restart if container else "load the driver's modules (nvidia, nvidia-uvm; nvidia-modprobe)"))
        elif state != "char":
            problem = f"{path}: not a character device ({detail or state})"
        elif major != NVIDIA_MAJOR and path != "/dev/nvidia-uvm":
            problem = f"{path}: char {major}:{minor}, not NVIDIA's major {NVIDIA_MAJOR}"
        elif detail != "ok":
            code = ERRNO.get(detail, detail)
            if code in ("EACCES", "EPERM"):
                problem = (f"{path}: char {major}:{minor} present but opening it is denied ({code}): "
                           + (f"{where}'s device cgroup does not allow it: use devN: entries or add "
                              f"`lxc.cgroup2.devices.allow: c {major}:* rwm`" + restart if container
                              else "check its permissions"))
            elif code in ("ENXIO", "ENODEV"):
                problem = (f"{path}: char {major}:{minor} present but no driver behind it ({code}): the host's "
                           "NVIDIA kernel module is not loaded (modprobe nvidia nvidia-uvm, or reboot after a "
                           "driver upgrade)")
            else:
                problem = f"{path}: char {major}:{minor} cannot be opened: {detail}"
        if problem is None:
            rep.say("ok", f"{path}: char {major}:{minor}, opens read-write")
        elif devices_required:
            rep.say("FAIL", problem, rank=3)
        else:
            rep.say("info", problem + " (not required: --require-devices false)")

    cuda = opts["cuda_version"].strip()
    m = CUDA_VERSION.fullmatch(cuda)
    if not cuda:
        rep.say("info", "CUDA version not given: whether the driver supports it is not checked")
    elif not m:
        rep.say("FAIL", f"CUDA version {cuda!r} cannot be read, so whether the driver supports it is "
                "unknown: give it as torch and nvcc name it, X.Y (12.8) or X (13)", rank=4)
    elif driver:
        major = int(m.group(1))
        minor = int(m.group(2)) if m.group(2) is not None else None
        have = version_tuple(driver)
        floor = MAJOR_MIN.get(major)
        full = MINOR_FULL.get((major, minor)) if minor is not None else None
        shown = ".".join(str(p) for p in floor) if floor else ""
        if floor is None:
            rep.say("WARN", f"CUDA {cuda}: no known minimum driver; not checked")
        elif have < floor:
            rep.say("FAIL", f"host driver {driver} is too old for CUDA {cuda} (CUDA {major}.x needs {shown} or "
                    f"newer, a {floor[0]}-series driver): upgrade the host's driver, then "
                    + REINSTALL.format(v="the new version") + "; or use a torch built for an older CUDA", rank=4)
        elif full is not None and have < full:
            rep.say("WARN", f"host driver {driver} runs CUDA {cuda} through minor version compatibility only "
                    f"(full support from {'.'.join(str(p) for p in full)}): PTX JIT of newer code may fail")
        else:
            rep.say("ok", f"host driver {driver} supports CUDA {cuda}")

    findings["ok"] = not rep.failures
    findings["failures"] = [what for _, what in sorted(rep.failures, key=lambda f: f[0])]
    if _NONCE:
        emit_json("gpu", findings)
    if rep.failures:
        print("FAIL " + min(rep.failures, key=lambda f: f[0])[1])
        return 1
    libs_said = ", ".join(f"{n} {findings['libs'][n]}" for n in LIBS)
    print(f"ok   host driver {driver}, {where}: {libs_said}"
          + (f", CUDA {cuda} supported" if m else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
