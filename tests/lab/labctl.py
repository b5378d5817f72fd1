#!/usr/bin/python3
"""Bring the fleetcuda lab up or down: a Proxmox-like test fleet on one Debian 12 machine.

    tests/lab/labctl.py up       # idempotent: builds what is missing, starts what is stopped
    tests/lab/labctl.py reset    # every container back to bare (its overlay emptied)
    tests/lab/labctl.py down     # stop containers and sshds, remove the namespaces
    tests/lab/labctl.py down --purge   # ... and delete everything under /var/lib/fleetcuda-lab
    tests/lab/labctl.py up --topology bench-4x16   # a benchmark fleet of its own (benchmarks/run.py);
                                                   # down/reset/status take --topology too

Lab hosts are network namespaces with their own address and their own OpenSSH sshd; containers
are real LXC containers sharing one debootstrapped Debian 12 base through overlayfs, so each one's
installed state is its own. /usr/sbin/pct is a stand-in over LXC (tests/lab/pct_lxc.py). NVIDIA's
apt repository and PyPI's CUDA packages are replaced by local stand-ins, bind-mounted read-only
into every container (containers have no network). Needs root. Stdlib only.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAB = Path(os.environ.get("FLEETCUDA_LAB_ROOT", "/var/lib/fleetcuda-lab"))
BASE = LAB / "base"
MINBASE = LAB / "minbase"  # Debian 12 minbase with python3 and nothing else: the apt stand-in tests' chroot
DEBOOTSTRAP_CACHE = LAB / "debootstrap-cache"
APT_REPO = LAB / "apt"
WHEELHOUSE = LAB / "wheelhouse"
IN_CONTAINER = "/srv/fleetcuda-lab"  # where the stand-ins appear inside containers
KNOWN_HOSTS = LAB / "known_hosts"
IDENTITY = LAB / "id_ed25519"
PCT = Path("/usr/sbin/pct")
SUDOERS = Path("/etc/sudoers.d/fleetcuda-lab")
SUBNET = "10.250"  # 10.250.<host index>.2 is a lab host; nothing else is ever addressed


@dataclass
class User:
    name: str
    shell: str
    uid0: bool = False  # a second name for root, so root's login shell can be zsh on one host only
    sudo: str | None = None  # "nopasswd" or "password"


@dataclass
class LabHost:
    name: str
    index: int
    users: list[User]
    running: list[int]
    stopped: list[int] = field(default_factory=list)
    base: Path = BASE  # the overlay's lower layer, shared by the host's containers
    # (host directory, where under IN_CONTAINER) bind-mounted read-only; None: the default stand-ins
    mounts: tuple[tuple[Path, str], ...] | None = None

    @property
    def netns(self) -> str:
        return f"fclab-{self.name}"

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.index}.2"

    @property
    def dir(self) -> Path:
        return LAB / "hosts" / self.name


HOSTS = [
    # Root whose login shell is zsh: the shell that broke the seeds' quoting.
    LabHost("a", 1, [User("labzsh", "/usr/bin/zsh", uid0=True)], running=[200, 201], stopped=[202]),
    # A non-root SSH user reaching pct through `sudo -n`; and one whose sudo wants a password.
    LabHost("b", 2, [User("labops", "/bin/bash", sudo="nopasswd"), User("labpw", "/bin/bash", sudo="password")],
            running=[300, 301]),
]


def _bench(size: str, first: int, hosts: int, per_host: int) -> list[LabHost]:
    # Hosts of their own (namespace, sshd, LXC path, address 10.250.<first+i>.2), alternating a's and b's logins.
    return [LabHost(f"b{size}-{i}", first + i, [HOSTS[(i - 1) % 2].users[0]],
                    running=[(first + i) * 100 + j for j in range(per_host)]) for i in range(1, hosts + 1)]


# `real`: the real toolchain (docs/lab.md, "Real parts and stand-ins"). Its containers are made like Proxmox's
# Debian 12 template (no compiler, no Python headers) with PyPI's torch 2.11.0 (cu130) and transformers 5.x in
# /root/venv, and see only real packages: NVIDIA's nvcc 13.0.88 repackaged from its PyPI wheels (in the NVIDIA
# apt stand-in, a repository of their own, so the default lab's is never rebuilt for them), Debian's own .debs
# (the closure of g++ and python3.X-dev that the template lacks, with Debian's signed index), and a wheelhouse
# from PyPI (fla-core, causal-conv1d's sdist, ...). Everything under LAB/real.
REAL = LAB / "real"
REAL_BASE = REAL / "base"
REAL_APT = REAL / "apt"
REAL_MIRROR = REAL / "mirror"  # bind-mounted; the repository in it is swapped whole, under running containers
REAL_DEBIAN = REAL_MIRROR / "debian"
REAL_PYPI = REAL / "pypi"
CUDA13_DEBS = LAB / "cuda13-debs"  # cuda13_debs.py's output (its wheels are cached in LAB/cuda13-wheels)
REAL_VENV = ["torch==2.11.0", "transformers>=5,<6"]  # in the template's venv, from PyPI
REAL_WHEELHOUSE = ["fla-core==0.6.0", "einops", "wheel", "setuptools", "packaging", "ninja"]  # for the recipe
REAL_SDISTS = ["causal-conv1d==1.7.0"]
REAL_DEBIAN_SUITE = "bookworm"
REAL_HOSTS = [
    LabHost("real1", 60, [HOSTS[1].users[0]], running=[600, 601], base=REAL_BASE,
            mounts=((REAL_APT, "apt"), (REAL_PYPI, "wheelhouse"), (REAL_MIRROR, "mirror"))),
]

# `--topology NAME`: extra fleets brought up and down on their own, each with its own known_hosts
# (known_hosts.NAME) and marker (up.NAME): bench-* for benchmarks/, real for tests/test_lab_real.py
# (inventories/lab-real.yaml); "default" is the lab above, unchanged.
TOPOLOGIES = {"default": HOSTS, "bench-2x4": _bench("2x4", 20, 2, 4), "bench-4x16": _bench("4x16", 40, 4, 16),
              "real": REAL_HOSTS}


def log(msg: str) -> None:
    print(f"labctl: {msg}", flush=True)


def run(*argv: str | Path, check: bool = True, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in argv], text=True, capture_output=True, **kw)  # type: ignore[call-overload]
    if check and proc.returncode != 0:
        raise SystemExit(f"labctl: {' '.join(map(str, argv))} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc


def in_ns(host: LabHost, *argv: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    # nsenter, not `ip netns exec`: the latter remounts /sys and LXC then loses the cgroup hierarchies.
    return run("nsenter", f"--net=/run/netns/{host.netns}", *argv, check=check)


# -- stand-ins and base --------------------------------------------------------------------------


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (its sources), never one of ours: the lab reaches only what
    the machine is configured to reach."""
    if os.environ.get("FLEETCUDA_DEBIAN_MIRROR"):
        return os.environ["FLEETCUDA_DEBIAN_MIRROR"]
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if path.suffix not in (".list", ".sources") and path.name != "sources.list":
            continue
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        for line in text.splitlines():
            if line.startswith("URIs:") and "debian" in line and "security" not in line:
                return line.split()[1]
            parts = line.split()
            if parts[:1] == ["deb"] and "debian" in line and "security" not in line:
                uri = next((p for p in parts[1:] if p.startswith(("http", "file:"))), None)
                if uri:
                    return uri
    sys.exit("labctl: no Debian mirror in this machine's apt sources (/etc/apt/sources.list, "
             "/etc/apt/sources.list.d/*.sources); add one, or set FLEETCUDA_DEBIAN_MIRROR")


def build_standins() -> None:
    run(sys.executable, HERE / "standins" / "python" / "build_wheelhouse.py", WHEELHOUSE)
    run("bash", HERE / "standins" / "apt" / "build_repo.sh", APT_REPO, f"file://{IN_CONTAINER}/apt")
    log(f"stand-ins ready: {APT_REPO} (NVIDIA apt), {WHEELHOUSE} (torch, fla-core, causal-conv1d)")


# The default topology's image: Debian 12 with a host toolchain already in it (g++, the headers of its Python 3.11),
# as an operator's own template often is; the real topology's is the bare Proxmox-like one, where the recipe has to
# install them.  The stand-in torch fails a build without them as the real one does, so they are needed here.
BASE_PACKAGES = ("python3", "python3-venv", "g++", "python3.11-dev")
TORCH_STANDIN = "torch-2.11.0+cu128-py3-none-any.whl"


def base_stamp() -> str:
    """What the base was made of; the torch stand-in by digest, so that changing it rebuilds the base's venv."""
    torch = hashlib.sha256((WHEELHOUSE / TORCH_STANDIN).read_bytes()).hexdigest()
    return f"debootstrap minbase bookworm: {','.join(BASE_PACKAGES)}; /root/venv: {TORCH_STANDIN} {torch}, packaging\n"


def build_base() -> None:
    stamp = BASE / ".fleetcuda-complete"
    want = base_stamp()
    if _stamped(stamp, want):
        return
    if BASE.exists():
        if _overlay_users(BASE):
            raise SystemExit(f"labctl: {BASE} is out of date and containers run on it; "
                                 "`labctl down` (and the bench topologies down) first, then `up` rebuilds it")
        log(f"{BASE} is out of date (now: {want.strip()}): rebuilding it")
        shutil.rmtree(BASE)
    tmp = LAB / "base.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    log(f"debootstrap of Debian 12 (minbase, {', '.join(BASE_PACKAGES)}); a minute or two")
    debootstrap(tmp, BASE_PACKAGES)
    # Containers are offline: the only apt source they may get is the stand-in NVIDIA repository.
    (tmp / "etc/apt/sources.list").write_text("")
    # The training venv of the seeds: torch built for CUDA 12.8, pip, setuptools and packaging (which
    # transformers brings), but no wheel.
    mnt = tmp / IN_CONTAINER.lstrip("/") / "wheelhouse"
    mnt.mkdir(parents=True)
    run("mount", "--bind", WHEELHOUSE, mnt)
    try:
        run("chroot", tmp, "/usr/bin/python3", "-m", "venv", "/root/venv")
        run("chroot", tmp, "/root/venv/bin/python", "-m", "pip", "install", "-q", "--no-index", "--find-links",
            f"{IN_CONTAINER}/wheelhouse", "torch==2.11.0+cu128", "packaging")
    finally:
        run("umount", mnt)
    (tmp / ".fleetcuda-complete").write_text(want)
    tmp.rename(BASE)


def debootstrap(root: Path, packages: tuple[str, ...]) -> None:
    # One download cache for the lab's trees: the second one fetches only what the first lacked.
    DEBOOTSTRAP_CACHE.mkdir(parents=True, exist_ok=True)
    run("debootstrap", "--variant=minbase", f"--cache-dir={DEBOOTSTRAP_CACHE}", "--include=" + ",".join(packages),
        "bookworm", root, debian_mirror())


def build_minbase() -> None:
    """A compiler-free Debian 12 (minbase, python3): tests/test_standin_apt.py and test_standin_cuda13.py chroot
    into copies of it (nvcc there must find no host compiler, as in a fresh template)."""
    stamp = MINBASE / ".fleetcuda-complete"
    want = "debootstrap minbase bookworm: python3\n"
    if _stamped(stamp, want):
        return
    tmp = LAB / "minbase.tmp"
    for old in (tmp, MINBASE):
        if old.exists():
            shutil.rmtree(old)
    log("debootstrap of a compiler-free Debian 12 (minbase, python3) for the apt stand-in tests")
    debootstrap(tmp, ("python3",))
    (tmp / "etc/apt/sources.list").write_text("")
    (tmp / ".fleetcuda-complete").write_text(want)
    tmp.rename(MINBASE)


def _overlay_users(lower: Path) -> list[str]:
    """PIDs whose mount namespace has an overlay on ``lower`` (containers mount their rootfs in their own)."""
    users = []
    for info in Path("/proc").glob("[0-9]*/mountinfo"):
        try:
            if f"lowerdir={lower}," in info.read_text(encoding="utf-8", errors="replace"):
                users.append(info.parent.name)
        except OSError:
            continue
    return users


def _stamped(path: Path, want: str) -> bool:
    try:
        return path.read_text() == want
    except OSError:
        return False


def build_real_pypi() -> None:
    """PyPI's packages for the real topology: the template venv's and the recipe's wheelhouse, in one directory
    (pip's own resolver, this machine's pip configuration). Resumable: pip keeps what is already there."""
    stamp = REAL_PYPI / ".fleetcuda-pypi"
    want = "\n".join([*REAL_VENV, *REAL_WHEELHOUSE]) + "\n"
    if _stamped(stamp, want):
        return
    REAL_PYPI.mkdir(parents=True, exist_ok=True)
    log(f"downloading from PyPI: {', '.join(REAL_VENV + REAL_WHEELHOUSE)} (about 3 GB the first time)")
    run(sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--only-binary=:all:",
        "-d", REAL_PYPI, *REAL_VENV, *REAL_WHEELHOUSE)
    stamp.write_text(want)


def build_real_sdists() -> None:
    """causal-conv1d's sdist. pip prepares an sdist's metadata by running its setup.py, which imports torch and
    wheel: it runs with the template venv's torch and the staged wheel on PYTHONPATH, without build isolation
    (which would pull the newest torch into a throwaway environment)."""
    stamp = REAL_PYPI / ".fleetcuda-sdists"
    want = "\n".join(REAL_SDISTS) + "\n"
    if _stamped(stamp, want):
        return
    site = next((REAL_BASE / "root/venv/lib").glob("python3*/site-packages"))
    wheel = sorted(REAL_PYPI.glob("wheel-*.whl"))[-1]  # pure Python: importable straight from the zip
    env = {**os.environ, "PYTHONPATH": f"{wheel}:{site}", "CAUSAL_CONV1D_SKIP_CUDA_BUILD": "TRUE",
           "CAUSAL_CONV1D_FORCE_BUILD": "TRUE"}
    log(f"downloading the sdists {', '.join(REAL_SDISTS)}")
    run(sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
        "--no-binary=:all:", "--no-build-isolation", "-d", REAL_PYPI, *REAL_SDISTS, env=env)
    stamp.write_text(want)


def real_python_xy(root: Path = REAL_BASE) -> str:
    """The X.Y of the template's python3 (the venv's interpreter), from its symlink: python3 -> python3.11."""
    target = os.readlink(root / "usr/bin/python3")
    if not target.startswith("python3."):
        raise SystemExit(f"labctl: {root}/usr/bin/python3 -> {target}: expected python3.X")
    return target.removeprefix("python")


def build_real_base() -> None:
    """Like Proxmox's Debian 12 template: no build-essential, no python3.X-dev; Debian's apt source is the lab's
    copy of the mirror; /root/venv holds PyPI's torch 2.11.0 (cu130) and transformers 5.x."""
    if (REAL_BASE / ".fleetcuda-complete").exists():
        return
    tmp = REAL / "base.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    log("debootstrap of the real topology's Debian 12 template (minbase, python3, python3-venv)")
    run("debootstrap", "--variant=minbase", "--include=python3,python3-venv", REAL_DEBIAN_SUITE, tmp,
        debian_mirror())
    # As a template's sources.list names the Debian mirror; containers are offline, so the mirror is the lab's copy.
    (tmp / "etc/apt/sources.list").write_text(f"deb file://{IN_CONTAINER}/mirror/debian {REAL_DEBIAN_SUITE} main\n")
    mnt = tmp / IN_CONTAINER.lstrip("/") / "wheelhouse"
    mnt.mkdir(parents=True)
    run("mount", "--bind", REAL_PYPI, mnt)
    try:
        log(f"installing {', '.join(REAL_VENV)} into the template's /root/venv (about 5 GB)")
        run("chroot", tmp, "/usr/bin/python3", "-m", "venv", "/root/venv")
        run("chroot", tmp, "/root/venv/bin/python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
            "--no-index", "--find-links", f"{IN_CONTAINER}/wheelhouse", *REAL_VENV)
    finally:
        run("umount", mnt)
    shutil.rmtree(tmp / "root/.cache", ignore_errors=True)
    (tmp / ".fleetcuda-complete").write_text("")
    tmp.rename(REAL_BASE)


def build_real_debian() -> None:
    """A copy of the Debian mirror holding Debian's signed index for bookworm main and exactly the .debs the
    template lacks for g++ and python3.X-dev (apt's own resolver against the template's dpkg status, apt's own
    downloader and hash checks), at the mirror's paths, so that the containers' apt reads it as the mirror."""
    packages = ["g++", f"python{real_python_xy()}-dev"]
    status = REAL_BASE / "var/lib/dpkg/status"
    status_sha = hashlib.sha256(status.read_bytes()).hexdigest()
    want = f"suite={REAL_DEBIAN_SUITE} indices=xz\npackages={' '.join(packages)}\nstatus={status_sha}\n"
    stamp = REAL_DEBIAN / ".fleetcuda-debian"
    if _stamped(stamp, want):
        return
    REAL_MIRROR.mkdir(parents=True, exist_ok=True)
    tmp = REAL_MIRROR / ".debian.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    st = tmp / ".apt"
    for d in ("empty", "state/lists/partial", "cache/archives/partial"):
        (st / d).mkdir(parents=True)
    mirror = debian_mirror().rstrip("/")
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    (st / "sources.list").write_text(f"deb [signed-by={keyring}] {mirror} {REAL_DEBIAN_SUITE} main\n")
    apt = ["apt-get", "-q", "-o", f"Dir::Etc::SourceList={st / 'sources.list'}",
           "-o", f"Dir::Etc::SourceParts={st / 'empty'}", "-o", f"Dir::Etc::PreferencesParts={st / 'empty'}",
           "-o", f"Dir::Etc::Preferences={st / 'empty' / 'none'}", "-o", f"Dir::State={st / 'state'}",
           "-o", f"Dir::State::status={status}", "-o", f"Dir::Cache={st / 'cache'}", "-o", "Debug::NoLocking=1",
           "-o", "Acquire::Languages=none", "-o", "APT::Architectures=amd64"]
    log(f"downloading Debian's {' '.join(packages)} and what the template lacks of their dependencies")
    run(*apt, "update")
    uris = run(*apt, "--print-uris", "-qq", "-y", "--no-install-recommends", "install", *packages).stdout
    run(*apt, "-y", "--no-install-recommends", "--download-only", "install", *packages)
    count = 0
    for line in uris.splitlines():
        parts = line.split()
        if len(parts) < 2 or not parts[0].startswith("'"):
            continue
        url, name = parts[0].strip("'"), parts[1]
        if not url.startswith(mirror + "/"):
            raise SystemExit(f"labctl: {url} is not under {mirror}")
        dest = tmp / urllib.parse.unquote(url[len(mirror) + 1:])  # the pool path, as the mirror names it
        dest.parent.mkdir(parents=True, exist_ok=True)
        (st / "cache/archives" / name).rename(dest)
        count += 1
    if not count:
        raise SystemExit(f"labctl: apt found nothing to download for {packages}:\n{uris}")
    lists = st / "state/lists"
    dists = tmp / "dists" / REAL_DEBIAN_SUITE
    dists.mkdir(parents=True)
    inrelease = next(lists.glob(f"*_dists_{REAL_DEBIAN_SUITE}_InRelease"))
    shutil.copyfile(inrelease, dists / "InRelease")
    # The indices as the mirror serves them (xz), fetched by apt's own downloader against the hashes that the
    # InRelease apt has just verified signs for them; by hash too, as the mirror does (Acquire-By-Hash: yes).
    signed = inrelease.read_text()
    for name in ("main/binary-amd64/Packages.xz", "main/i18n/Translation-en.xz"):
        found = re.search(rf"^SHA256:\n(?:.*\n)*? ([0-9a-f]{{64}}) +\d+ {re.escape(name)}$", signed, re.M)
        if not found:
            raise SystemExit(f"labctl: {inrelease} signs no {name}")
        index = dists / name
        index.parent.mkdir(parents=True, exist_ok=True)
        run("/usr/lib/apt/apt-helper", "-q", "download-file", f"{mirror}/dists/{REAL_DEBIAN_SUITE}/{name}", index,
            f"SHA256:{found[1]}")
        by_hash = index.parent / "by-hash" / "SHA256"
        by_hash.mkdir(parents=True, exist_ok=True)
        os.link(index, by_hash / found[1])
    shutil.rmtree(st)
    run("chmod", "-R", "a+rX", tmp)
    (tmp / stamp.name).write_text(want)
    old = REAL_MIRROR / ".debian.old"
    shutil.rmtree(old, ignore_errors=True)
    if REAL_DEBIAN.exists():
        REAL_DEBIAN.rename(old)
    tmp.rename(REAL_DEBIAN)
    shutil.rmtree(old, ignore_errors=True)
    log(f"Debian packages ready: {REAL_DEBIAN} ({count} .debs)")


def build_real() -> None:
    """The real topology's parts; each is kept when it is complete, so a second `up` changes nothing."""
    REAL.mkdir(parents=True, exist_ok=True)
    apt = HERE / "standins" / "apt"
    run(sys.executable, apt / "cuda13_debs.py", CUDA13_DEBS)
    # Its own repository (and signing key): the default lab's is never rebuilt for it.
    run("bash", apt / "build_repo.sh", REAL_APT, f"file://{IN_CONTAINER}/apt",
        env={**os.environ, "FLEETCUDA_CUDA13_DEBS": str(CUDA13_DEBS)})
    build_real_pypi()
    build_real_base()
    build_real_sdists()
    build_real_debian()
    log(f"real parts ready: {REAL_APT} (NVIDIA apt, real 13.0), {REAL_DEBIAN} (Debian), {REAL_PYPI} (PyPI)")


# -- hosts ---------------------------------------------------------------------------------------


def ensure_users() -> None:
    for host in HOSTS:
        for user in host.users:
            if run("id", user.name, check=False).returncode != 0:
                if user.uid0:
                    run("useradd", "-o", "-u", "0", "-g", "0", "-M", "-d", "/root", "-s", user.shell, user.name)
                else:
                    run("useradd", "-m", "-s", user.shell, user.name)
            else:
                run("usermod", "-s", user.shell, user.name)
            # With UsePAM no, sshd refuses accounts whose password field is locked ("!").
            run("usermod", "-p", "*", user.name)
    lines = ["# fleetcuda lab: non-root SSH users reach the pct stand-in through sudo -n"]
    for host in HOSTS:
        for user in host.users:
            if user.sudo == "nopasswd":
                lines.append(f"{user.name} ALL=(root) NOPASSWD: {PCT}")
            elif user.sudo == "password":
                lines.append(f"{user.name} ALL=(root) {PCT}")
    tmp = SUDOERS.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.chmod(0o440)
    run("visudo", "-cf", tmp)
    tmp.rename(SUDOERS)


def ensure_keys() -> None:
    LAB.mkdir(parents=True, exist_ok=True, mode=0o755)
    if not IDENTITY.exists():
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "fleetcuda-lab-client", "-f", IDENTITY)
    keys = LAB / "authorized_keys"
    keys.mkdir(exist_ok=True)
    pub = IDENTITY.with_suffix(".pub").read_text()
    for host in HOSTS:
        for user in host.users:
            (keys / user.name).write_text(pub)
            (keys / user.name).chmod(0o644)


def ensure_netns(host: LabHost) -> None:
    if not Path(f"/run/netns/{host.netns}").exists():
        run("ip", "netns", "add", host.netns)
    veth = f"fcl-{host.name}"
    if run("ip", "link", "show", veth, check=False).returncode != 0:
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        run("ip", "addr", "add", f"{SUBNET}.{host.index}.1/24", "dev", veth)
    run("ip", "link", "set", veth, "up")
    in_ns(host, "ip", "link", "set", "lo", "up")
    if f"{host.address}/24" not in in_ns(host, "ip", "-o", "addr", "show", "dev", "eth0").stdout:
        in_ns(host, "ip", "addr", "add", f"{host.address}/24", "dev", "eth0")
    in_ns(host, "ip", "link", "set", "eth0", "up")


def sshd_pid(host: LabHost) -> int | None:
    pidfile = host.dir / "sshd.pid"
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ValueError):
        return None
    return pid if str(host.dir / "sshd_config").encode() in cmdline else None


def ensure_sshd(host: LabHost) -> None:
    host.dir.mkdir(parents=True, exist_ok=True)
    key = host.dir / "ssh_host_ed25519_key"
    if not key.exists():
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"fleetcuda-lab-{host.name}", "-f", key)
    config = host.dir / "sshd_config"
    config.write_text("\n".join([
        f"ListenAddress {host.address}",
        "Port 22",
        f"HostKey {key}",
        f"PidFile {host.dir / 'sshd.pid'}",
        f"AuthorizedKeysFile {LAB / 'authorized_keys'}/%u",
        "StrictModes no",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes",
        "PermitRootLogin prohibit-password",
        "UsePAM no",
        "MaxSessions 64",
        "MaxStartups 128:30:256",
        "LogLevel VERBOSE",
        f"AllowUsers {' '.join(u.name for u in host.users)}",
        "Subsystem sftp internal-sftp",
        "",
    ]))
    if sshd_pid(host) is None:
        Path("/run/sshd").mkdir(exist_ok=True)
        in_ns(host, "/usr/sbin/sshd", "-f", config, "-E", host.dir / "sshd.log")
        deadline = time.monotonic() + 10
        while sshd_pid(host) is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"labctl: sshd of host {host.name} did not start; see {host.dir / 'sshd.log'}")
            time.sleep(0.05)


def write_known_hosts(hosts: list[LabHost] = HOSTS, path: Path = KNOWN_HOSTS) -> None:
    lines = []
    for host in hosts:
        kind, blob = (host.dir / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        lines.append(f"{host.address} {kind} {blob}")
    path.write_text("\n".join(lines) + "\n")


# -- containers ----------------------------------------------------------------------------------


def container_dir(host: LabHost, vmid: int) -> Path:
    return host.dir / "lxc" / str(vmid)


def ensure_container(host: LabHost, vmid: int) -> None:
    d = container_dir(host, vmid)
    (d / "delta").mkdir(parents=True, exist_ok=True)
    (d / "config").write_text("\n".join([
        f"lxc.uts.name = ct{vmid}",
        f"lxc.rootfs.path = overlay:{host.base}:{d / 'delta'}",
        "lxc.include = /usr/share/lxc/config/common.conf",
        "lxc.apparmor.profile = unconfined",
        "lxc.net.0.type = empty",
        "lxc.init.cmd = /bin/sleep infinity",
        # A tmpfs /run, as systemd gives every Proxmox container: locks there vanish with a restart.
        "lxc.mount.entry = tmpfs run tmpfs rw,nosuid,nodev,mode=755 0 0",
        "lxc.mount.entry = tmpfs run/lock tmpfs rw,nosuid,nodev,noexec,mode=1777,create=dir 0 0",
        *(f"lxc.mount.entry = {src} {IN_CONTAINER.lstrip('/')}/{dest} none bind,ro,create=dir 0 0"
          for src, dest in (host.mounts or ((APT_REPO, "apt"), (WHEELHOUSE, "wheelhouse")))),
        "",
    ]))


# Each container's Proxmox config, LAB/hosts/<host>/pve/<vmid>.conf (what /etc/pve/lxc/<vmid>.conf is on Proxmox),
# which the pct stand-in's `list` and `config` read. GPU passthrough in the forms operators use: PVE 8's device
# entries (devN), and the older cgroup rule plus bind mounts; 301 has none.
PVE_HOSTNAMES = {200: "train-a0", 201: "train-a1", 202: "train-a2", 300: "train-b0", 301: "train-b1"}
PVE_DEV_FORM = ["dev0: /dev/nvidia0", "dev1: /dev/nvidiactl", "dev2: /dev/nvidia-uvm", "dev3: /dev/nvidia-uvm-tools"]
PVE_GPU: dict[int, list[str]] = {
    200: PVE_DEV_FORM,
    201: ["dev0: /dev/nvidia0,gid=44,mode=0666", "dev1: /dev/nvidiactl,gid=44,mode=0666",
          "dev2: /dev/nvidia-uvm,gid=44,mode=0666", "dev3: /dev/nvidia-uvm-tools,gid=44,mode=0666"],
    202: PVE_DEV_FORM,
    300: ["lxc.cgroup2.devices.allow: c 195:* rwm", "lxc.cgroup2.devices.allow: c 508:* rwm",
          *(f"lxc.mount.entry: /dev/{d} dev/{d} none bind,optional,create=file"
            for d in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"))],
    301: [],
}


def pve_conf_text(vmid: int) -> str:
    """A config as Proxmox writes one (write_pct_config): description as comments, options sorted, raw lxc.* last."""
    gpu = PVE_GPU.get(vmid, PVE_DEV_FORM)
    options = [
        "arch: amd64", "cores: 8", *(line for line in gpu if line.startswith("dev")), "features: nesting=1",
        f"hostname: {PVE_HOSTNAMES.get(vmid, f'ct{vmid}')}", "memory: 32768",
        f"net0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:{vmid // 100:02X}:{vmid % 100:02X},ip=dhcp,type=veth",
        "ostype: debian", f"rootfs: local-lvm:vm-{vmid}-disk-0,size=64G", "swap: 512", "unprivileged: 1",
    ]
    raw = [line for line in gpu if line.startswith("lxc.")]
    head = [f"#fleetcuda lab%3A container {vmid} (a stand-in, not Proxmox)"]
    return "\n".join([*head, *sorted(options), *raw, ""])


def ensure_pve_conf(host: LabHost, vmid: int) -> None:
    """Written once: what an operator (or a test) changes in it stays."""
    path = host.dir / "pve" / f"{vmid}.conf"
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(pve_conf_text(vmid))
    tmp.chmod(0o640)  # /etc/pve/lxc/*.conf: root:www-data 0640
    tmp.rename(path)


def state(host: LabHost, vmid: int) -> str:
    out = in_ns(host, "lxc-info", "-P", host.dir / "lxc", "-n", str(vmid), "-s", "-H", check=False)
    return out.stdout.strip()


def start(host: LabHost, vmid: int) -> None:
    if state(host, vmid) != "RUNNING":
        # From inside the host's namespace: LXC's command socket is abstract, so per namespace.
        in_ns(host, "lxc-start", "-P", host.dir / "lxc", "-n", str(vmid))
        in_ns(host, "lxc-wait", "-P", host.dir / "lxc", "-n", str(vmid), "-s", "RUNNING", "-t", "10")


def stop(host: LabHost, vmid: int) -> None:
    if state(host, vmid) == "RUNNING":
        in_ns(host, "lxc-stop", "-P", host.dir / "lxc", "-n", str(vmid), "-k", check=False)


def reset(targets: list[str], hosts: list[LabHost] = HOSTS) -> None:
    for host in hosts:
        for vmid in host.running + host.stopped:
            if targets and f"{host.name}/{vmid}" not in targets:
                continue
            stop(host, vmid)
            delta = container_dir(host, vmid) / "delta"
            shutil.rmtree(delta, ignore_errors=True)
            shutil.rmtree(delta.parent / "olwork", ignore_errors=True)
            delta.mkdir()
            if vmid in host.running:
                start(host, vmid)
    log("containers reset to bare")


# -- commands ------------------------------------------------------------------------------------


def topology_files(name: str) -> tuple[Path, Path]:
    """known_hosts and the `up` marker of a topology."""
    return (KNOWN_HOSTS, LAB / "up") if name == "default" else (LAB / f"known_hosts.{name}", LAB / f"up.{name}")


def up(topology: str = "default") -> None:
    hosts = TOPOLOGIES[topology]
    known_hosts, marker = topology_files(topology)
    missing = [t for t in ("lxc-start", "debootstrap", "sshd", "zsh", "sudo", "nsenter", "dpkg-deb", "gpg")
               if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()]
    if missing:
        raise SystemExit(f"labctl: missing {', '.join(missing)}; tests/run installs them")
    LAB.mkdir(parents=True, exist_ok=True)
    os.chmod(LAB, 0o755)
    if topology == "real":
        build_real()
    else:
        build_standins()
        build_minbase()
        build_base()
    ensure_keys()
    ensure_users()
    shutil.copyfile(HERE / "pct_lxc.py", PCT)
    PCT.chmod(0o755)
    for host in hosts:
        ensure_netns(host)
        ensure_sshd(host)
        for vmid in host.running + host.stopped:
            ensure_container(host, vmid)
            ensure_pve_conf(host, vmid)
            if vmid in host.running:
                start(host, vmid)
            else:
                stop(host, vmid)
    if topology == "default":
        gpu_standins(hosts)
    write_known_hosts(hosts, known_hosts)
    for host in hosts:
        user = host.users[0].name
        probe = run("ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                    "-o", f"UserKnownHostsFile={known_hosts}", "-o", "IdentitiesOnly=yes", "-i", IDENTITY,
                    "-o", "ConnectTimeout=5", f"{user}@{host.address}", "sudo -n /usr/sbin/pct list"
                    if host.users[0].sudo else "/usr/sbin/pct list", check=False)
        if probe.returncode != 0:
            raise SystemExit(f"labctl: host {host.name} is not usable over ssh: {probe.stderr.strip()}")
        log(f"host {host.name} at {host.address}: {len(probe.stdout.splitlines()) - 1} containers")
    marker.write_text(str(os.getpid()))
    if topology == "default":
        log(f"up; inventory: inventories/lab.yaml; known_hosts: {KNOWN_HOSTS}")
    else:
        log(f"{topology} up; known_hosts: {known_hosts}")


def gpu_standins(hosts: list[LabHost]) -> None:
    """The NVIDIA driver's stand-ins for the GPU passthrough check: tests/lab/gpu_standin.py says what they are."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_standin", HERE / "gpu_standin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install(hosts)
    log(f"NVIDIA driver stand-ins: {module.NVIDIA_SMI} (driver {module.DRIVER} per lab host), the libraries in "
        "every container")


def down(purge: bool, topology: str = "default") -> None:
    hosts = TOPOLOGIES[topology]
    known_hosts, marker = topology_files(topology)
    for host in hosts:
        if Path(f"/run/netns/{host.netns}").exists():
            for vmid in host.running + host.stopped:
                if container_dir(host, vmid).exists():
                    stop(host, vmid)
        pid = sshd_pid(host)
        if pid:
            os.kill(pid, 15)
        run("ip", "link", "del", f"fcl-{host.name}", check=False)
        if Path(f"/run/netns/{host.netns}").exists():
            run("ip", "netns", "del", host.netns, check=False)
        if purge and topology != "default":
            shutil.rmtree(host.dir, ignore_errors=True)
    marker.unlink(missing_ok=True)
    if purge and topology != "default":
        known_hosts.unlink(missing_ok=True)
        log(f"{topology} down and purged")
        return
    if purge:
        SUDOERS.unlink(missing_ok=True)
        if PCT.exists() and "fleetcuda lab stand-in" in PCT.read_text(errors="replace"):
            PCT.unlink()
        shutil.rmtree(LAB, ignore_errors=True)
    log(("" if topology == "default" else f"{topology} ") + "down" + (" and purged" if purge else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up")
    s = sub.add_parser("status")
    r = sub.add_parser("reset")
    r.add_argument("targets", nargs="*", help="host/vmid (default: all)")
    d = sub.add_parser("down")
    d.add_argument("--purge", action="store_true")
    for p in (u, s, r, d):
        p.add_argument("--topology", choices=list(TOPOLOGIES), default="default",
                       help="which fleet (default: the lab of inventories/lab.yaml; bench-*: for benchmarks/)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("labctl: needs root")
    if args.cmd == "up":
        up(args.topology)
    elif args.cmd == "reset":
        reset(args.targets, TOPOLOGIES[args.topology])
    elif args.cmd == "down":
        down(args.purge, args.topology)
    else:
        for host in TOPOLOGIES[args.topology]:
            for vmid in host.running + host.stopped:
                print(f"{host.name}/{vmid} {state(host, vmid) if Path(f'/run/netns/{host.netns}').exists() else '-'}")


if __name__ == "__main__":
    main()
